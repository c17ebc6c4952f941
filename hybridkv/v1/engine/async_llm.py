"""vLLM's `vllm.v1.engine.async_llm` path: `AsyncLLM` (hybridkv/async_engine.py)."""

from hybridkv.async_engine import AsyncLLM

__all__ = ["AsyncLLM"]
