"""Unified paged attention in Triton: prefill chunks and decodes in one launch.

One program handles a tile of ``BLOCK_Q`` query tokens of one sequence and one kv head; its
``BLOCK_M = BLOCK_Q * QUERIES_PER_KV`` rows are (token, q head of the group) pairs, so GQA reads each
KV tile once for the whole group. It loops over the keys the tile can see in tiles of ``TILE_N``
tokens (block ids looked up per key, so TILE_N is independent of the cache block size), with an
online softmax in base 2. Keys before the tile's window are never loaded: that is what keeps null
blocks (out-of-window entries of the block table) unread. With the step's own K/V rows given (in
flight), keys at the step's positions are read from them, as the cache would hold them, and the
cache is read only before the sequence's first query; a second loop goes over the in-flight keys.
Pages of another dtype than the query (bf16 for an fp32 model, fp8) are converted on load; fp8 pages
hold key / k_scale and value / v_scale, so the K scale joins the logit scale and the V scale the output.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .metadata import KeyLimits, PagedAttentionMetadata
from .quant import is_fp8, triton_format
from .triton_common import as_cached, online_softmax_step, visible_keys

# Read at import, the same moment @triton.jit reads it.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def paged_attention_kernel(
    out_ptr,
    partial_ptr,
    stats_ptr,
    query_ptr,
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    tile_seq_ids_ptr,
    tile_starts_ptr,
    sinks_ptr,
    key_limits_ptr,
    scale,
    softcap,
    k_scale,
    v_scale,
    sliding_window,
    chunk_size,
    stride_query_token,
    stride_query_head,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_out_token,
    stride_out_head,
    stride_key_block,
    stride_key_cache_head,
    stride_key_slot,
    stride_value_block,
    stride_value_cache_head,
    stride_value_slot,
    stride_table_seq,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_LIMITS: tl.constexpr,
    IN_FLIGHT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr,
    FP8_MIN_EXPONENT: tl.constexpr,
    ROUND_TO_BF16: tl.constexpr,
    UPCAST: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = tl.load(tile_seq_ids_ptr + tile)
    tile_start = tl.load(tile_starts_ptr + tile)
    query_begin = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - query_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    row_token = tile_start + rows // QUERIES_PER_KV
    row_head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows // QUERIES_PER_KV < BLOCK_Q) & (row_token < query_len)
    row_position = context_len + row_token
    row_last = row_position
    if USE_LIMITS:  # rows of an image that attends both ways see on to its last token (in this step)
        row_last = tl.load(key_limits_ptr + query_begin + row_token, mask=row_valid, other=0)
        row_last = tl.maximum(row_last, row_position)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    value_dims = tl.arange(0, HEAD_DIM_V_PADDED)
    value_dim_valid = value_dims < HEAD_DIM_V

    query_offsets = (
        (query_begin + row_token).to(tl.int64)[:, None] * stride_query_token
        + row_head[:, None] * stride_query_head
        + dims[None, :]
    )
    query_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(query_ptr + query_offsets, mask=query_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    if USE_SINKS:
        # The sink joins the denominator as one more logit with no value: start from it (split: in the first
        # segment only).
        sink = tl.load(sinks_ptr + row_head, mask=row_valid, other=0.0).to(tl.float32)
        running_max = tl.where(segment == 0, sink * 1.4426950408889634, float("-inf"))
        running_sum = tl.where(segment == 0, tl.full([BLOCK_M], 1.0, dtype=tl.float32), 0.0)
    else:
        running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PADDED], dtype=tl.float32)
    # An fp8 page holds key / k_scale: the K scale joins the logit scale, the V scale the output.
    scale = scale * k_scale

    key_end = tl.minimum(context_len + tile_start + BLOCK_Q, seq_len)
    if USE_LIMITS:
        key_end = tl.minimum(tl.maximum(key_end, tl.max(tl.where(row_valid, row_last, 0)) + 1), seq_len)
    key_start = 0
    if USE_WINDOW:
        key_start = tl.maximum(context_len + tile_start - sliding_window + 1, 0)
    if USE_CHUNK:
        # The tile's first query sits in the earliest chunk of the tile: nothing before it is visible.
        key_start = (context_len + tile_start) // chunk_size * chunk_size
    if NUM_SEGMENTS > 1:  # split-KV: this program's segment of the keys, whole key tiles long
        segment_len = tl.cdiv(tl.cdiv(key_end - key_start, NUM_SEGMENTS), TILE_N) * TILE_N
        key_start = key_start + segment * segment_len
        key_end = tl.minimum(key_start + segment_len, key_end)
    # In flight, the step's own keys come from its K/V rows; only earlier ones from the pages.
    cache_end = key_end
    if IN_FLIGHT:
        cache_end = tl.minimum(key_end, context_len)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table_seq
    key_head_base = key_cache_ptr + kv_head.to(tl.int64) * stride_key_cache_head
    value_head_base = value_cache_ptr + kv_head.to(tl.int64) * stride_value_cache_head

    for tile_key_start in range(key_start, cache_end, TILE_N):
        key_positions = tile_key_start + tl.arange(0, TILE_N)
        key_valid = key_positions < cache_end
        block_ids = tl.load(table_row + key_positions // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slots = (key_positions % BLOCK_SIZE).to(tl.int64)
        key_offsets = block_ids[None, :] * stride_key_block + slots[None, :] * stride_key_slot + dims[:, None]
        k = tl.load(key_head_base + key_offsets, mask=dim_valid[:, None] & key_valid[None, :], other=0.0)
        value_offsets = (
            block_ids[:, None] * stride_value_block + slots[:, None] * stride_value_slot + value_dims[None, :]
        )
        v = tl.load(value_head_base + value_offsets, mask=key_valid[:, None] & value_dim_valid[None, :], other=0.0)
        visible = visible_keys(
            key_positions, key_valid, row_position, row_last, sliding_window, chunk_size, USE_WINDOW, USE_CHUNK
        )
        acc, running_max, running_sum = online_softmax_step(
            q, k.to(q.dtype), v.to(q.dtype), visible, acc, running_max, running_sum, scale, softcap, USE_SOFTCAP
        )

    if IN_FLIGHT:
        key_head_rows = key_ptr + kv_head.to(tl.int64) * stride_key_head
        value_head_rows = value_ptr + kv_head.to(tl.int64) * stride_value_head
        cache_type = key_cache_ptr.dtype.element_ty
        for tile_key_start in range(tl.maximum(key_start, context_len), key_end, TILE_N):
            key_positions = tile_key_start + tl.arange(0, TILE_N)
            key_valid = key_positions < key_end
            key_rows = (query_begin + key_positions - context_len).to(tl.int64)
            k = tl.load(
                key_head_rows + key_rows[None, :] * stride_key_token + dims[:, None],
                mask=dim_valid[:, None] & key_valid[None, :],
                other=0.0,
            )
            v = tl.load(
                value_head_rows + key_rows[:, None] * stride_value_token + value_dims[None, :],
                mask=key_valid[:, None] & value_dim_valid[None, :],
                other=0.0,
            )
            k = as_cached(k, k_scale, cache_type, FP8_MAX, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, ROUND_TO_BF16)
            v = as_cached(v, v_scale, cache_type, FP8_MAX, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, ROUND_TO_BF16)
            k, v = k.to(q.dtype), v.to(q.dtype)
            visible = visible_keys(
                key_positions, key_valid, row_position, row_last, sliding_window, chunk_size, USE_WINDOW, USE_CHUNK
            )
            acc, running_max, running_sum = online_softmax_step(
                q, k, v, visible, acc, running_max, running_sum, scale, softcap, USE_SOFTCAP
            )

    if NUM_SEGMENTS > 1:  # the segment's running max, sum and unnormalised values: reduce_segments_kernel
        # Layout: [query token, q head, segment] (x HEAD_DIM_V_PADDED for the values, x 2 for max and sum).
        entry = ((query_begin + row_token).to(tl.int64) * tl.num_programs(1) * QUERIES_PER_KV + row_head) * (
            NUM_SEGMENTS
        ) + segment
        tl.store(stats_ptr + entry * 2, running_max, mask=row_valid)
        tl.store(stats_ptr + entry * 2 + 1, running_sum, mask=row_valid)
        partial_offsets = entry[:, None] * HEAD_DIM_V_PADDED + value_dims[None, :]
        tl.store(partial_ptr + partial_offsets, acc, mask=row_valid[:, None])
    else:
        running_sum = tl.where(running_sum > 0.0, running_sum, 1.0)
        out = acc / running_sum[:, None] * v_scale
        out_offsets = (
            (query_begin + row_token).to(tl.int64)[:, None] * stride_out_token
            + row_head[:, None] * stride_out_head
            + value_dims[None, :]
        )
        out_mask = row_valid[:, None] & value_dim_valid[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def reduce_segments_kernel(
    out_ptr,
    partial_ptr,
    stats_ptr,
    v_scale,
    stride_out_token,
    stride_out_head,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PADDED: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """One (query token, q head): its segments' partial softmaxes combined, rescaled to their common max."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    entry = (token.to(tl.int64) * tl.num_programs(1) + head) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)
    maxima = tl.load(stats_ptr + entry * 2)
    sums = tl.load(stats_ptr + entry * 2 + 1)
    overall = tl.max(maxima, axis=0)
    overall = tl.where(overall > float("-inf"), overall, 0.0)
    weights = tl.exp2(maxima - overall)
    total = tl.sum(sums * weights, axis=0)
    total = tl.where(total > 0.0, total, 1.0)
    value_dims = tl.arange(0, HEAD_DIM_V_PADDED)
    partial = tl.load(partial_ptr + entry[:, None] * HEAD_DIM_V_PADDED + value_dims[None, :])
    out = tl.sum(partial * weights[:, None], axis=0) / total * v_scale
    out_offsets = token.to(tl.int64) * stride_out_token + head * stride_out_head + value_dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=value_dims < HEAD_DIM_V)


class LaunchConfig(NamedTuple):
    block_m: int
    block_q: int
    tile_n: int
    num_warps: int
    num_stages: int


def launch_config(queries_per_kv: int, head_dim: int, element_size: int, interpreted: bool) -> LaunchConfig:
    """The tile shapes and pipelining for a GQA ratio, the wider of the K/V head dims (padded to a power
    of two) and the query's element size.

    On a GPU: 16 rows (the tl.dot minimum); key tiles of 128 tokens for heads up to 64 wide, 64 up to
    128, 32 beyond (the same bytes a tile); 4 warps; 3 pipeline stages for 16-bit queries, 2 for fp32.
    Chosen by a sweep on an H200 (docs/kernels.md): faster than the first choice (32-key tiles, 3 stages)
    on every step swept, bf16 and fp32 (measured: benchmarks/RESULTS.md, 'Choices in the code'). Under the
    interpreter each program x KV tile costs milliseconds of Python, so tiles are as large as the test
    shapes allow.
    """
    block_m = max(64 if interpreted else 16, triton.next_power_of_2(queries_per_kv))
    tile_n = 128 if interpreted else max(32, min(128, 8192 // head_dim))
    return LaunchConfig(block_m, block_m // queries_per_kv, tile_n, 4, 3 if element_size == 2 else 2)


MAX_SEGMENTS = 16


def split_segments(num_seqs: int, num_query_tokens: int, num_kv_heads: int, num_sms: int) -> int:
    """Key segments per (sequence, KV head) of a decode step: 1 (unsplit) where its programs fill the device,
    else a power of two up to `MAX_SEGMENTS` that gives about two programs per SM (FlashAttention splits below
    0.8 x SMs, vLLM's Triton decode below 128 sequences per KV head). A function of the step's shape only, so a
    decode bucket's CUDA graph always replays the split it captured. Prefill chunks are not split."""
    programs = num_seqs * num_kv_heads
    if num_query_tokens != num_seqs or programs >= num_sms:
        return 1
    return min(MAX_SEGMENTS, triton.next_power_of_2(triton.cdiv(2 * num_sms, programs)))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def triton_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    attention_chunk_size: int | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    key_limits: KeyLimits | None = None,
    num_segments: int | None = None,
) -> torch.Tensor:
    """Paged attention of ``query`` rows over the cache; see ``hybridkv.kernels.paged_attention``. A decode step
    that leaves SMs idle splits each sequence's keys into `num_segments` (default `split_segments`'s; 1 under
    the interpreter and on a step with keys past a row's position) and combines them after."""
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    value_head_dim = value_cache.shape[-1]
    queries_per_kv = num_q_heads // num_kv_heads
    head_dim_padded = triton.next_power_of_2(head_dim)
    value_head_dim_padded = triton.next_power_of_2(value_head_dim)
    config = launch_config(
        queries_per_kv, max(head_dim_padded, value_head_dim_padded), query.element_size(), INTERPRETED
    )
    tiles = metadata.step.triton_tiles(config.block_q)
    query = _last_dim_contiguous(query)
    key_cache = _last_dim_contiguous(key_cache)
    value_cache = _last_dim_contiguous(value_cache)
    in_flight = key is not None
    key = _last_dim_contiguous(key) if in_flight else query
    value = _last_dim_contiguous(value) if in_flight else query
    out = torch.empty((num_tokens, num_q_heads, value_head_dim), dtype=query.dtype, device=query.device)
    out[metadata.num_query_tokens :] = 0
    if tiles.num_tiles == 0:
        return out
    use_limits = key_limits is not None and bool(key_limits.rows)
    if use_limits and attention_chunk_size is not None:
        raise ValueError("keys past a query's position are not served with chunked local attention")
    if num_segments is None:
        num_segments = 1
        if query.device.type == "cuda" and not INTERPRETED and not use_limits:
            num_segments = split_segments(
                metadata.num_seqs, metadata.num_query_tokens, num_kv_heads, _num_sms(query.device.index or 0)
            )
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two, got {num_segments}")
    partial = stats = out
    if num_segments > 1:
        rows = metadata.num_query_tokens
        partial = torch.empty(
            (rows, num_q_heads, num_segments, value_head_dim_padded), dtype=torch.float32, device=query.device
        )
        stats = torch.empty((rows, num_q_heads, num_segments, 2), dtype=torch.float32, device=query.device)
    paged_attention_kernel[(tiles.num_tiles, num_kv_heads, num_segments)](
        out,
        partial,
        stats,
        query,
        key,
        value,
        key_cache,
        value_cache,
        metadata.block_table,
        metadata.seq_lens,
        metadata.cu_seqlens_q,
        tiles.seq_ids,
        tiles.starts,
        sinks if sinks is not None else query,
        key_limits.last_positions if use_limits else metadata.seq_lens,
        scale,
        softcap if softcap is not None else 1.0,
        k_scale,
        v_scale,
        sliding_window if sliding_window is not None else 0,
        attention_chunk_size if attention_chunk_size is not None else 1,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(2),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(2),
        value_cache.stride(1),
        metadata.block_table.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        HEAD_DIM_V=value_head_dim,
        HEAD_DIM_V_PADDED=value_head_dim_padded,
        BLOCK_SIZE=block_size,
        BLOCK_Q=config.block_q,
        BLOCK_M=config.block_m,
        TILE_N=config.tile_n,
        USE_WINDOW=sliding_window is not None,
        USE_CHUNK=attention_chunk_size is not None,
        USE_SOFTCAP=softcap is not None,
        USE_SINKS=sinks is not None,
        USE_LIMITS=use_limits,
        IN_FLIGHT=in_flight,
        **triton_format(key_cache.dtype, key.dtype),
        # fp32 math where the interpreter's bf16 dot is wrong, or where the query and a 16/32-bit cache
        # differ (a bf16 page is exact in fp32, not in fp16); fp8 pages are exact in any query dtype.
        UPCAST=(INTERPRETED and query.dtype == torch.bfloat16)
        or (not is_fp8(key_cache.dtype) and key_cache.dtype != query.dtype),
        NUM_SEGMENTS=num_segments,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_segments > 1:
        reduce_segments_kernel[(metadata.num_query_tokens, num_q_heads)](
            out,
            partial,
            stats,
            v_scale,
            out.stride(0),
            out.stride(1),
            HEAD_DIM_V=value_head_dim,
            HEAD_DIM_V_PADDED=value_head_dim_padded,
            NUM_SEGMENTS=num_segments,
        )
    return out


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
