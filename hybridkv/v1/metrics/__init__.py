"""vLLM's `vllm.v1.metrics` path."""
