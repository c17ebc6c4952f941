"""hybridkv: a paged, hybrid-attention-aware KV-cache manager for Hugging Face transformers models."""

from hybridkv.async_engine import AsyncLLM, AsyncLLMEngine
from hybridkv.engine.arg_utils import AsyncEngineArgs, EngineArgs
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.engine.pooling import PoolingParams
from hybridkv.entrypoints.llm import LLM
from hybridkv.execution.config import EngineConfig
from hybridkv.execution.sizing import min_num_blocks
from hybridkv.lora.request import LoRARequest
from hybridkv.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    StreamDelta,
)
from hybridkv.patching import is_patched, patch, unpatch
from hybridkv.sampling.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from hybridkv.scheduling.sampling_params import RequestOutputKind, SamplingParams
from hybridkv.scheduling.structured_params import StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # `serve` needs the `serve` extra (FastAPI, uvicorn): imported on first use, not with hybridkv.
    if name == "serve":
        from hybridkv.serving import serve

        return serve
    raise AttributeError(f"module 'hybridkv' has no attribute {name!r}")


__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLM",
    "AsyncLLMEngine",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StreamDelta",
    "StructuredOutputsParams",
    "is_patched",
    "min_num_blocks",
    "patch",
    "serve",
    "unpatch",
]
