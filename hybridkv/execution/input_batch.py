"""The persistent batch: every request that holds blocks keeps one row of the block tables, step after step.

A step's block tables are not rebuilt from the managers' lists. The coordinator reports what changed in
them since its last report (`TableUpdates`: per group and request, the entries from the first changed
position on; and the requests it freed), the runner applies that to `InputBatch`'s tables, and a step
gathers its sequences' rows in batch order from there. A decode step that crosses no block boundary
changes nothing; one that does appends an entry. The tables are numpy arrays, one per block size::

    tables[block_size]   int32 [groups of that block size, max_rows + 1, blocks of max_model_len]
                                 row r: the block ids of the request holding row r, by position;
                                 row max_rows: all null, the row of a padded sequence (a graph bucket)

Entries past a request's blocks hold whatever the row's last holder left: no kernel reads a sequence's
table past its length. A row goes back when its request is freed (finished, aborted, preempted) and is
given to the next request that takes blocks, whose first update starts at position 0.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from hybridkv.memory.block_pool import cdiv
from hybridkv.memory.coordinator import TableUpdates
from hybridkv.memory.grouping import KVCacheConfig


class InputBatch:
    """The rows of the requests that hold blocks, in one numpy table per block size (module docstring).

    `max_rows` is how many requests may hold blocks at once (the tables grow if more ever do).
    """

    def __init__(self, kv_config: KVCacheConfig, max_model_len: int, max_rows: int) -> None:
        self.max_rows = max_rows
        self.block_sizes = sorted({group.block_size for group in kv_config.groups})
        # group id -> (its block size, its index among the groups of that size)
        self.group_slots: list[tuple[int, int]] = []
        counts: dict[int, int] = dict.fromkeys(self.block_sizes, 0)
        for group in kv_config.groups:
            self.group_slots.append((group.block_size, counts[group.block_size]))
            counts[group.block_size] += 1
        self.tables = {
            block_size: np.zeros((count, max_rows + 1, cdiv(max_model_len, block_size)), dtype=np.int32)
            for block_size, count in counts.items()
        }
        self._widths = {block_size: table.shape[2] for block_size, table in self.tables.items()}
        self._flat = {block_size: _flat(table) for block_size, table in self.tables.items()}
        self.rows: dict[str, int] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))
        # Each row's state slot (a model with state layers; the padding row's is the scratch slot, 0).
        self.state_slots = np.zeros(max_rows + 1, dtype=np.int64)

    @property
    def padding_row(self) -> int:
        """A row of null blocks only: the table row of a sequence that pads a step to its graph's size."""
        return self.max_rows

    def apply(self, updates: TableUpdates) -> None:
        """Take the coordinator's report: free the rows of freed requests, then write every changed entry."""
        for request_id in updates.freed:
            row = self.rows.pop(request_id, None)
            if row is not None:
                self._free_rows.append(row)
        rows, slots = self.rows, self.group_slots
        for _, request_id, _, _ in updates.entries:
            if request_id not in rows:
                rows[request_id] = self._take_row()  # may grow the tables: positions are counted after
        # Each changed run is written through a flat int32 memoryview of its table, one entry by item assignment
        # and a run from an int32 array (a numpy write costs tens of microseconds after a forward has evicted its
        # code, and a step changes a few short runs, most of one entry); every run is checked before any is written.
        num_rows = self.max_rows + 1
        widths, flats = self._widths, self._flat
        writes = []
        for group_id, request_id, start, entries in updates.entries:
            block_size, index = slots[group_id]
            width = widths[block_size]
            if not 0 <= start <= start + len(entries) <= width:
                raise IndexError(
                    f"a table update of request {request_id!r} covers positions {start} to {start + len(entries)}, "
                    f"past the {width} a row holds"
                )
            writes.append((flats[block_size], (index * num_rows + rows[request_id]) * width + start, entries))
        for flat, offset, entries in writes:
            if len(entries) == 1:
                flat[offset] = entries[0]
            else:
                flat[offset : offset + len(entries)] = array("i", entries)
        for request_id, state_slot in updates.slots:
            row = rows.get(request_id)
            if row is None:
                row = rows[request_id] = self._take_row()
            self.state_slots[row] = state_slot

    def _take_row(self) -> int:
        if not self._free_rows:
            self._grow()
        return self._free_rows.pop()

    def _grow(self) -> None:
        """Double the rows (more requests hold blocks at once than `max_rows`); the padding row stays last."""
        old = self.max_rows
        self.max_rows = 2 * old
        for block_size, table in self.tables.items():
            grown = np.zeros((table.shape[0], self.max_rows + 1, table.shape[2]), dtype=np.int32)
            grown[:, :old] = table[:, :old]
            self.tables[block_size] = grown
            self._flat[block_size].release()
            self._flat[block_size] = _flat(grown)
        state_slots = np.zeros(self.max_rows + 1, dtype=np.int64)
        state_slots[:old] = self.state_slots[:old]
        self.state_slots = state_slots
        self._free_rows = list(range(self.max_rows - 1, old - 1, -1)) + self._free_rows

    def row_of(self, request_id: str) -> int:
        return self.rows[request_id]

    def check(self, request_ids: Sequence[str], block_tables: Sequence[Sequence[Sequence[int]]]) -> None:
        """Assert that the requests' rows equal the managers' lists (`block_tables[group][i]` for
        `request_ids[i]`): tests run it after every update."""
        for group_id, rows in enumerate(block_tables):
            block_size, index = self.group_slots[group_id]
            table = self.tables[block_size][index]
            for request_id, expected in zip(request_ids, rows, strict=True):
                got = table[self.rows[request_id], : len(expected)].tolist()
                assert got == list(expected), (
                    f"the persistent table of {request_id!r} in group {group_id} is {got}, its lists {list(expected)}"
                )


def _flat(table: np.ndarray) -> memoryview:
    """The table's entries as one flat int32 memoryview (writes through it cost no numpy call)."""
    return memoryview(table).cast("B").cast("i")
