"""The persistent batch's tables (hybridkv/execution/input_batch.py) against the lists they mirror, update after
update."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from hybridkv.execution.input_batch import InputBatch
from hybridkv.memory.coordinator import TableUpdates


def _config(block_sizes: list[int]) -> SimpleNamespace:
    return SimpleNamespace(groups=[SimpleNamespace(group_id=i, block_size=size) for i, size in enumerate(block_sizes)])


def _check(batch: InputBatch, lists: dict[str, list[list[int]]]) -> None:
    for request_id, per_group in lists.items():
        row = batch.row_of(request_id)
        for group_id, entries in enumerate(per_group):
            block_size, index = batch.group_slots[group_id]
            np.testing.assert_array_equal(batch.tables[block_size][index, row, : len(entries)], entries)


def test_updates_land_in_each_requests_row_across_block_sizes_frees_and_growth():
    """Random runs of changed entries, freed requests whose rows are taken again, and one update that brings
    more new requests than the batch has rows (the tables grow while it is applied): every request's row
    equals its lists after every update."""
    rng = random.Random(0)
    block_sizes = [16, 32, 16]
    batch = InputBatch(_config(block_sizes), max_model_len=512, max_rows=4)
    lists: dict[str, list[list[int]]] = {}
    next_id = 0
    for step in range(60):
        updates = TableUpdates()
        for request_id in [r for r in lists if rng.random() < 0.15]:
            updates.freed.append(request_id)
            del lists[request_id]
        arrivals = 7 if step == 30 else rng.randint(0, 2)  # step 30 outgrows the rows in one update
        for _ in range(arrivals):
            request_id = f"r{next_id}"
            next_id += 1
            lists[request_id] = [[] for _ in block_sizes]
        for request_id, per_group in lists.items():
            for group_id, entries in enumerate(per_group):
                width = 512 // block_sizes[group_id]
                if entries and rng.random() < 0.5:
                    continue
                start = rng.randint(0, len(entries)) if entries else 0
                end = min(width, start + rng.randint(1, 3))
                entries[start:] = [rng.choice([-1, 1]) * rng.randint(1, 1000) for _ in range(end - start)]
                updates.entries.append((group_id, request_id, start, entries[start:]))
        batch.apply(updates)
        _check(batch, lists)
    assert batch.max_rows > 4  # the growth happened


def test_an_update_past_a_rows_end_raises_and_writes_nothing():
    """A run that would pass the end of its row (into the next request's) is refused before anything is written."""
    batch = InputBatch(_config([16]), max_model_len=64, max_rows=2)
    batch.apply(TableUpdates(entries=[(0, "a", 0, [1, 2]), (0, "b", 0, [3])]))
    before = batch.tables[16].copy()
    with pytest.raises(IndexError, match="past the 4 a row holds"):
        batch.apply(TableUpdates(entries=[(0, "b", 1, [5]), (0, "a", 3, [7, 8])]))
    np.testing.assert_array_equal(batch.tables[16], before)
