"""vLLM's `vllm.utils` path: `FlexibleArgumentParser` (hybridkv/engine/arg_utils.py)."""

from hybridkv.engine.arg_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
