"""The torch path's gather plan: which blocks a layer gathers, and where each sequence's query rows
and visible keys sit in the gathered workspace.

A `TorchLayout` depends only on the step's lengths, the block size and what a query sees (a sliding
window, an attention chunk size, or neither), so the KV cache groups of one block size share it: it
is cached on their `StepMetadata`. A `TorchAttentionPlan` adds one group's block ids and is cached on
the group's `PagedAttentionMetadata`. Both are built by the first layer that asks; the others only
look them up. Only blocks that hold a visible key are gathered, so null blocks are never read.

With `batch_decodes` (the torch path sets it on CPU tensors when the decode kernel is built), the
decode rows (sequences of one query row) are not gathered: the layout lists them as `DecodeRows` and
`cpu_decode` reads their keys from the pages; the gather and the per-sequence loop are left to the
prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .metadata import PagedAttentionMetadata, StepMetadata, int_tensor


@dataclass(slots=True)
class SequencePlan:
    """Where one sequence's query rows and visible keys sit for the torch path.

    Keys ``key_start:key_end`` of the gather workspace are the absolute positions
    ``first_key_position .. seq_len - 1``; ``hidden`` (bool ``[num_queries, 1, num_keys]``, True =
    not visible) is None when every query row sees every gathered key (decode rows). ``causal``: row i
    sees exactly keys 0..i (a chunk from position 0 that no window or attention chunk cuts), so fused
    attention may skip the mask.
    """

    query_start: int
    query_end: int
    key_start: int
    key_end: int
    hidden: torch.Tensor | None
    causal: bool = False


@dataclass(slots=True)
class DecodeRows:
    """The step's decode rows for the CPU decode kernel (int32): row ``rows[i]`` of the step is the one
    query of sequence ``seq_ids[i]`` and sees positions ``first_positions[i] .. seq_lens[i] - 1``,
    ``num_keys`` keys in all."""

    seq_ids: torch.Tensor
    rows: torch.Tensor
    first_positions: torch.Tensor
    seq_lens: torch.Tensor
    num_keys: int


@dataclass(slots=True)
class TorchLayout:
    """The sequences' plans for one (block size, visibility) of a step, and the block table entries
    the workspace holds, in order: entry ``(gather_seqs[i], gather_blocks[i])`` is gathered block i.
    ``row_keys[i]`` is the workspace token where the own key of the step's row ``gathered_rows[i]``
    goes when the step's K/V are read in flight (over whatever its block held: nothing, if it is not
    stored); ``gathered_rows`` is None when every row of the step is gathered (no ``decode`` rows)."""

    sequences: list[SequencePlan]
    gather_seqs: torch.Tensor
    gather_blocks: torch.Tensor
    row_keys: torch.Tensor
    gathered_rows: torch.Tensor | None
    decode: DecodeRows | None
    # Short chunks' rows are among the decode rows (`SHORT_CHUNK_ROWS`): the step's rows must be stored first.
    stores_first: bool = False


@dataclass(slots=True)
class TorchAttentionPlan:
    """The block ids one layer of a group gathers (``TorchLayout``'s entries of the group's table), and the
    layout's rows."""

    gather_block_ids: torch.Tensor
    sequences: list[SequencePlan]
    row_keys: torch.Tensor
    gathered_rows: torch.Tensor | None
    decode: DecodeRows | None
    stores_first: bool = False

    @property
    def num_gathered_blocks(self) -> int:
        return self.gather_block_ids.numel()


# The longest sequence of query rows (a speculative step's proposals, a prompt's last few tokens) that the CPU decode
# kernel attends row by row instead of gathering its keys (`short_chunks`): its rows read no more keys than a gather
# would, and skip the gather and mask (benchmarks/speculative.py).
SHORT_CHUNK_ROWS = 8


def torch_plan(
    metadata: PagedAttentionMetadata,
    sliding_window: int | None,
    attention_chunk_size: int | None = None,
    batch_decodes: bool = False,
    short_chunks: bool = False,
) -> TorchAttentionPlan:
    """The gather plan of a group for a window or a chunk size (neither: full attention); with
    ``batch_decodes``, decode rows are listed for the CPU decode kernel instead of gathered, and with
    ``short_chunks`` too (full attention only) the rows of a sequence of at most ``SHORT_CHUNK_ROWS``
    rows, each over its keys up to its own, which the caller stores first (``stores_first``)."""
    visibility = (sliding_window, attention_chunk_size, batch_decodes, short_chunks)
    plan = metadata.torch_plans.get(visibility)
    if plan is None:
        layout = torch_layout(
            metadata.step, metadata.block_size, sliding_window, attention_chunk_size, batch_decodes, short_chunks
        )
        if layout.stores_first and bool((metadata.slot_mapping[: metadata.num_query_tokens] < 0).any()):
            # A row of the group has no slot (the null block, or a speculative proposal that stores nothing): it cannot
            # be read back from the pages.
            layout = torch_layout(
                metadata.step, metadata.block_size, sliding_window, attention_chunk_size, batch_decodes
            )
        block_ids = layout.gather_blocks  # empty when nothing is gathered (a step of decode rows only)
        if layout.sequences:
            table = metadata.block_table
            flat_index = layout.gather_seqs * table.shape[1] + layout.gather_blocks
            block_ids = table.view(-1).index_select(0, flat_index).to(torch.int64)
        plan = TorchAttentionPlan(
            block_ids, layout.sequences, layout.row_keys, layout.gathered_rows, layout.decode, layout.stores_first
        )
        metadata.torch_plans[visibility] = plan
    return plan


def torch_layout(
    step: StepMetadata,
    block_size: int,
    sliding_window: int | None,
    attention_chunk_size: int | None,
    batch_decodes: bool = False,
    short_chunks: bool = False,
) -> TorchLayout:
    """The step's layout for a block size and visibility, built on first use and kept on the step."""
    short_chunks = short_chunks and batch_decodes and sliding_window is None and attention_chunk_size is None
    key = (block_size, sliding_window, attention_chunk_size, batch_decodes, short_chunks)
    layout = step.torch_layouts.get(key)
    if layout is None:
        if batch_decodes and step.num_query_tokens == step.num_seqs:
            layout = _decode_only_layout(step, sliding_window, attention_chunk_size)
        else:
            layout = _general_layout(
                step, block_size, sliding_window, attention_chunk_size, batch_decodes, short_chunks
            )
        step.torch_layouts[key] = layout
    return layout


def _general_layout(
    step: StepMetadata,
    block_size: int,
    sliding_window: int | None,
    attention_chunk_size: int | None,
    batch_decodes: bool,
    short_chunks: bool = False,
) -> TorchLayout:
    """Any step: sequences of more than one row (all of them without ``batch_decodes``) are gathered, but for
    those of at most ``SHORT_CHUNK_ROWS`` rows with ``short_chunks`` (full attention), whose rows go to the decode
    kernel one by one, each seeing the positions up to its own (read from the pages: stored first)."""
    device = step.device
    sequences: list[SequencePlan] = []
    # Decode rows for the kernel: (sequence, row, first visible position, length).
    decodes: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
    gathered_seqs: list[int] = []
    gathered_rows: list[int] = []
    block_counts: list[int] = []
    # Per sequence: its first gathered block's index in its table row minus its index in the workspace.
    block_shifts: list[int] = []
    # Per sequence: workspace token of its first query row's key minus that row's index in the batch.
    row_shifts: list[int] = []
    num_gathered = 0
    query_start = 0
    stores_first = False
    for seq, (query_len, seq_len) in enumerate(zip(step.query_lens_list, step.seq_lens_list, strict=True)):
        first_query_position = seq_len - query_len
        first_key_position = 0
        if sliding_window is not None:
            first_key_position = max(0, first_query_position - sliding_window + 1)
        elif attention_chunk_size is not None:
            first_key_position = first_query_position // attention_chunk_size * attention_chunk_size
        if batch_decodes and query_len == 1:
            for column, value in zip(decodes, (seq, query_start, first_key_position, seq_len), strict=True):
                column.append(value)
            query_start += 1
            continue
        if short_chunks and query_len <= SHORT_CHUNK_ROWS:
            for i in range(query_len):
                for column, value in zip(decodes, (seq, query_start + i, 0, first_query_position + i + 1), strict=True):
                    column.append(value)
            query_start += query_len
            stores_first = True
            continue
        gathered_seqs.append(seq)
        gathered_rows.extend(range(query_start, query_start + query_len))
        first_block = first_key_position // block_size
        end_block = (seq_len - 1) // block_size + 1
        workspace_start = (num_gathered - first_block) * block_size
        row_shifts.append(workspace_start + first_query_position - query_start)
        block_counts.append(end_block - first_block)
        block_shifts.append(first_block - num_gathered)
        num_gathered += end_block - first_block
        sequences.append(
            SequencePlan(
                query_start=query_start,
                query_end=query_start + query_len,
                key_start=workspace_start + first_key_position,
                key_end=workspace_start + seq_len,
                hidden=_hidden_keys(
                    first_query_position,
                    query_len,
                    first_key_position,
                    seq_len,
                    sliding_window,
                    attention_chunk_size,
                    device,
                ),
                causal=query_len > 1
                and first_query_position == 0
                and (sliding_window is None or sliding_window >= query_len)
                and (attention_chunk_size is None or attention_chunk_size >= seq_len),
            )
        )
        query_start += query_len
    counts = int_tensor(block_counts, torch.int64, device)
    gather_seqs = torch.repeat_interleave(
        int_tensor(gathered_seqs, torch.int64, device), counts, output_size=num_gathered
    )
    shifts = torch.repeat_interleave(int_tensor(block_shifts, torch.int64, device), counts, output_size=num_gathered)
    rows = int_tensor(gathered_rows, torch.int64, device)
    row_shifts_per_row = torch.repeat_interleave(
        int_tensor(row_shifts, torch.int64, device),
        int_tensor([plan.query_end - plan.query_start for plan in sequences], torch.int64, device),
        output_size=len(gathered_rows),
    )
    row_keys = rows + row_shifts_per_row
    decode = None
    if decodes[0]:
        seq_ids, decode_rows, first_positions, seq_lens = (
            int_tensor(column, torch.int32, device) for column in decodes
        )
        num_keys = sum(decodes[3]) - sum(decodes[2])
        decode = DecodeRows(seq_ids, decode_rows, first_positions, seq_lens, num_keys)
    all_gathered = len(gathered_rows) == query_start
    return TorchLayout(
        sequences,
        gather_seqs,
        torch.arange(num_gathered, device=device) + shifts,
        row_keys,
        None if all_gathered else rows,
        decode,
        stores_first,
    )


def _decode_only_layout(
    step: StepMetadata, sliding_window: int | None, attention_chunk_size: int | None
) -> TorchLayout:
    """A step of decode rows only, every row to the decode kernel: nothing is gathered. Row s is
    sequence s; it sees from ``seq_len - W`` (a window W), its chunk's start, or 0."""
    device = step.device
    seq_lens = step.seq_lens_list
    if sliding_window is not None:
        first_positions = [max(0, seq_len - sliding_window) for seq_len in seq_lens]
    elif attention_chunk_size is not None:
        first_positions = [(seq_len - 1) // attention_chunk_size * attention_chunk_size for seq_len in seq_lens]
    else:
        first_positions = [0] * len(seq_lens)
    rows = torch.arange(step.num_seqs, dtype=torch.int32, device=device)
    nothing = torch.empty(0, dtype=torch.int64, device=device)
    decode = DecodeRows(
        rows,
        rows,
        int_tensor(first_positions, torch.int32, device),
        step.seq_lens,
        sum(seq_lens) - sum(first_positions),
    )
    return TorchLayout([], nothing, nothing, nothing, nothing, decode)


def _hidden_keys(
    first_query_position: int,
    query_len: int,
    first_key_position: int,
    seq_len: int,
    sliding_window: int | None,
    attention_chunk_size: int | None,
    device: torch.device,
) -> torch.Tensor | None:
    """True where query row i (position ``first_query_position + i``) must not see gathered key j
    (position ``first_key_position + j``); None for a decode row."""
    if query_len == 1:
        # The gathered range is exactly what the single row sees: (p - W, p] clipped at 0, or p's chunk.
        return None
    # Key j is row i's own position at j - i == offset: causal keeps j - i <= offset, a window W keeps
    # j - i > offset - W. Diagonal bands built in place, faster than comparing positions (benchmarks/RESULTS.md, choices
    # in the code).
    offset = first_query_position - first_key_position
    visible = torch.ones(query_len, seq_len - first_key_position, dtype=torch.bool, device=device).tril_(offset)
    if sliding_window is not None:
        visible.triu_(offset - sliding_window + 1)
    if attention_chunk_size is not None:
        query_positions = torch.arange(first_query_position, seq_len, device=device)[:, None]
        key_positions = torch.arange(first_key_position, seq_len, device=device)[None, :]
        visible &= key_positions >= query_positions // attention_chunk_size * attention_chunk_size
    return visible.logical_not_().unsqueeze(1)
