"""Paged attention: KV tensors, cache write, Triton kernels (CUDA) and the torch path (CPU).

Module map: ``cache`` (layout, sizing, allocation), ``quant`` (cache dtypes: 16/32-bit and fp8 with
per-layer scales; how a row becomes what a page holds), ``metadata`` (per-step data: a step's lengths,
shared by its groups, and each group's block table), ``backend`` (backend choice), ``dispatch`` (the
entry points: checked ones, and the engine's unchecked ones), ``torch_plan`` and ``torch_attention``
(the CPU path), ``triton_attention``, ``triton_cache_write`` and ``triton_common`` (the Triton kernels,
imported on first use), ``latent_attention`` and ``triton_latent`` (latent attention layers' step), ``triton_lora``
(LoRA's shrink and expand kernels, hybridkv/execution/lora.py's CUDA path).

Nothing here imports the rest of ``hybridkv``: only relative imports, torch and triton (the bottom layer,
docs/design.md). The folder lives inside ``hybridkv/``: at the repository's root it was importable as a
top-level ``kernels`` from there (``python -m``, pytest), the name of Hugging Face's kernels package, which
transformers 5.25 imports while it initializes.
"""

from __future__ import annotations

from .backend import resolve_backend
from .cache import (
    NULL_BLOCK_ID,
    allocate_kv_cache,
    allocate_kv_pages,
    kv_page_views,
    num_blocks_for_budget,
    num_blocks_for_memory_utilization,
)
from .dispatch import attend, check_layer_cache, paged_attention, store_kv, write_kv
from .metadata import PagedAttentionMetadata, StepMetadata, build_step_metadata

__all__ = [
    "NULL_BLOCK_ID",
    "PagedAttentionMetadata",
    "StepMetadata",
    "allocate_kv_cache",
    "allocate_kv_pages",
    "attend",
    "build_step_metadata",
    "check_layer_cache",
    "kv_page_views",
    "num_blocks_for_budget",
    "num_blocks_for_memory_utilization",
    "paged_attention",
    "resolve_backend",
    "store_kv",
    "write_kv",
]
