"""Latent attention's decode rows in Triton (hybridkv/patches/latent.py, hybridkv/kernels/latent_attention.py):
attention in latent space over paged latents and rotary keys, FlashMLA's and vLLM's form.

The up-projection's key part is folded into the query before the kernel (`absorbed`, `[rows, heads, latent]`) and
its value part applied to the kernel's output after it, so the kernel is multi-query attention with keys
`[latent | rotary key]` and values `latent`, both read from the pages: one program per decode row and block of
`BLOCK_H` heads, which loops over the row's keys in tiles of `TILE_N` tokens (block ids looked up per key) with an
online softmax in base 2, every key tile read once for all the program's heads. 16/32-bit pages; fp8 pages go
through the torch path (`hybridkv/kernels/latent_attention.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_attention import INTERPRETED

_LOG2E = 1.4426950408889634


@triton.jit
def latent_decode_kernel(
    out_ptr,
    absorbed_ptr,
    rotary_query_ptr,
    latent_cache_ptr,
    rotary_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    scale_log2,
    num_heads,
    stride_out_row,
    stride_out_head,
    stride_absorbed_row,
    stride_absorbed_head,
    stride_rotary_query_row,
    stride_rotary_query_head,
    stride_latent_block,
    stride_latent_slot,
    stride_rotary_block,
    stride_rotary_slot,
    stride_table_row,
    LATENT: tl.constexpr,
    LATENT_PADDED: tl.constexpr,
    ROTARY: tl.constexpr,
    ROTARY_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE_N: tl.constexpr,
):
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    latent_dims = tl.arange(0, LATENT_PADDED)
    rotary_dims = tl.arange(0, ROTARY_PADDED)
    latent_ok = latent_dims < LATENT
    rotary_ok = rotary_dims < ROTARY
    q_latent = tl.load(
        absorbed_ptr + row * stride_absorbed_row + heads[:, None] * stride_absorbed_head + latent_dims[None, :],
        mask=head_ok[:, None] & latent_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    q_rotary = tl.load(
        rotary_query_ptr
        + row * stride_rotary_query_row
        + heads[:, None] * stride_rotary_query_head
        + rotary_dims[None, :],
        mask=head_ok[:, None] & rotary_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + row)
    running_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, LATENT_PADDED), dtype=tl.float32)
    for start in range(0, seq_len, TILE_N):
        positions = start + tl.arange(0, TILE_N)
        visible = positions < seq_len
        blocks = tl.load(block_table_ptr + row * stride_table_row + positions // BLOCK_SIZE, mask=visible, other=0)
        slots = positions % BLOCK_SIZE
        latents = tl.load(
            latent_cache_ptr
            + blocks[:, None].to(tl.int64) * stride_latent_block
            + slots[:, None] * stride_latent_slot
            + latent_dims[None, :],
            mask=visible[:, None] & latent_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        rotary = tl.load(
            rotary_cache_ptr
            + blocks[:, None].to(tl.int64) * stride_rotary_block
            + slots[:, None] * stride_rotary_slot
            + rotary_dims[None, :],
            mask=visible[:, None] & rotary_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        scores = tl.dot(q_latent, tl.trans(latents), input_precision="ieee")
        scores += tl.dot(q_rotary, tl.trans(rotary), input_precision="ieee")
        scores = tl.where(visible[None, :], scores * scale_log2, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp2(running_max - new_max)
        weights = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None] + tl.dot(weights, latents, input_precision="ieee")
        running_max = new_max
    result = acc / running_sum[:, None]
    tl.store(
        out_ptr + row * stride_out_row + heads[:, None] * stride_out_head + latent_dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & latent_ok[None, :],
    )


def triton_latent_decode(
    absorbed: torch.Tensor,
    rotary_query: torch.Tensor,
    latent_cache: torch.Tensor,
    rotary_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode rows' attention in latent space: `absorbed` `[rows, heads, latent]` (the query's key part through the
    up-projection) and `rotary_query` `[rows, heads, rotary]` over the pages `latent_cache` `[blocks, block_size, 1,
    latent]` and `rotary_cache` (`[..., rotary]`) of each row's sequence (`block_table` `[rows, width]`, `seq_lens`
    `[rows]`). Returns the attended latents `[rows, heads, latent]` in `absorbed`'s dtype."""
    rows, heads, latent = absorbed.shape
    _, block_size, _, rotary = rotary_cache.shape
    out = torch.empty_like(absorbed)
    if rows == 0:
        return out
    block_h = 16 if not INTERPRETED else max(1, min(16, triton.next_power_of_2(heads)))
    latent_padded = triton.next_power_of_2(latent)
    tile_n = 16 if latent_padded >= 256 else 32
    absorbed = absorbed if absorbed.stride(-1) == 1 else absorbed.contiguous()
    rotary_query = rotary_query if rotary_query.stride(-1) == 1 else rotary_query.contiguous()
    latent_decode_kernel[(rows, triton.cdiv(heads, block_h))](
        out,
        absorbed,
        rotary_query,
        latent_cache,
        rotary_cache,
        block_table,
        seq_lens,
        scale * _LOG2E,
        heads,
        out.stride(0),
        out.stride(1),
        absorbed.stride(0),
        absorbed.stride(1),
        rotary_query.stride(0),
        rotary_query.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        rotary_cache.stride(0),
        rotary_cache.stride(1),
        block_table.stride(0),
        LATENT=latent,
        LATENT_PADDED=latent_padded,
        ROTARY=rotary,
        ROTARY_PADDED=max(16, triton.next_power_of_2(rotary)),
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        TILE_N=tile_n,
        num_warps=4,
        num_stages=1,
    )
    return out
