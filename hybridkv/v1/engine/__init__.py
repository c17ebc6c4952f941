"""vLLM's `vllm.v1.engine` path."""
