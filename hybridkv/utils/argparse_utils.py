"""vLLM's `vllm.utils.argparse_utils` path: `FlexibleArgumentParser` (hybridkv/engine/arg_utils.py)."""

from hybridkv.engine.arg_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
