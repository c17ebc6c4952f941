"""vLLM's `vllm.sampling_params` path: the sampling parameter classes under the names vLLM's code imports."""

from hybridkv.sampling.beam_search import BeamSearchParams
from hybridkv.scheduling.sampling_params import RequestOutputKind, SamplingParams
from hybridkv.scheduling.structured_params import StructuredOutputsParams

__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
