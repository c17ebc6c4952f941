"""Test helpers for the kernels: a random paged batch and a dense fp64 reference attention.

The batch is built the way the allocator lays it out: real blocks get distinct random ids, blocks
wholly before the step's sliding window are the null block (id 0), and every slot that holds no
real token (the null block included) is filled with ``garbage`` so that any read of it shows. With
``in_flight`` the step's own rows are not stored at all (its blocks wholly past the context are the
null block, the engine's layout for a window's middle of a chunk): they come as ``step_keys`` and
``step_values``, for attention to read in flight. A ``cache_dtype`` other than ``dtype`` (16-bit, or
fp8 with ``k_scale``/``v_scale``) stores every key as the engine's cache would (``quant.as_cached``).

With HYBRIDKV_TEST_ON_GPU=1 (benchmarks/gpu_check.sh) the batch's query, caches and metadata are on the
GPU, so that the "triton" backend runs compiled; the reference stays on the CPU in fp64.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import partial

import torch

from hybridkv.kernels import PagedAttentionMetadata, kv_page_views
from hybridkv.kernels.quant import as_cached

from tiny_models import DEVICE


@dataclass
class PagedBatch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    metadata: PagedAttentionMetadata
    dense_keys: list[torch.Tensor]
    dense_values: list[torch.Tensor]
    step_keys: torch.Tensor
    step_values: torch.Tensor


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    garbage: float = float("nan"),
    seed: int = 0,
    value_head_dim: int | None = None,
    in_pages: bool = False,
    attention_chunk_size: int | None = None,
    in_flight: bool = False,
    cache_dtype: torch.dtype | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> PagedBatch:
    """Random query rows and K/V for the given sequences, stored in a paged cache. With `in_pages`
    the caches are a layer's views into shared pages (as the engine allocates them): K and V sit
    between another layer's slot and padding, all filled with `garbage`."""
    generator = torch.Generator().manual_seed(seed)
    shuffler = random.Random(seed)
    blocks_per_seq = [math.ceil(seq_len / block_size) for seq_len in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    free_ids = list(range(1, num_blocks))
    shuffler.shuffle(free_ids)

    value_head_dim = value_head_dim or head_dim
    cache_dtype = cache_dtype or dtype
    if in_pages:
        slot_bytes = block_size * num_kv_heads * (head_dim + value_head_dim) * cache_dtype.itemsize
        pages = torch.full((num_blocks, 3 * slot_bytes // cache_dtype.itemsize), garbage).to(cache_dtype)
        page_views = partial(
            kv_page_views,
            offset_bytes=slot_bytes,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            value_head_dim=value_head_dim,
        )
        key_cache, value_cache = page_views(pages)
    else:
        key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), garbage).to(cache_dtype)
        value_cache = torch.full((num_blocks, block_size, num_kv_heads, value_head_dim), garbage).to(cache_dtype)
    block_table: list[list[int]] = []
    dense_keys: list[torch.Tensor] = []
    dense_values: list[torch.Tensor] = []
    for query_len, seq_len, num_seq_blocks in zip(query_lens, seq_lens, blocks_per_seq, strict=True):
        keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        values = torch.randn(seq_len, num_kv_heads, value_head_dim, generator=generator).to(dtype)
        first_needed = 0
        if sliding_window is not None:
            first_needed = max(0, seq_len - query_len - sliding_window + 1)
        if attention_chunk_size is not None:
            first_needed = (seq_len - query_len) // attention_chunk_size * attention_chunk_size
        stored_len = seq_len - query_len if in_flight else seq_len
        row = []
        for block in range(num_seq_blocks):
            if (block + 1) * block_size <= first_needed or block * block_size >= stored_len:
                row.append(0)
                continue
            block_id = free_ids.pop()
            row.append(block_id)
            for offset in range(min(block_size, stored_len - block * block_size)):
                position = block * block_size + offset
                key_cache[block_id, offset] = as_cached(keys[position], cache_dtype, k_scale)
                value_cache[block_id, offset] = as_cached(values[position], cache_dtype, v_scale)
        block_table.append(row)
        dense_keys.append(keys)
        dense_values.append(values)
    query = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=generator).to(dtype)
    metadata = PagedAttentionMetadata.build(query_lens, seq_lens, block_table, block_size, DEVICE)
    if DEVICE.type != "cpu":
        query = query.to(DEVICE)
        key_cache, value_cache = (
            page_views(pages.to(DEVICE)) if in_pages else (key_cache.to(DEVICE), value_cache.to(DEVICE))
        )
    step_keys = torch.cat([keys[len(keys) - n :] for keys, n in zip(dense_keys, query_lens, strict=True)])
    step_values = torch.cat([values[len(values) - n :] for values, n in zip(dense_values, query_lens, strict=True)])
    return PagedBatch(
        query, key_cache, value_cache, metadata, dense_keys, dense_values, step_keys.to(DEVICE), step_values.to(DEVICE)
    )


def on_device(options: dict) -> dict:
    """Keyword arguments of a kernel call with every tensor (sinks) on the batch's device."""
    return {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in options.items()}


def reference_attention(
    batch: PagedBatch,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk_size: int | None = None,
    key_limits=None,
) -> torch.Tensor:
    """Dense masked softmax attention in fp64, per sequence, from the dense K/V (never the cache); with
    ``key_limits`` its listed rows see on to their last visible position (windows count from their own)."""
    extra = dict(key_limits.rows) if key_limits is not None else {}
    metadata = batch.metadata
    num_q_heads = batch.query.shape[1]
    outputs = []
    query_start = 0
    for seq, (query_len, seq_len) in enumerate(zip(metadata.query_lens_list, metadata.seq_lens_list, strict=True)):
        query = batch.query[query_start : query_start + query_len].cpu().double().transpose(0, 1)
        extras = torch.tensor([extra.get(row, 0) for row in range(query_start, query_start + query_len)])[:, None]
        query_start += query_len
        group = num_q_heads // batch.dense_keys[seq].shape[1]
        keys = batch.dense_keys[seq].double().repeat_interleave(group, dim=1).transpose(0, 1)
        values = batch.dense_values[seq].double().repeat_interleave(group, dim=1).transpose(0, 1)
        logits = query @ keys.transpose(1, 2) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        query_positions = torch.arange(seq_len - query_len, seq_len)[:, None]
        key_positions = torch.arange(seq_len)[None, :]
        visible = key_positions <= query_positions + extras
        if sliding_window is not None:
            visible &= key_positions > query_positions - sliding_window
        if attention_chunk_size is not None:
            visible &= key_positions // attention_chunk_size == query_positions // attention_chunk_size
        logits = logits.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink_column = sinks.cpu().double().view(num_q_heads, 1, 1).expand(num_q_heads, query_len, 1)
            logits = torch.cat([logits, sink_column], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :seq_len]
        outputs.append((probs @ values).transpose(0, 1))
    return torch.cat(outputs)


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.cpu().double() - expected.cpu()).abs().max().item()
