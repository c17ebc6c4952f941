"""State slots: where each request keeps the state of a model's state layers (linear attention, SSM, conv).

A state layer keeps one fixed-size state per request, whatever its length, so a request needs one slot, not
blocks: slot s is row s of every state layer's state tensors (hybridkv/execution/state_layers.py). Slot 0 is never
given: the padded rows of a graph bucket read and write it (scratch). A fork (n > 1, a beam) takes a slot of
its own and a copy of its parent's state (a state changes every token: copy-on-write would copy at once).
Slots after the requests' are checkpoints (`StateCheckpoints`): states at block boundaries of computed prefixes,
what a prefix-cache hit restores. No torch here: the memory manager's side.
"""

from __future__ import annotations

from collections import OrderedDict

from hybridkv.memory.kv_events import GPU, KVEventRecorder
from hybridkv.memory.tiers import BlockTiers

SCRATCH_SLOT = 0
# The group id of state checkpoints' keys in the tiers below the pool (blocks' groups count from 0).
STATE_GROUP = 65535


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


class StateCheckpoints:
    """States kept at block boundaries of computed prefixes: what a prefix-cache hit of a model with state layers
    starts from (a hit of the attention blocks alone would start from an empty state).

    A checkpoint is every state layer's state after the first `interval` x k tokens of a sequence, keyed by the
    chained hash of the block that ends there (which names the whole prefix), in one of `count` slots of the
    state pool from `first_slot` on. `interval` is a multiple of every group's block size and of the layers' scan
    chunk, so that a computation split at a checkpoint continues exactly as an unsplit one. A step that computes
    across a boundary with no checkpoint reserves one (`reserve`: the layers copy the state there as they pass
    it); it is found only once the step ran (`commit`; `discard` when the step failed). When the slots run out
    the least recently used checkpoint goes.
    """

    def __init__(self, first_slot: int, count: int, interval: int) -> None:
        if count < 1 or interval < 1:
            raise ValueError(f"state checkpoints need a slot and an interval, got {count} slots every {interval}")
        self.first_slot, self.num_slots, self.interval = first_slot, count, interval
        self._free = list(range(first_slot + count - 1, first_slot - 1, -1))
        self._kept: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._pending: dict[bytes, int] = {}
        # Tiers below the pool (hybridkv/memory/tiers.py, keyed `(STATE_GROUP, block hash)`): an evicted checkpoint
        # is copied there, a lookup that misses here brings one back. Slots found in this step: a restore must not
        # take one (a hit's copy reads it before the forward).
        self.tiers: BlockTiers | None = None
        self._found: set[int] = set()
        # vLLM's KV events (hybridkv/memory/kv_events.py): told of each checkpoint written and evicted.
        self.events: KVEventRecorder | None = None

    @property
    def num_kept(self) -> int:
        return len(self._kept)

    def find(self, block_hash: bytes) -> int | None:
        """The slot of the checkpoint after the block `block_hash` names, if one is kept (now most recently used);
        with tiers, one kept below is copied back into a slot (before the step's forward) and kept again."""
        slot = self._kept.get(block_hash)
        if slot is not None:
            self._kept.move_to_end(block_hash)
            self._found.add(slot)
            return slot
        tiers = self.tiers
        if tiers is None or block_hash in self._pending or tiers.locate((STATE_GROUP, block_hash)) is None:
            return None
        slot = self._slot_for_restore()
        if slot is None:
            return None
        if tiers.restore((STATE_GROUP, block_hash), slot) is None:
            self._free.append(slot)
            return None
        self._kept[block_hash] = slot
        self._found.add(slot)
        if self.events is not None:
            self.events.copied(STATE_GROUP, block_hash, GPU)
        return slot

    def _slot_for_restore(self) -> int | None:
        """A free slot, else the least recently used kept one that no hit of this step reads (evicted: the tiers
        keep it)."""
        if self._free:
            return self._free.pop()
        for block_hash, slot in self._kept.items():
            if slot not in self._found:
                del self._kept[block_hash]
                self._evicted(block_hash, slot)
                return slot
        return None

    def _evicted(self, block_hash: bytes, slot: int) -> None:
        if self.events is not None:
            self.events.removed(STATE_GROUP, block_hash)
        if self.tiers is not None:
            self.tiers.evicted((STATE_GROUP, block_hash), slot)

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot for the checkpoint after `block_hash`, or None where one is kept or planned already (or every
        slot is planned in this step). A slot taken from a kept checkpoint may be one a hit restores in this
        same step: the restore copies before the forward, the layers write after."""
        if block_hash in self._kept or block_hash in self._pending:
            return None
        if self._free:
            slot = self._free.pop()
        elif self._kept:
            evicted, slot = self._kept.popitem(last=False)
            self._evicted(evicted, slot)
        else:
            return None
        self._pending[block_hash] = slot
        return slot

    def commit(self) -> None:
        """The step ran: its checkpoints hold their states (the tiers' disk store writes them)."""
        if self.tiers is not None:
            for block_hash, slot in self._pending.items():
                self.tiers.cached((STATE_GROUP, block_hash), slot)
        if self.events is not None:
            self.events.checkpoints_written(list(self._pending))
        self._kept.update(self._pending)
        self._pending.clear()
        self._found.clear()

    def discard(self) -> None:
        """The step failed: its checkpoints were not (all) written."""
        if self.events is not None:
            self.events.checkpoints_discarded()
        self._free.extend(self._pending.values())
        self._pending.clear()
        self._found.clear()

    def forget(self) -> None:
        """Drop every kept checkpoint (their slots' states are about to go: `LLMEngine.sleep`)."""
        self._free.extend(self._kept.values())
        self._kept.clear()
        self._found.clear()

    def check_integrity(self) -> None:
        """Every checkpoint slot is free, kept or pending, once."""
        slots = [*self._free, *self._kept.values(), *self._pending.values()]
        expected = list(range(self.first_slot, self.first_slot + self.num_slots))
        assert sorted(slots) == expected, "state checkpoint slots lost or duplicated"
