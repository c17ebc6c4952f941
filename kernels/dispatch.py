"""The public entry points: validate once, pick a backend by device, call the torch or Triton path."""

from __future__ import annotations

import os
from typing import Literal

import torch

from .metadata import PagedAttentionMetadata
from .torch_attention import torch_paged_attention, torch_write_kv

Backend = Literal["torch", "triton"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def resolve_backend(backend: str | None, device: torch.device) -> Backend:
    """``backend`` if given, else "triton" for CUDA tensors and "torch" for everything else.

    Triton on a non-CUDA device needs the interpreter (``TRITON_INTERPRET=1`` set before
    ``hybridkv.kernels`` runs its first Triton call); anything else raises a ValueError naming the fix.
    """
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return "torch"
    if backend != "triton":
        raise ValueError(f"backend must be 'torch', 'triton' or None, got {backend!r}")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' on a {device.type} tensor needs the Triton interpreter: "
            "set TRITON_INTERPRET=1 before importing hybridkv.kernels, or use backend='torch'"
        )
    return "triton"


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str | None = None,
) -> None:
    """Store this step's K/V rows in the cache, in place.

    key: ``[num_tokens, num_kv_heads, head_dim]``, value ``[num_tokens, num_kv_heads, v_head_dim]``;
    caches: ``[num_blocks, block_size, num_kv_heads, head_dim or v_head_dim]`` (any block stride: a
    layer's views into a page); slot_mapping: int ``[num_tokens]``, row t goes to slot
    ``slot_mapping[t]``, and -1 (padding) leaves the cache untouched.
    """
    if key.dim() != 3 or value.dim() != 3 or key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key and value must be [num_tokens, num_kv_heads, head_dim], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    _check_cache(key_cache, value_cache, key.shape[1], key.shape[2], value.shape[2])
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if resolve_backend(backend, key.device) == "triton":
        from .triton_cache_write import triton_write_kv

        triton_write_kv(key, value, key_cache, value_cache, slot_mapping)
    else:
        torch_write_kv(key, value, key_cache, value_cache, slot_mapping)


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
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_q_heads, head_dim], got {tuple(query.shape)}")
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2] if key_cache.dim() == 4 else 0
    _check_cache(key_cache, value_cache, num_kv_heads, head_dim, value_cache.shape[-1])
    if query.dtype not in _SUPPORTED_DTYPES or key_cache.dtype != query.dtype:
        raise ValueError(f"query and cache must share one of fp32/fp16/bf16, got {query.dtype} and {key_cache.dtype}")
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
    if resolve_backend(backend, query.device) == "triton":
        from .triton_attention import triton_paged_attention

        return triton_paged_attention(
            query, key_cache, value_cache, metadata, scale, sliding_window, softcap, sinks, attention_chunk_size
        )
    return torch_paged_attention(
        query, key_cache, value_cache, metadata, scale, sliding_window, softcap, sinks, attention_chunk_size
    )


def _check_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor, num_kv_heads: int, head_dim: int, value_head_dim: int
) -> None:
    if key_cache.dim() != 4 or value_cache.dim() != 4 or key_cache.shape[:3] != value_cache.shape[:3]:
        raise ValueError(
            "key_cache and value_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.shape[2] != num_kv_heads or key_cache.shape[3] != head_dim or value_cache.shape[3] != value_head_dim:
        raise ValueError(
            f"the cache holds {key_cache.shape[2]} kv heads of dims {key_cache.shape[3]} (K) and "
            f"{value_cache.shape[3]} (V), the inputs {num_kv_heads} of dims {head_dim} and {value_head_dim}"
        )
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key_cache and value_cache need a contiguous last dimension (allocate_kv_cache gives one)")
