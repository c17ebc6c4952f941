"""Cache write in Triton: one program per token stores its K and V rows (all kv heads) at its slot, as
the cache holds them (hybridkv/kernels/quant.py: rounded to its dtype; for fp8, row / scale clamped to its range)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import triton_format
from .triton_common import as_cached


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_key_cache_block,
    stride_key_cache_head,
    stride_key_cache_slot,
    stride_value_cache_block,
    stride_value_cache_head,
    stride_value_cache_slot,
    NUM_KV_HEADS: tl.constexpr,
    NUM_KV_HEADS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr,
    FP8_MIN_EXPONENT: tl.constexpr,
    ROUND_TO_BF16: tl.constexpr,
):
    token = tl.program_id(0)
    heads = tl.arange(0, NUM_KV_HEADS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    value_dims = tl.arange(0, HEAD_DIM_V_PADDED)
    # The token's slot, broadcast over heads; padding tokens (slot -1) store nothing: every lane is off.
    slot = tl.load(slot_mapping_ptr + token + heads * 0).to(tl.int64)
    block_id = (tl.maximum(slot, 0) // BLOCK_SIZE)[:, None]
    offset = (tl.maximum(slot, 0) % BLOCK_SIZE)[:, None]
    row_mask = ((heads < NUM_KV_HEADS) & (slot >= 0))[:, None]
    mask = row_mask & (dims < HEAD_DIM)[None, :]
    value_mask = row_mask & (value_dims < HEAD_DIM_V)[None, :]

    token_offset = token.to(tl.int64)
    key = tl.load(
        key_ptr + token_offset * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
        other=0.0,
    )
    value = tl.load(
        value_ptr + token_offset * stride_value_token + heads[:, None] * stride_value_head + value_dims[None, :],
        mask=value_mask,
        other=0.0,
    )
    key_cache_offsets = (
        block_id * stride_key_cache_block
        + heads[:, None] * stride_key_cache_head
        + offset * stride_key_cache_slot
        + dims[None, :]
    )
    value_cache_offsets = (
        block_id * stride_value_cache_block
        + heads[:, None] * stride_value_cache_head
        + offset * stride_value_cache_slot
        + value_dims[None, :]
    )
    cache_type = key_cache_ptr.dtype.element_ty
    tl.store(
        key_cache_ptr + key_cache_offsets,
        as_cached(key, k_scale, cache_type, FP8_MAX, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, ROUND_TO_BF16),
        mask=mask,
    )
    value = as_cached(value, v_scale, cache_type, FP8_MAX, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, ROUND_TO_BF16)
    tl.store(value_cache_ptr + value_cache_offsets, value, mask=value_mask)


def triton_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store row t of key/value at slot ``slot_mapping[t]`` as the cache holds it; rows with slot -1 are
    skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(2),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(2),
        value_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        NUM_KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        HEAD_DIM_V=value.shape[-1],
        HEAD_DIM_V_PADDED=triton.next_power_of_2(value.shape[-1]),
        BLOCK_SIZE=key_cache.shape[1],
        **triton_format(key_cache.dtype, key.dtype),
    )
