"""Whole contexts read back from the pages, and attention over them: the path of latent attention layers.

A latent attention layer (patches/latent.py) expands its cache's content into per-head keys and values itself, so a
step gives it each sequence's whole context read back from its pages (`gather_contexts`: the latent and the rotary
key, sequence after sequence), and its attention function then receives dense keys and values: the step's sequences'
contexts one after another, which `attend_contexts` attends over, each query row seeing its own sequence's keys up
to its position. Plain torch, on any device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import PagedAttentionMetadata
from .quant import is_fp8

_CONTEXT_SLOTS = ("context slots",)  # the key of a step's gather index in its metadata's `torch_plans`


def context_slots(metadata: PagedAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The block and the offset in it of every position of every sequence of the step, sequence after sequence
    (int64 on the metadata's device; built once per step and group)."""
    slots = metadata.torch_plans.get(_CONTEXT_SLOTS)
    if slots is None:
        block_size, table = metadata.block_size, metadata.block_table
        blocks, offsets = [], []
        for seq, seq_len in enumerate(metadata.step.seq_lens_list):
            positions = torch.arange(seq_len, device=table.device)
            blocks.append(table[seq].long()[positions // block_size])
            offsets.append(positions % block_size)
        slots = (torch.cat(blocks), torch.cat(offsets))
        metadata.torch_plans[_CONTEXT_SLOTS] = slots
    return slots


def gather_contexts(cache: torch.Tensor, metadata: PagedAttentionMetadata, scale: float, dtype: torch.dtype):
    """Every sequence's context of one layer's K or V slot (`[blocks, block_size, 1, dim]`), `[tokens, dim]` in
    `dtype`: fp8 rows times their scale, as the kernels read them."""
    blocks, offsets = context_slots(metadata)
    rows = cache[blocks, offsets, 0]
    if is_fp8(cache.dtype):
        return (rows.float() * scale).to(dtype)
    return rows.to(dtype)


def attend_contexts(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    metadata: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """`query` `[rows, heads, dim]` (the step's rows) over `key` `[tokens, heads, dim]` and `value` `[tokens, heads,
    v_dim]` (the step's sequences' whole contexts, in order): each row sees its sequence's keys up to its position.
    Returns `[rows, heads, v_dim]`. The softmax of torch's SDPA, per sequence, as transformers' own attention."""
    step = metadata.step
    out = query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
    row = key_start = 0
    for query_len, seq_len in zip(step.query_lens_list, step.seq_lens_list, strict=True):
        rows = query[row : row + query_len].transpose(0, 1)
        keys = key[key_start : key_start + seq_len].transpose(0, 1)
        values = value[key_start : key_start + seq_len].transpose(0, 1)
        mask = None
        if query_len > 1:  # row i sits at position seq_len - query_len + i
            mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=query.device).tril(seq_len - query_len)
        attended = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)
        out[row : row + query_len] = attended.transpose(0, 1)
        row += query_len
        key_start += seq_len
    return out
