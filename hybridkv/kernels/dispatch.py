"""The public entry points: checked calls for direct callers, unchecked ones for an engine's hot path.

`write_kv` and `paged_attention` check every input and pick the backend on every call. An engine
checks once instead: the lengths when it builds a step's metadata (`StepMetadata.build`, which also
resolves the backend for the step's device), each layer's cache when it builds the layer's views
(`check_layer_cache`); then every layer calls `attend` and `store_kv`, which check nothing a step or
a layer fixes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .backend import Backend, resolve_backend
from .metadata import KeyLimits, PagedAttentionMetadata
from .quant import CACHE_DTYPES, QUERY_DTYPES, check_fp8_device, check_scales
from .torch_attention import torch_paged_attention, torch_write_kv

_CACHE_DTYPE_NAMES = "fp32/fp16/bf16" + ("/fp8 (e4m3fn, e5m2)" if len(CACHE_DTYPES) > 3 else "")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store this step's K/V rows in the cache, in place.

    key: ``[num_tokens, num_kv_heads, head_dim]``, value ``[num_tokens, num_kv_heads, v_head_dim]``;
    caches: ``[num_blocks, block_size, num_kv_heads, head_dim or v_head_dim]`` (any block stride: a
    layer's views into a page); slot_mapping: int ``[num_tokens]``, row t goes to slot
    ``slot_mapping[t]``, and -1 (padding) leaves the cache untouched. A cache of another dtype than the
    rows stores them rounded to it; an fp8 cache stores ``key / k_scale`` and ``value / v_scale``,
    clamped to its range (``hybridkv.kernels.quant``).
    """
    if key.dim() != 3 or value.dim() != 3 or key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key and value must be [num_tokens, num_kv_heads, head_dim], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    _check_cache(key_cache, value_cache, key.shape[1], key.shape[2], value.shape[2])
    _check_rows_dtype("key", key)
    check_scales(key_cache.dtype, k_scale, v_scale)
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    _write(resolve_backend(backend, key.device), key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: str | None = None,
    attention_chunk_size: int | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    key_limits: KeyLimits | None = None,
) -> torch.Tensor:
    """Causal attention of this step's query rows over the paged cache, as transformers computes it.

    query: ``[num_tokens, num_q_heads, head_dim]``, the rows of ``metadata`` in order (rows past
    ``metadata.num_query_tokens`` are padding and come back as zeros). A query at position i sees keys
    at positions ``(i - sliding_window, i]``, or with ``attention_chunk_size`` C those of its own chunk,
    ``[C * (i // C), i]`` (all of ``[0, i]`` with neither). Logits are
    ``scale * q.k``, then ``softcap * tanh(logits / softcap)`` if softcap is set; ``sinks``
    (``[num_q_heads]``) adds one logit per q head to the softmax denominator with no value (GPT-OSS).
    q head h reads kv head ``h // (num_q_heads // num_kv_heads)``. Accumulates in fp32; returns
    ``[num_tokens, num_q_heads, v_head_dim]`` in query's dtype (V rows may be narrower than K rows).
    ``backend`` None: the one the metadata's step resolved for its device.

    With ``key`` and ``value`` (the step's own rows, ``[num_tokens, num_kv_heads, dim]``), the keys at
    the step's positions are read from them, as the cache would hold them, and only earlier keys from
    the cache: the step's blocks need not hold its rows (store them afterwards, or never). Without,
    every key is read from the cache, so the rows must be stored first. The cache may be of another
    dtype than the query (fp32/fp16/bf16, or fp8 read as stored value x ``k_scale`` / ``v_scale``).
    ``key_limits`` lets listed rows see later keys of the step (an image's tokens attending both ways).
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_q_heads, head_dim], got {tuple(query.shape)}")
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2] if key_cache.dim() == 4 else 0
    _check_cache(key_cache, value_cache, num_kv_heads, head_dim, value_cache.shape[-1])
    _check_rows_dtype("query", query)
    check_scales(key_cache.dtype, k_scale, v_scale)
    _check_step_rows(key, value, metadata.num_query_tokens, num_kv_heads, head_dim, value_cache.shape[-1])
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if num_tokens < metadata.num_query_tokens:
        raise ValueError(f"metadata describes {metadata.num_query_tokens} query rows, query has {num_tokens}")
    if metadata.block_table.device != query.device or key_cache.device != query.device:
        raise ValueError(
            f"query ({query.device}), cache ({key_cache.device}) and metadata "
            f"({metadata.block_table.device}) must be on one device; build the metadata with "
            "PagedAttentionMetadata.build(..., device=query.device)"
        )
    if metadata.block_size != key_cache.shape[1]:
        raise ValueError(f"metadata uses block_size {metadata.block_size}, the cache {key_cache.shape[1]}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if attention_chunk_size is not None and (attention_chunk_size < 1 or sliding_window is not None):
        raise ValueError(
            f"attention_chunk_size must be None or >= 1, and not given with a sliding window; got "
            f"{attention_chunk_size} with sliding_window={sliding_window}"
        )
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")
    if sinks is not None and sinks.shape != (num_q_heads,):
        raise ValueError(f"sinks must be [num_q_heads={num_q_heads}], got {tuple(sinks.shape)}")
    backend = metadata.step.backend if backend is None else resolve_backend(backend, query.device)
    options = _Options(
        scale, sliding_window, softcap, sinks, attention_chunk_size, key, value, k_scale, v_scale, key_limits
    )
    out, _ = _attention(backend, query, key_cache, value_cache, metadata, options)
    return out


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``write_kv`` at ``metadata.slot_mapping`` with the step's backend, unchecked: for an engine that
    checked the layer's cache once (``check_layer_cache``) and passes the step's own K/V rows."""
    _write(metadata.step.backend, key, value, key_cache, value_cache, metadata.slot_mapping, k_scale, v_scale)


def attend(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk_size: int | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    store: bool = False,
    key_limits: KeyLimits | None = None,
) -> torch.Tensor:
    """``paged_attention`` with the step's backend, for an engine's hot path: it checks only the query's
    dtype (autocast may change it from call to call). With ``store`` the step's ``key``/``value`` rows
    are in the cache when it returns, as ``store_kv`` puts them (after the attention read them: the
    CPU decode kernel stores them itself on a step of decode rows only).

    The caller guarantees what ``paged_attention`` would check: the cache passed ``check_layer_cache``
    with the query's head count, the query (and ``key``/``value``, the step's own rows, when given)
    holds the step's rows on the metadata's device, the metadata was built with the cache's block size,
    and the window, chunk size, softcap, sinks and scales are valid.
    """
    _check_rows_dtype("query", query)
    options = _Options(
        scale, sliding_window, softcap, sinks, attention_chunk_size, key, value, k_scale, v_scale, key_limits
    )
    out, stored = _attention(metadata.step.backend, query, key_cache, value_cache, metadata, options, store)
    if store and not stored and key is not None and value is not None:
        store_kv(key, value, key_cache, value_cache, metadata, k_scale, v_scale)
    return out


def check_layer_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, num_q_heads: int | None = None) -> None:
    """Check what ``attend`` and ``store_kv`` take for granted about one layer's cache, once, where an
    engine builds the layer's views: ``[num_blocks, block_size, num_kv_heads, head_dim]`` K and V (V's
    head dim may differ) with a contiguous last dimension, one dtype of fp32/fp16/bf16/fp8 that the
    device's kernels read, and, given the layer's query head count, a whole number of q heads per kv
    head. Raises a ValueError naming the fix.
    """
    _check_cache_shapes(key_cache, value_cache)
    _check_cache_strides(key_cache, value_cache)
    if key_cache.dtype not in CACHE_DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"key_cache and value_cache must share one of {_CACHE_DTYPE_NAMES}, got {key_cache.dtype} and "
            f"{value_cache.dtype}"
        )
    check_fp8_device(key_cache.dtype, key_cache.device)
    num_kv_heads = key_cache.shape[2]
    if num_q_heads is not None and num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


class _Options(NamedTuple):
    """An attention call's settings past the tensors, in the order both backends take them."""

    scale: float
    sliding_window: int | None
    softcap: float | None
    sinks: torch.Tensor | None
    attention_chunk_size: int | None
    key: torch.Tensor | None
    value: torch.Tensor | None
    k_scale: float
    v_scale: float
    key_limits: KeyLimits | None = None


def _write(
    backend: Backend,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    if backend == "triton":
        from .triton_cache_write import triton_write_kv

        triton_write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    else:
        torch_write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def _attention(
    backend: Backend,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    options: _Options,
    store: bool = False,
) -> tuple[torch.Tensor, bool]:
    """The attention, and whether it stored the step's rows too (asked to ``store``; only the CPU decode
    kernel does)."""
    if backend == "triton":
        from .triton_attention import triton_paged_attention

        return triton_paged_attention(query, key_cache, value_cache, metadata, *options), False
    return torch_paged_attention(query, key_cache, value_cache, metadata, *options, store=store)


def _check_rows_dtype(name: str, rows: torch.Tensor) -> None:
    if rows.dtype not in QUERY_DTYPES:
        raise ValueError(f"{name} must be fp32, fp16 or bf16 (the cache may be of another dtype), got {rows.dtype}")


def _check_step_rows(
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    num_query_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    value_head_dim: int,
) -> None:
    if key is None and value is None:
        return
    if key is None or value is None:
        raise ValueError("pass the step's key and value rows together, or neither")
    if (
        key.dim() != 3
        or value.dim() != 3
        or (key.shape[1:], value.shape[1:])
        != (
            (num_kv_heads, head_dim),
            (num_kv_heads, value_head_dim),
        )
    ):
        raise ValueError(
            f"key and value rows must be [num_tokens, {num_kv_heads}, {head_dim}] and "
            f"[num_tokens, {num_kv_heads}, {value_head_dim}], got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if min(key.shape[0], value.shape[0]) < num_query_tokens:
        raise ValueError(f"the metadata describes {num_query_tokens} rows, key and value hold {key.shape[0]}")
    _check_rows_dtype("key", key)
    _check_rows_dtype("value", value)


def _check_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor, num_kv_heads: int, head_dim: int, value_head_dim: int
) -> None:
    _check_cache_shapes(key_cache, value_cache)
    if key_cache.shape[2] != num_kv_heads or key_cache.shape[3] != head_dim or value_cache.shape[3] != value_head_dim:
        raise ValueError(
            f"the cache holds {key_cache.shape[2]} kv heads of dims {key_cache.shape[3]} (K) and "
            f"{value_cache.shape[3]} (V), the inputs {num_kv_heads} of dims {head_dim} and {value_head_dim}"
        )
    _check_cache_strides(key_cache, value_cache)


def _check_cache_shapes(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or value_cache.dim() != 4 or key_cache.shape[:3] != value_cache.shape[:3]:
        raise ValueError(
            "key_cache and value_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )


def _check_cache_strides(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key_cache and value_cache need a contiguous last dimension (allocate_kv_cache gives one)")
