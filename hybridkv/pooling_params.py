"""vLLM's `vllm.pooling_params` path: `PoolingParams` under the name vLLM's code imports."""

from hybridkv.engine.pooling import PoolingParams

__all__ = ["PoolingParams"]
