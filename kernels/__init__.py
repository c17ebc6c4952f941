"""Paged attention: KV tensors, cache write, Triton kernels (CUDA) and the torch path (CPU)."""
