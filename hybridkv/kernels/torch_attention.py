"""The torch path: cache write and paged attention for CPU (and any device torch runs on).

Per layer: gather the step's visible blocks into a reused workspace (one ``index_select`` for K and
one for V), put the step's own K/V rows over their positions when they are read in flight (one
``index_copy_`` each), then per sequence one explicit fp32 ``bmm -> softmax -> bmm`` with the q heads
of one kv head stacked as rows. docs/kernels.md has the measurements behind each choice (workspace
reuse, explicit matmul instead of SDPA, fp32 upcast per sequence, layout).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import cpu_decode
from .metadata import KeyLimits, PagedAttentionMetadata
from .quant import as_cached, byte_view
from .torch_plan import DecodeRows, SequencePlan, TorchAttentionPlan, torch_plan

# Bounds the fp32 score matrix of one chunk of query rows (64 MiB), so long prefills stay in memory.
_SCORE_BUDGET_ELEMENTS = 1 << 24


class _Workspace:
    """Grow-only scratch buffers reused by every layer and step.

    A fresh tensor of tens of MB per layer costs page faults, several times a gather into a reused one
    (benchmarks/RESULTS.md, choices in the code). Buffers are overwritten by the next call, so no view of
    one may outlive the call that asked for it.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            # A normal tensor, even when first asked for under torch.inference_mode(): an inference
            # tensor could not be updated in place by a later call outside it.
            with torch.inference_mode(False):
                buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)


_WORKSPACE = _Workspace()


class _RowOptions(NamedTuple):
    """What both ways of attending (the decode kernel, the gathered sequences) take past the tensors."""

    scale: float
    softcap: float | None
    sinks: torch.Tensor | None
    key: torch.Tensor | None
    value: torch.Tensor | None
    k_scale: float
    v_scale: float


def torch_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store row t of key/value at slot ``slot_mapping[t]`` as the cache holds it (``quant.as_cached``);
    rows with slot -1 are skipped."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    key = as_cached(key, key_cache.dtype, k_scale)
    value = as_cached(value, value_cache.dtype, v_scale)
    block_size = key_cache.shape[1]
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        byte_view(key_cache).view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, byte_view(key))
        byte_view(value_cache).view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, byte_view(value))
        return
    # A layer's view into a page: blocks are page_bytes apart, so (block, offset) pairs address a slot.
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - block_ids * block_size
    key_cache[block_ids, offsets] = key
    value_cache[block_ids, offsets] = value


def torch_paged_attention(
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
    store: bool = False,
) -> tuple[torch.Tensor, bool]:
    """Paged attention of ``query`` rows over the cache (see ``hybridkv.kernels.paged_attention``), and
    whether the step's rows were stored as well: asked to ``store``, the decode kernel stores them on a
    step of decode rows only (one pass instead of a separate write); otherwise the caller stores them."""
    num_tokens, num_q_heads, head_dim = query.shape
    value_head_dim = value_cache.shape[-1]
    num_query_tokens = metadata.num_query_tokens
    batch_decodes = query.device.type == "cpu" and cpu_decode.accepts(
        num_q_heads // key_cache.shape[2], head_dim, value_head_dim
    )
    limited = key_limits is not None and bool(key_limits.rows)
    # Short chunks' rows to the decode kernel, which reads their chunk's earlier keys from the pages: only where this
    # call stores the step's rows (and no row sees later keys).
    short_chunks = store and key is not None and value is not None and not limited
    plan = torch_plan(metadata, sliding_window, attention_chunk_size, batch_decodes, short_chunks)
    if limited:
        plan = _with_key_limits(metadata, plan, key_limits, sliding_window, attention_chunk_size, batch_decodes)
    out = torch.empty((num_tokens, num_q_heads, value_head_dim), dtype=query.dtype, device=query.device)
    if num_tokens > num_query_tokens:
        out[num_query_tokens:] = 0
    # Rows are computed in fp32; a 16-bit model's output is rounded once, at the end.
    result = out
    if query.dtype != torch.float32:
        result = _WORKSPACE.get("out", tuple(out.shape), torch.float32, query.device)
    rows = _RowOptions(scale, softcap, sinks, key, value, k_scale, v_scale)
    # The decode kernel stores the step's rows where it attends to every row of the step: after reading them, or, for
    # short chunks (`stores_first`), before (one call instead of a separate write: a short step's attention is mostly
    # calls). Otherwise they are written here first, or left to the caller.
    kernel_stores = plan.decode is not None and store and not plan.sequences and key is not None and value is not None
    stored = kernel_stores
    if plan.stores_first and not kernel_stores:
        torch_write_kv(key, value, key_cache, value_cache, metadata.slot_mapping, k_scale, v_scale)
        stored = True
    if plan.decode is not None:
        store_slots = metadata.slot_mapping if kernel_stores else None
        _decode_rows(plan.decode, query, key_cache, value_cache, metadata, result, rows, store_slots, plan.stores_first)
    if plan.sequences:
        _gathered_rows(plan, query[:num_query_tokens], key_cache, value_cache, result, rows)
    if result is not out:
        out[:num_query_tokens].copy_(result[:num_query_tokens])
    return out, stored


def _decode_rows(
    decode: DecodeRows,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    result: torch.Tensor,
    options: _RowOptions,
    store_slots: torch.Tensor | None,
    store_first: bool = False,
) -> None:
    """The decode rows through the CPU kernel, straight from the pages, into the fp32 ``result`` (and
    their own K/V into ``store_slots``, when given: before any row reads, with ``store_first``)."""
    scale, softcap, sinks, key, value, k_scale, v_scale = options
    key_rows = value_rows = None
    if key is not None and value is not None:
        key_rows = _last_dim_contiguous(as_cached(key, key_cache.dtype, k_scale))
        value_rows = _last_dim_contiguous(as_cached(value, value_cache.dtype, v_scale))
    if sinks is not None:
        sinks = sinks.float().contiguous()
    cpu_decode.paged_decode(
        decode,
        _last_dim_contiguous(query.float()),
        result,
        key_cache,
        value_cache,
        metadata.block_table,
        key_rows,
        value_rows,
        scale * k_scale,
        v_scale,
        softcap,
        sinks,
        store_slots,
        store_first,
    )


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _with_key_limits(
    metadata: PagedAttentionMetadata,
    plan: TorchAttentionPlan,
    key_limits: KeyLimits,
    sliding_window: int | None,
    attention_chunk_size: int | None,
    batch_decodes: bool,
) -> TorchAttentionPlan:
    """The plan with the masks of sequences holding rows that see later keys (``key_limits``); kept on the
    metadata beside the plain plan. A sequence's rows are its last ``query_len`` positions and its gathered
    keys end at its last position, so row i of q sits at key offset ``num_keys - q + i``."""
    if attention_chunk_size is not None:
        raise ValueError("keys past a query's position are not served with chunked local attention")
    cache_key = ("key_limits", sliding_window, attention_chunk_size, batch_decodes)
    limited = metadata.torch_plans.get(cache_key)
    if limited is not None:
        return limited
    extra_by_row = dict(key_limits.rows)
    sequences = []
    for seq in plan.sequences:
        extras = [extra_by_row.get(row, 0) for row in range(seq.query_start, seq.query_end)]
        if not any(extras):
            sequences.append(seq)
            continue
        num_queries, num_keys = seq.query_end - seq.query_start, seq.key_end - seq.key_start
        own = torch.arange(num_keys - num_queries, num_keys)[:, None]
        keys = torch.arange(num_keys)[None, :]
        visible = keys <= own + torch.tensor(extras)[:, None]
        if sliding_window is not None:
            visible &= keys > own - sliding_window
        hidden = visible.logical_not_().unsqueeze(1).to(metadata.block_table.device)
        sequences.append(SequencePlan(seq.query_start, seq.query_end, seq.key_start, seq.key_end, hidden, False))
    limited = TorchAttentionPlan(plan.gather_block_ids, sequences, plan.row_keys, plan.gathered_rows, plan.decode)
    metadata.torch_plans[cache_key] = limited
    return limited


def _gathered_rows(
    plan: TorchAttentionPlan,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    result: torch.Tensor,
    options: _RowOptions,
) -> None:
    """The plan's gathered sequences: one gather of their blocks, then attention per sequence, into the
    fp32 ``result``. ``query`` holds the step's rows (of the metadata), no more."""
    scale, softcap, sinks, key, value, k_scale, v_scale = options
    num_rows, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    keys = _gather_blocks(key_cache, plan.gather_block_ids, "key")
    values = _gather_blocks(value_cache, plan.gather_block_ids, "value")
    if key is not None and value is not None:
        # The step's own rows, as the cache would hold them, over whatever their blocks held.
        for source, cache, gathered, cache_scale in (
            (key, key_cache, keys, k_scale),
            (value, value_cache, values, v_scale),
        ):
            own = source[:num_rows] if plan.gathered_rows is None else source.index_select(0, plan.gathered_rows)
            byte_view(gathered).index_copy_(0, plan.row_keys, byte_view(as_cached(own, cache.dtype, cache_scale)))
    keys, values = keys.transpose(0, 1), values.transpose(0, 1)
    # Once per layer, not per sequence: fp32, pre-scaled (by the K scale too: an fp8 page holds
    # key / k_scale), laid out [kv_head, token, group, dim] so that a sequence's rows for one kv head are
    # one contiguous [tokens * group, dim] matrix. Rows of decode sequences the kernel took are idle here.
    grouped_shape = (num_kv_heads, num_rows, group, head_dim)
    rows = _WORKSPACE.get("rows", grouped_shape, torch.float32, query.device)
    rows.copy_(query.reshape(num_rows, num_kv_heads, group, head_dim).transpose(0, 1))
    rows.mul_(scale * k_scale)
    sink_logits = None if sinks is None else sinks.float().view(num_kv_heads, 1, group, 1)
    for seq in plan.sequences:
        # fp32 math: 16-bit bmm on CPU is slower than upcast + fp32 bmm (benchmarks/RESULTS.md, choices in the code),
        # and fp32 keeps the logits exact. Upcasting one sequence at a time keeps the copy in cache and the workspace
        # 16-bit.
        seq_keys = keys[:, seq.key_start : seq.key_end].float()
        seq_values = values[:, seq.key_start : seq.key_end].float()
        rows_per_chunk = max(1, _SCORE_BUDGET_ELEMENTS // (num_q_heads * seq_keys.shape[1]))
        for start in range(seq.query_start, seq.query_end, rows_per_chunk):
            end = min(start + rows_per_chunk, seq.query_end)
            hidden = None
            if seq.hidden is not None:
                hidden = seq.hidden[start - seq.query_start : end - seq.query_start]
            causal = seq.causal and rows_per_chunk >= seq.query_end - seq.query_start
            _attend(
                rows[:, start:end],
                seq_keys,
                seq_values,
                result[start:end],
                softcap,
                sink_logits,
                hidden,
                v_scale,
                causal,
            )


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, name: str) -> torch.Tensor:
    """The listed blocks as a ``[num_blocks * block_size, num_kv_heads, head_dim]`` workspace view."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    shape = (block_ids.numel(), block_size, num_kv_heads, head_dim)
    gathered = _WORKSPACE.get(name, shape, cache.dtype, cache.device)
    torch.index_select(cache, 0, block_ids, out=gathered)
    return gathered.view(-1, num_kv_heads, head_dim)


def _attend(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    out: torch.Tensor,
    softcap: float | None,
    sink_logits: torch.Tensor | None,
    hidden: torch.Tensor | None,
    v_scale: float,
    causal: bool = False,
) -> None:
    """Scaled rows ``[kv_heads, queries, group, dim]`` over ``[kv_heads, keys, dim]`` and values
    ``[kv_heads, keys, v_dim]`` (times ``v_scale``), into ``out`` ``[queries, q_heads, v_dim]``; with
    ``causal``, query i sees keys 0..i and ``hidden`` says the same."""
    num_kv_heads, num_queries, group, head_dim = rows.shape
    num_keys = keys.shape[1]
    value_head_dim = values.shape[-1]
    if num_queries > 1 and softcap is None and sink_logits is None:
        # Prefill rows: torch's fused SDPA never materialises the [queries, keys] probabilities
        # (faster than bmm + softmax on long chunks: benchmarks/RESULTS.md, choices in the code).
        query = rows.permute(0, 2, 1, 3).reshape(1, num_kv_heads * group, num_queries, head_dim)
        mask = None if hidden is None or causal else ~hidden.view(1, 1, num_queries, num_keys)
        result = F.scaled_dot_product_attention(
            query,
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=1.0,
            enable_gqa=group > 1,
        )
        if v_scale != 1.0:
            result.mul_(v_scale)
        out.copy_(result[0].transpose(0, 1))
        return
    scores = torch.bmm(rows.view(num_kv_heads, num_queries * group, head_dim), keys.transpose(1, 2))
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    scores = scores.view(num_kv_heads, num_queries, group, num_keys)
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))
    if sink_logits is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        log_denominator = torch.logaddexp(torch.logsumexp(scores, dim=-1, keepdim=True), sink_logits)
        probs = scores.sub_(log_denominator).exp_()
    probs = probs.view(num_kv_heads, num_queries * group, num_keys)
    if num_queries == 1 and out.dtype == torch.float32:
        # A decode row's [kv_heads, group, dim] is its [q_heads, dim]: bmm writes it in place (a strided
        # out= would make bmm loop over the batch, slower: benchmarks/RESULTS.md, choices in the code).
        torch.bmm(probs, values, out=out.view(num_kv_heads, group, value_head_dim))
        if v_scale != 1.0:
            out.mul_(v_scale)
        return
    result = torch.bmm(probs, values).view(num_kv_heads, num_queries, group, value_head_dim)
    if v_scale != 1.0:
        result.mul_(v_scale)
    out.view(num_queries, num_kv_heads, group, value_head_dim).copy_(result.transpose(0, 1))
