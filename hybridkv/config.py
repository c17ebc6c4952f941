"""`EngineConfig`: every setting `hybridkv.patch(model, **config)` accepts."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EngineConfig:
    """Everything `hybridkv.patch(model, **config)` accepts (names follow vLLM).

    KV memory: `num_blocks` if given, else `kv_cache_memory` bytes, else on CUDA
    `gpu_memory_utilization` of the device, else 1 GiB on the CPU. `swap_space` bytes of CPU memory
    hold requests preempted with `preemption_mode="swap"` (never more blocks than the device pool).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: torch.dtype | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: int = 0
    attention_backend: str | None = None
