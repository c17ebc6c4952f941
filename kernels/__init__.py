"""Paged attention: KV tensors, cache write, Triton kernels (CUDA) and the torch path (CPU).

Module map: ``cache`` (layout, sizing, allocation), ``metadata`` (per-step data shared by a group's
layers), ``dispatch`` (the public entry points and backend choice), ``torch_attention`` (CPU path),
``triton_attention`` and ``triton_cache_write`` (the Triton kernels, imported on first use).
"""

from __future__ import annotations

from hybridkv.utils import NULL_BLOCK_ID

from .cache import (
    allocate_kv_cache,
    allocate_kv_pages,
    kv_page_views,
    num_blocks_for_budget,
    num_blocks_for_memory_utilization,
)
from .dispatch import paged_attention, resolve_backend, write_kv
from .metadata import PagedAttentionMetadata

__all__ = [
    "NULL_BLOCK_ID",
    "PagedAttentionMetadata",
    "allocate_kv_cache",
    "allocate_kv_pages",
    "kv_page_views",
    "num_blocks_for_budget",
    "num_blocks_for_memory_utilization",
    "paged_attention",
    "resolve_backend",
    "write_kv",
]
