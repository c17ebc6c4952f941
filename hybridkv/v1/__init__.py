"""vLLM's `vllm.v1` paths, for vLLM code whose import line names them."""
