"""vLLM's `vllm.benchmarks` path: the datasets its benchmark and example scripts draw prompts from."""
