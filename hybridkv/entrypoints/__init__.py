"""vLLM's entry points under vLLM's module paths (`vllm.entrypoints.llm.LLM`)."""
