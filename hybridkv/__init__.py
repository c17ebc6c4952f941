"""hybridkv: a paged, hybrid-attention-aware KV-cache manager for Hugging Face transformers models."""

__version__ = "0.1.0"
