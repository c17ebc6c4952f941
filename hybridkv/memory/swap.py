"""Swap space: CPU blocks that hold preempted requests' KV until they come back.

Pure bookkeeping (ids and tables); the engine copies the tensors the scheduler asks for. The members of
one group (samples or beams of one prompt) are swapped out together, and a block they share is copied
out once: its CPU block has one reference per member, and they come back sharing one block again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SwapRecord:
    """A swapped-out request: per group, the CPU block holding each position of its block table
    (None where it held the null block)."""

    tables: list[list[int | None]]

    @property
    def cpu_block_ids(self) -> list[int]:
        return [cpu_id for row in self.tables for cpu_id in row if cpu_id is not None]


class SwapSpace:
    """A fixed number of CPU blocks, handed out by id, each with a count of the records holding it."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n CPU block ids with no holder yet (`hold` them), or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        taken = self._free[-n:] if n else []
        del self._free[len(self._free) - n :]
        return taken

    def hold(self, block_ids: list[int]) -> None:
        """One more holder of each block."""
        for block_id in block_ids:
            self._refs[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """One holder fewer of each block; a block no record holds is free again."""
        for block_id in block_ids:
            self._refs[block_id] -= 1
            if self._refs[block_id] == 0:
                self._free.append(block_id)
