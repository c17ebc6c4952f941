"""Per-step attention metadata: built once per step, then only looked up by every layer.

    StepMetadata                 one step on one device: the sequences' lengths (host lists and
     |                           device tensors), the backend resolved for that device, and what
     |                           depends on the lengths only: Triton query tiles (per tile height)
     |                           and the torch path's layouts (per block size and visibility,
     |                           filled by torch_plan.py), shared by every group of the step
     +-- PagedAttentionMetadata  one KV cache group of the step: block table, slot mapping, block
                                 size, the torch path's gather plans; what the kernels take

Lengths are checked once, when the step is built; a group checks only that its block table covers
them. Per-layer Python work is the cost that dominates on the CPU, so layers only look things up.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from .backend import Backend, resolve_backend
from .cache import NULL_BLOCK_ID

# A torch plan's key: what a layer sees, (sliding window, attention chunk size), (None, None) for full
# attention, and whether decode rows go to the CPU decode kernel.
PlanKey = tuple[int | None, int | None, bool]


@dataclass(slots=True)
class TritonQueryTiles:
    """Tiles of ``block_q`` query tokens: tile i covers sequence ``seq_ids[i]`` from token ``starts[i]``."""

    seq_ids: torch.Tensor
    starts: torch.Tensor

    @property
    def num_tiles(self) -> int:
        return self.seq_ids.numel()


class KeyLimits:
    """Query rows of a step that see keys past their own position: the tokens of an image whose tokens attend
    both ways (Gemma 3's images), each seeing up to its image's last token. ``rows`` lists (row, how many
    positions past its own it sees) for the torch path; ``last_positions`` (int32 ``[num_query_tokens]`` on
    the step's device) holds every row's last visible key position (its own where not listed) for Triton.
    Windows still apply from each row's own position; the keys it sees past itself are in the same step."""

    __slots__ = ("last_positions", "rows")

    def __init__(self, rows: list[tuple[int, int]], last_positions: torch.Tensor) -> None:
        self.rows = rows
        self.last_positions = last_positions


@dataclass(slots=True, eq=False)
class StepMetadata:
    """One step's sequences on one device, shared by every KV cache group and layer there.

    Sequence s computes ``query_lens_list[s]`` new tokens and holds ``seq_lens_list[s]`` tokens
    including them; its query rows are ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and row j sits at
    absolute position ``seq_lens[s] - query_lens[s] + j``. Build it with ``build`` (which checks the
    lengths), then one ``PagedAttentionMetadata`` per group with ``for_group``.
    """

    query_lens_list: list[int]
    seq_lens_list: list[int]
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    num_query_tokens: int
    backend: Backend
    # Filled on first use. Keyed by tile height; by (block size, window, chunk size, decode batching): torch_plan.py's
    # TorchLayout (its type is torch_plan's: this module, below it, does not import it); by (block size, table
    # width): each query row's flat block table index and offset in its block.
    triton_tiles_by_height: dict[int, TritonQueryTiles] = field(default_factory=dict, repr=False)
    torch_layouts: dict[tuple[int, int | None, int | None, bool], Any] = field(default_factory=dict, repr=False)
    _slot_indices: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    # The StepBuffers the step was written into (step_buffers.py), which then hold its Triton tiles too.
    buffers: Any = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        device: torch.device | str = "cpu",
        backend: str | None = None,
    ) -> StepMetadata:
        """Check the lengths (``1 <= query_lens[s] <= seq_lens[s]``) and put them on ``device``.

        ``backend`` (None: by device, see ``resolve_backend``) is resolved here, once for the step.
        """
        if len(query_lens) != len(seq_lens):
            raise ValueError(
                f"query_lens and seq_lens must describe the same sequences, got {len(query_lens)} and {len(seq_lens)}"
            )
        for seq, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if not 1 <= query_len <= seq_len:
                raise ValueError(f"sequence {seq}: need 1 <= query_len <= seq_len, got {query_len} and {seq_len}")
        device = torch.device(device)
        cu_seqlens = list(accumulate(query_lens, initial=0))
        return cls(
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            cu_seqlens_q=int_tensor(cu_seqlens, torch.int32, device),
            seq_lens=int_tensor(seq_lens, torch.int32, device),
            num_query_tokens=cu_seqlens[-1],
            backend=resolve_backend(backend, device),
        )

    @property
    def device(self) -> torch.device:
        return self.seq_lens.device

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    def for_group(self, block_table: Sequence[Sequence[int]], block_size: int) -> PagedAttentionMetadata:
        """The metadata of one KV cache group of this step.

        ``block_table[s]`` lists sequence s's block ids in this group, at least
        ``ceil(seq_lens[s] / block_size)`` of them (the null block may stand for blocks its layers
        cannot see, or for blocks of the step's own tokens that are read in flight and never stored).
        An entry ``-b`` (negative) is block b, read at that position this step but stored into at
        another (a windowed group giving a block it no longer needs to its new tokens): rows of the
        step at a null or negative entry get slot -1, so the cache write skips them. Groups of one
        block size share the step's layouts.
        """
        return self.for_groups([block_table], block_size)[0]

    def for_groups(
        self, block_tables: Sequence[Sequence[Sequence[int]]], block_size: int
    ) -> list[PagedAttentionMetadata]:
        """``for_group`` of several groups of one block size at once: their tables are padded to one width
        and go to the device as one tensor, and their slots are computed together (each group's table
        and slot mapping are views of those), so the tensor work per step does not grow with the groups."""
        group_rows = [table if isinstance(table, list) else list(table) for table in block_tables]
        needed = [-(-seq_len // block_size) for seq_len in self.seq_lens_list]
        group_lengths = []
        for rows in group_rows:
            if len(rows) != self.num_seqs:
                raise ValueError(f"the block table has {len(rows)} rows for the step's {self.num_seqs} sequences")
            lengths = list(map(len, rows))
            if any(map(operator.lt, lengths, needed)):
                seq = next(s for s, (length, need) in enumerate(zip(lengths, needed, strict=True)) if length < need)
                seq_len = self.seq_lens_list[seq]
                raise ValueError(f"sequence {seq}: {lengths[seq]} blocks of {block_size} cannot hold {seq_len} tokens")
            group_lengths.append(lengths)
        width = max(map(max, group_lengths), default=0) if self.num_seqs else 0
        padding = [NULL_BLOCK_ID] * width
        flat: list[int] = []
        for rows, lengths in zip(group_rows, group_lengths, strict=True):
            for row, length in zip(rows, lengths, strict=True):
                flat += row
                flat += padding[length:]
        tables = int_tensor(flat, torch.int32, self.device).view(len(group_rows), self.num_seqs, width)
        if self.num_query_tokens == self.num_seqs:
            slot_mappings = self._decode_slots(group_rows, block_size)
        else:
            slot_index, offsets = self._slot_index(block_size, width)
            entries = tables.view(len(group_rows), -1)[:, slot_index].to(torch.int64)
            slot_mappings = torch.where(entries > NULL_BLOCK_ID, entries * block_size + offsets, -1)
        tables.abs_()
        return [
            PagedAttentionMetadata(self, table, slot_mapping, block_size, rows)
            for table, slot_mapping, rows in zip(tables, slot_mappings, group_rows, strict=True)
        ]

    def triton_tiles(self, block_q: int) -> TritonQueryTiles:
        """Query tiles of ``block_q`` tokens, built on the first layer that asks for them (in the step's
        buffers, when it has them)."""
        tiles = self.triton_tiles_by_height.get(block_q)
        if tiles is None and self.buffers is not None:
            tiles = self.triton_tiles_by_height[block_q] = self.buffers.triton_tiles(self, block_q)
        elif tiles is None:
            seq_ids: list[int] = []
            starts: list[int] = []
            for seq, query_len in enumerate(self.query_lens_list):
                tile_starts = range(0, query_len, block_q)
                seq_ids += [seq] * len(tile_starts)
                starts += tile_starts
            tiles = TritonQueryTiles(
                int_tensor(seq_ids, torch.int32, self.device), int_tensor(starts, torch.int32, self.device)
            )
            self.triton_tiles_by_height[block_q] = tiles
        return tiles

    def _decode_slots(self, group_rows: list[list[list[int]]], block_size: int) -> torch.Tensor:
        """The slot mappings of a step of one row per sequence (the last position), looked up in Python:
        a few hundred entries cost less than the tensor operations of ``_slot_index`` (benchmarks/RESULTS.md, choices in
        the code)."""
        positions = [(seq_len - 1) // block_size for seq_len in self.seq_lens_list]
        offsets = [(seq_len - 1) % block_size for seq_len in self.seq_lens_list]
        slots = []
        for rows in group_rows:
            for row, position, offset in zip(rows, positions, offsets, strict=True):
                entry = row[position]
                slots.append(entry * block_size + offset if entry > NULL_BLOCK_ID else -1)
        return int_tensor(slots, torch.int64, self.device).view(len(group_rows), self.num_seqs)

    def _slot_index(self, block_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For every query row: the index of its block in a flattened ``[num_seqs, width]`` table, and its
        offset in that block. The slot is ``table.view(-1)[index] * block_size + offset``."""
        key = (block_size, width)
        found = self._slot_indices.get(key)
        if found is None:
            device = self.device
            row_seqs = torch.repeat_interleave(
                torch.arange(self.num_seqs, device=device),
                self.cu_seqlens_q.diff(),
                output_size=self.num_query_tokens,
            )
            # Row t of sequence s sits at position t + (seq_lens[s] - cu_seqlens_q[s + 1]).
            shift = (self.seq_lens - self.cu_seqlens_q[1:]).to(torch.int64)
            positions = torch.arange(self.num_query_tokens, device=device) + shift[row_seqs]
            found = (row_seqs * width + positions // block_size, positions % block_size)
            self._slot_indices[key] = found
        return found


@dataclass(slots=True, eq=False)
class PagedAttentionMetadata:
    """One step of one KV cache group: what the kernels take, shared by every layer of the group.

    ``block_table`` (int32) holds the group's block ids per sequence, padded with the null block (0), or
    (written into step buffers) with whatever an earlier step left there; entries at or beyond
    ``ceil(seq_lens[s] / block_size)`` are never read. ``slot_mapping[t]``
    (int64) is the cache slot of query row t, -1 where the row is not stored. ``block_table_rows``
    are the rows as given to ``build`` / ``for_group`` (not copied), None for metadata written into step
    buffers.
    The lengths are the step's (``step``), also readable here: ``cu_seqlens_q``, ``seq_lens``,
    ``query_lens_list``, ``seq_lens_list``, ``num_seqs``, ``num_query_tokens``.
    """

    step: StepMetadata
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    block_table_rows: list[list[int]] | None
    # The torch path's gather plans (torch_plan.py's TorchAttentionPlan), by visibility and decode batching, filled by
    # torch_plan.py on first use.
    torch_plans: dict[PlanKey, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_table: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        backend: str | None = None,
    ) -> PagedAttentionMetadata:
        """A step of one group in one call: ``StepMetadata.build(...).for_group(block_table, block_size)``."""
        return StepMetadata.build(query_lens, seq_lens, device, backend).for_group(block_table, block_size)

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        return self.step.cu_seqlens_q

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.step.seq_lens

    @property
    def query_lens_list(self) -> list[int]:
        return self.step.query_lens_list

    @property
    def seq_lens_list(self) -> list[int]:
        return self.step.seq_lens_list

    @property
    def num_seqs(self) -> int:
        return self.step.num_seqs

    @property
    def num_query_tokens(self) -> int:
        return self.step.num_query_tokens


def build_step_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    group_block_tables: Sequence[Sequence[Sequence[int]]],
    group_block_sizes: Sequence[int],
    devices: Sequence[torch.device],
    backend: str | None = None,
) -> list[PagedAttentionMetadata]:
    """One step's metadata for every (device, KV cache group): entry ``d * num_groups + g`` is group g
    (block table ``group_block_tables[g]``, blocks of ``group_block_sizes[g]``) on ``devices[d]``."""
    if len(group_block_tables) != len(group_block_sizes):
        raise ValueError(
            f"{len(group_block_tables)} block tables for {len(group_block_sizes)} block sizes: one of each per group"
        )
    groups_by_size: dict[int, list[int]] = {}
    for group, block_size in enumerate(group_block_sizes):
        groups_by_size.setdefault(block_size, []).append(group)
    metadata: list[PagedAttentionMetadata] = []
    for device in devices:
        step = StepMetadata.build(query_lens, seq_lens, device, backend)
        by_group: dict[int, PagedAttentionMetadata] = {}
        for block_size, groups in groups_by_size.items():
            built = step.for_groups([group_block_tables[g] for g in groups], block_size)
            by_group.update(zip(groups, built, strict=True))
        metadata.extend(by_group[group] for group in range(len(group_block_sizes)))
    return metadata


_STRUCT_CODES = {torch.int32: "i", torch.int64: "q"}


def int_tensor(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D int32 or int64 tensor from Python ints, packed by ``struct``: faster than through a typed array or
    ``torch.tensor(list)`` (benchmarks/RESULTS.md, choices in the code)."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    buffer = bytearray(len(values) * dtype.itemsize)
    struct.pack_into(f"{len(values)}{_STRUCT_CODES[dtype]}", buffer, 0, *values)
    # The tensor keeps the buffer alive and shares its memory (a CPU tensor is not copied).
    return torch.frombuffer(buffer, dtype=dtype).to(device)
