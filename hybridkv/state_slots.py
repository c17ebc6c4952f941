"""State slots: where each request keeps the state of a model's state layers (linear attention, SSM, conv).

A state layer keeps one fixed-size state per request, whatever its length, so a request needs one slot, not
blocks: slot s is row s of every state layer's state tensors (hybridkv/state_layers.py). Slot 0 is never
given: the padded rows of a graph bucket read and write it (scratch). A fork (n > 1, a beam) takes a slot of
its own and a copy of its parent's state (a state changes every token: copy-on-write would copy at once).
No torch here: the memory manager's side.
"""

from __future__ import annotations

SCRATCH_SLOT = 0


class StateSlots:
    """Slots 1..num_slots-1, each held by at most one request."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"a state pool needs the scratch slot and one more, got {num_slots} slots")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, SCRATCH_SLOT, -1))
        self.held: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, request_id: str) -> int:
        """A slot for a request that holds none (the caller checked `num_free`)."""
        slot = self._free.pop()
        self.held[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        slot = self.held.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_integrity(self) -> None:
        """Every slot but the scratch one is free or held, once."""
        held = list(self.held.values())
        assert len(set(held)) == len(held), f"a state slot is held twice: {self.held}"
        assert SCRATCH_SLOT not in held and SCRATCH_SLOT not in self._free, "the scratch slot was given out"
        assert sorted(held + self._free) == list(range(1, self.num_slots)), "state slots lost or duplicated"
