"""Swap space: CPU blocks that hold preempted requests' KV until they come back.

Pure bookkeeping (ids and layouts); the engine copies the tensors the scheduler asks for.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SwapRecord:
    """A swapped-out request: per group which block positions were real, and the CPU blocks that
    hold them (real positions in group order)."""

    layout: list[list[bool]]
    cpu_block_ids: list[int]


class SwapSpace:
    """A fixed number of CPU blocks, handed out and returned by id."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n CPU block ids, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        taken = self._free[-n:] if n else []
        del self._free[len(self._free) - n :]
        return taken

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)
