"""Latent attention layers' attention (hybridkv/patches/latent.py): their pages hold one "head" per token, a K row of
the latent then the rotary key, whose latent is also the V row (`value_in_key`, vLLM's layout). `latent_attention`
attends a prompt's chunk by reading each sequence's context back from the pages (`gather_contexts`) and expanding it
through the layer's up-projection, as the layer itself does; decode rows attend in latent space, through the kernels'
own `attend` (the CPU decode kernel, the torch path) or hybridkv/kernels/triton_latent.py on the Triton backend."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .dispatch import attend
from .metadata import PagedAttentionMetadata, StepMetadata
from .quant import is_fp8

_CONTEXT_SLOTS = ("context slots",)  # the key of a step's gather index in its metadata's `torch_plans`


def context_slots(metadata: PagedAttentionMetadata, chunks_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The block and the offset in it of every position of every sequence of the step (with `chunks_only`, of every
    sequence of several query rows), sequence after sequence (int64 on the metadata's device; built once per step
    and group)."""
    key = (*_CONTEXT_SLOTS, chunks_only)
    slots = metadata.torch_plans.get(key)
    if slots is None:
        block_size, table, step = metadata.block_size, metadata.block_table, metadata.step
        blocks, offsets = [], []
        for seq, (query_len, seq_len) in enumerate(zip(step.query_lens_list, step.seq_lens_list, strict=True)):
            if chunks_only and query_len == 1:
                continue
            positions = torch.arange(seq_len, device=table.device)
            blocks.append(table[seq].long()[positions // block_size])
            offsets.append(positions % block_size)
        slots = (torch.cat(blocks), torch.cat(offsets))
        metadata.torch_plans[key] = slots
    return slots


def gather_contexts(
    cache: torch.Tensor, metadata: PagedAttentionMetadata, scale: float, dtype: torch.dtype, chunks_only: bool = False
) -> torch.Tensor:
    """Every sequence's context (`chunks_only`: every prompt chunk's) of one layer's K or V slot (`[blocks,
    block_size, 1, dim]`), `[tokens, dim]` in `dtype`: fp8 rows times their scale, as the kernels read them."""
    blocks, offsets = context_slots(metadata, chunks_only)
    rows = cache[blocks, offsets, 0]
    if is_fp8(cache.dtype):
        return (rows.float() * scale).to(dtype)
    return rows.to(dtype)


def latent_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    up_proj: torch.nn.Module,
    nope_dim: int,
    scale: float,
    k_scale: float = 1.0,
    absorb: bool = True,
    sequence_scope: Callable[[int], contextlib.AbstractContextManager[None]] | None = None,
) -> torch.Tensor:
    """A latent attention layer's step (hybridkv/patches/latent.py): `query` `[rows, heads, nope_dim + rotary]` over its
    pages, whose K rows `key_cache` `[blocks, block_size, 1, latent + rotary]` hold each token's latent then its rotary
    key, and whose V rows `value_cache` are a view of the latents (the step's rows stored already). A sequence of
    several rows (a prompt's chunk) expands its context through `up_proj` into keys `[tokens, heads, nope_dim + rotary]`
    and values, as the layer itself does, and attends per sequence. Decode rows, where `absorb`, attend in latent space
    instead, all of them at once (`_absorbed_decode`). `sequence_scope(i)`, if given, is entered around the
    up-projection of the step's sequence i (LoRA's hooks: hybridkv/execution/lora.py). Returns `[rows, heads,
    v_dim]`."""
    step = metadata.step
    dtype, heads = query.dtype, query.shape[1]
    latent_dim = value_cache.shape[-1]
    # A plan that splits the heads across ranks gives this rank its heads' rows of the up-projection (a DTensor's
    # local shard, while `out_features` stays the whole layer's).
    weight = up_proj.weight.to_local() if hasattr(up_proj.weight, "to_local") else up_proj.weight
    out = query.new_empty(query.shape[0], heads, weight.shape[0] // heads - nope_dim)
    fp8 = is_fp8(key_cache.dtype)
    decode = _decode_plan(metadata, fp8) if absorb else None
    triton = step.backend == "triton" and not fp8
    capturable = triton and decode is not None and decode.rows is None
    if query.is_cuda and not capturable and torch.cuda.is_current_stream_capturing():
        # A CUDA graph's replay reads the step buffers only; every other path builds tensors from this step's lengths.
        raise RuntimeError(
            "latent attention is captured only as decode rows attended in latent space by the Triton kernel on "
            "16/32-bit pages (not expanded through a LoRA, biased or hooked up-projection, nor over fp8 pages)"
        )
    if decode is not None:
        _absorbed_decode(query, key_cache, value_cache, decode, weight, nope_dim, scale, k_scale, out, triton)
        if decode.rows is None or decode.rows.numel() == query.shape[0]:
            return out
    # The contexts of the rows left (every sequence's, or with the decode rows done, the prompt chunks'), in order.
    chunks_only = decode is not None
    latents = gather_contexts(value_cache, metadata, k_scale, dtype, chunks_only)
    rotary = gather_contexts(key_cache[..., latent_dim:], metadata, k_scale, dtype, chunks_only)
    row = key_start = 0
    for index, (query_len, seq_len) in enumerate(zip(step.query_lens_list, step.seq_lens_list, strict=True)):
        if not chunks_only or query_len > 1:
            context, rotary_keys = latents[key_start : key_start + seq_len], rotary[key_start : key_start + seq_len]
            # A hooked up-projection (a LoRA adapter's) is told whose context it expands: the step's sequence `index`.
            with sequence_scope(index) if sequence_scope is not None else contextlib.nullcontext():
                expanded = up_proj(context).view(seq_len, heads, -1)
            keys = torch.cat([expanded[..., :nope_dim], rotary_keys[:, None].expand(-1, heads, -1)], dim=-1)
            out[row : row + query_len] = _attend_one(
                query[row : row + query_len], keys, expanded[..., nope_dim:], scale
            )
            key_start += seq_len
        row += query_len
    return out


class _DecodePlan(NamedTuple):
    """A step's decode rows (sequences of one query row): their rows of the query (None: every row, a step of decode
    rows only), and the metadata of a step of those rows alone (their block tables and lengths), which the kernels
    attend with."""

    rows: torch.Tensor | None  # [batch]
    metadata: PagedAttentionMetadata


_DECODE_PLAN = ("latent decode plan",)


def _decode_plan(metadata: PagedAttentionMetadata, fp8: bool) -> _DecodePlan | None:
    """The step's decode rows as a step of their own (built once per step and group), or None where it has none. A
    step of decode rows only is its own plan (what a CUDA graph captures: the step buffers' tables and lengths, no
    tensor built from this step's lengths), except for fp8 pages on the Triton backend, whose decode rows take the
    torch path."""
    step, table = metadata.step, metadata.block_table
    if step.num_query_tokens == len(step.query_lens_list) and not (fp8 and step.backend == "triton"):
        return _DecodePlan(None, metadata)
    if _DECODE_PLAN in metadata.torch_plans:
        return metadata.torch_plans[_DECODE_PLAN]
    rows, sequences, lengths, row = [], [], [], 0
    for seq, (query_len, seq_len) in enumerate(zip(step.query_lens_list, step.seq_lens_list, strict=True)):
        if query_len == 1:
            rows.append(row)
            sequences.append(seq)
            lengths.append(seq_len)
        row += query_len
    plan = None
    if rows:
        device = table.device
        # On the Triton backend the decode rows go to hybridkv/kernels/triton_latent.py, or, with fp8 pages, to the
        # torch path (the unified kernel is not built for latent rows' widths): the step of decode rows takes the torch
        # path.
        decode_step = StepMetadata.build([1] * len(rows), lengths, device, "torch")
        tables = table.index_select(0, torch.tensor(sequences, device=device))
        unused_slots = torch.full((len(rows),), -1, dtype=torch.int64, device=device)  # nothing is stored
        decode = PagedAttentionMetadata(decode_step, tables, unused_slots, metadata.block_size, None)
        plan = _DecodePlan(torch.tensor(rows, device=device), decode)
    metadata.torch_plans[_DECODE_PLAN] = plan
    return plan


def _absorbed_decode(
    query, key_cache, value_cache, plan: _DecodePlan, weight, nope_dim, scale, k_scale, out, triton: bool
) -> None:
    """The decode rows in latent space, vLLM's and FlashMLA's form: scores = q_nope . (W_k c) + q_rot . k_rot =
    (W_k^T q_nope) . c + q_rot . k_rot, and out = W_v (softmax . c): the up-projection (`weight`, `[heads * (nope_dim +
    v_dim), latent]`) folded into the query and applied to the attended latent, no context expanded. What is left is
    multi-query attention with K rows `[latent | rotary key]` and V rows `latent`, the pages as they are: the kernels'
    own torch path (on the CPU the decode kernel, hybridkv/kernels/cpu_decode.c), or with `triton` (the step's backend)
    and 16/32-bit pages hybridkv/kernels/triton_latent.py."""
    heads, latent_dim = query.shape[1], value_cache.shape[-1]
    weight = weight.view(heads, -1, latent_dim)  # [heads, nope + v, latent]
    rows = query if plan.rows is None else query.index_select(0, plan.rows)  # [batch, heads, nope + rotary]
    absorbed = torch.einsum("bhn,hnl->bhl", rows[..., :nope_dim], weight[:, :nope_dim])
    decode = plan.metadata
    if triton:
        from .triton_latent import triton_latent_decode

        attended = triton_latent_decode(
            absorbed, rows[..., nope_dim:], value_cache, key_cache[..., latent_dim:], decode.block_table,
            decode.seq_lens, scale,
        )  # fmt: skip
    else:
        latent_query = torch.cat([absorbed, rows[..., nope_dim:]], dim=-1)
        attended = attend(latent_query, key_cache, value_cache, decode, scale=scale, k_scale=k_scale, v_scale=k_scale)
    values = torch.einsum("bhl,hvl->bhv", attended, weight[:, nope_dim:])
    if plan.rows is None:
        out.copy_(values)
    else:
        out.index_copy_(0, plan.rows, values)


def _attend_one(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's rows `[q, heads, dim]` over its keys `[k, heads, dim]` and values: each row sees the keys up
    to its position (the last rows of the sequence). torch's SDPA, as transformers' own attention."""
    query_len, seq_len = rows.shape[0], keys.shape[0]
    mask = None
    if query_len > 1:  # row i sits at position seq_len - query_len + i
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=rows.device).tril(seq_len - query_len)
    attended = F.scaled_dot_product_attention(
        rows.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return attended.transpose(0, 1)
