"""Tiers beyond the pool: where a cached block goes when the pool evicts it, and where a prefix is found again.

A block the pool is about to reuse while it still holds a cached prefix (`BlockPool.on_evict`) is copied to a host
slot, keyed by its KV cache group and chained hash: `(group_id, block_hash)`, the key the pool's own map uses.
A block registered under its hash (`BlockPool.on_cache`) is written to the disk store too, where one is set,
so that it outlives the process. A prefix-cache lookup that misses in the pool asks `locate`; a block found in
a lower tier is copied back into a fresh block (`restore`) instead of computed.

Pure bookkeeping, as `SwapSpace` is: slot ids and lists of copies. The runner makes the copies, in the step's
order (hybridkv/execution/model_runner.py): each offload (device block -> host slot) before the step's swap and
copy-on-write copies, each restore (host slot -> device block) after them, all before the forward. A slot
that a copy of the step being planned reads or writes is pinned until the plan is taken (`take_copies`), so
that no later offload of the same step reuses it; the device blocks a restore writes are held by the
coordinator over the same span, so that no later eviction of the step reads them before they are written.

The disk store (`DiskStore`) is the execution layer's (it reads and writes pages); here it is a Protocol: whether
it holds a key, and load a key into a host slot (False, loading nothing, for a file that is missing or damaged).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.memory.kv_events import CPU, DISK, KVEventRecorder

TierKey = tuple[int, bytes]

# Where a prompt token's K/V came from, best first (`RequestOutput`'s and `stats()`' tiers).
TIERS = ("device", "host", "disk")


class DiskStore(Protocol):
    """What the tiers ask of the disk store (hybridkv/execution/kv_tiers.py)."""

    def has(self, key: TierKey) -> bool:
        """Whether a file for the block is known (cheap: no file is opened)."""
        ...

    def load(self, key: TierKey, host_slot: int) -> bool:
        """Read the block's file into the host slot; False (the slot's contents undefined) for a file that is
        missing, truncated or damaged, which the store forgets."""
        ...

    def save(self, key: TierKey, block_id: int) -> None:
        """Write the block's page (computed: its step ran) under the key, unless the store has it."""
        ...

    def counters(self) -> dict[str, int]:
        """Files written, removed (for room or on request), found damaged; the bytes of the folder."""
        ...


@dataclass
class TierCounters:
    """Blocks moved in and out of one tier, and the prompt tokens its blocks served."""

    hit_tokens: int = 0
    stored: int = 0
    restored: int = 0
    evicted: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "hit_tokens": self.hit_tokens,
            "stored": self.stored,
            "restored": self.restored,
            "evicted": self.evicted,
        }


@dataclass
class TierCopies:
    """A step's copies between the pool and the host slots: (device block, host slot) out, (host slot, device
    block) in; the runner makes every offload before the step's other copies and every restore after them."""

    offload: list[tuple[int, int]] = field(default_factory=list)
    restore: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.offload or self.restore)


class BlockTiers:
    """Host slots kept least recently used first, and the disk store behind them.

    `num_host_slots` holds offloaded blocks; with a disk store and no host tier of its own (`kv_offloading_size`
    0), the slots only stage the blocks a lookup reads from disk (`host_keeps` False: a block the pool evicts is
    not kept in them, its file is what outlives it).
    """

    def __init__(self, num_host_slots: int, disk: DiskStore | None = None, host_keeps: bool = True) -> None:
        if num_host_slots < 1:
            raise ValueError(f"the host tier needs a slot, got {num_host_slots}")
        self.num_host_slots = num_host_slots
        self.disk = disk
        self.host_keeps = host_keeps
        self._host: OrderedDict[TierKey, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_host_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._staged: list[int] = []  # free once the step's copies are taken
        self._copies = TierCopies()
        self.host = TierCounters()
        self.disk_counters = TierCounters()
        self.disk_on = disk is not None
        # Told of each block the host drops for room (the coordinator's record of evicted blocks).
        self.on_drop: Callable[[TierKey], None] | None = None
        # vLLM's KV events (hybridkv/memory/kv_events.py): told of each block a tier takes and drops.
        self.events: KVEventRecorder | None = None

    @property
    def num_host_blocks(self) -> int:
        return len(self._host)

    def locate(self, key: TierKey) -> str | None:
        """ "host" or "disk" where the block is kept below the pool, else None."""
        if key in self._host:
            return "host"
        if self.disk_on and self.disk.has(key):
            return "disk"
        return None

    def evicted(self, key: TierKey, block_id: int) -> None:
        """The pool reuses `block_id`, which holds the block `key`: copy it to a host slot (least recently used
        slot reused when none is free); nothing where the host keeps no blocks or already holds this one."""
        if not self.host_keeps:
            return
        slot = self._host.get(key)
        if slot is not None:
            self._host.move_to_end(key)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._host[key] = slot
        self._pinned.add(slot)
        self._copies.offload.append((block_id, slot))
        self.host.stored += 1
        if self.events is not None:
            self.events.copied(*key, CPU)

    def hold(self, keys: list[TierKey]) -> None:
        """Keep the host slots of these blocks (those the host holds) until the step's copies are taken: a lookup
        about to restore them pops fresh blocks first, whose evictions come here."""
        for key in keys:
            slot = self._host.get(key)
            if slot is not None:
                self._pinned.add(slot)

    def restore(self, key: TierKey, block_id: int) -> str | None:
        """Copy the block `key` into the fresh `block_id` before the step's forward: the tier it came from
        ("host", "disk"), or None (nothing planned) where it is in neither or its file proved damaged."""
        slot = self._host.get(key)
        tier = "host"
        if slot is None:
            if not self.disk_on or not self.disk.has(key):
                return None
            slot = self._take_slot()
            if slot is None:
                return None
            if not self.disk.load(key, slot):
                self._free.append(slot)
                return None
            tier = "disk"
            self.disk_counters.restored += 1
            if self.host_keeps:
                self._host[key] = slot
                if self.events is not None:
                    self.events.copied(*key, CPU)
            else:  # a staging slot: free again once the step's copies are made
                self._staged.append(slot)
        else:
            self._host.move_to_end(key)
            self.host.restored += 1
        self._pinned.add(slot)
        self._copies.restore.append((slot, block_id))
        return tier

    def cached(self, key: TierKey, block_id: int) -> None:
        """The pool registered `block_id`, computed, under `key`: the disk store writes it."""
        if self.disk_on:
            if self.events is not None:
                self.events.copied(*key, DISK)
            self.disk.save(key, block_id)

    def take_copies(self) -> TierCopies:
        """The copies planned since the last call (the step's), which unpins their slots."""
        copies, self._copies = self._copies, TierCopies()
        self._pinned.clear()
        self._free.extend(self._staged)
        self._staged.clear()
        return copies

    def forget(self) -> None:
        """Drop every host block (`reset_prefix_cache`): none is found again; a slot a planned copy still uses is
        free once the step's copies are taken."""
        for slot in self._host.values():
            (self._staged if slot in self._pinned else self._free).append(slot)
        self._host.clear()

    def model_changed(self, as_patched: bool) -> None:
        """The model changed (weights, adapters, `reset_prefix_cache`): the host's blocks are another model's, and
        the disk is read and written only while the model is as patched (`as_patched`), the one its files name."""
        self.forget()
        self.disk_on = self.disk is not None and as_patched

    def _take_slot(self) -> int | None:
        """A free host slot, else the least recently used unpinned one (its block dropped: an eviction)."""
        if self._free:
            return self._free.pop()
        for key, slot in self._host.items():
            if slot not in self._pinned:
                del self._host[key]
                self.host.evicted += 1
                if self.events is not None:
                    self.events.removed(*key, CPU)
                if self.on_drop is not None:
                    self.on_drop(key)
                return slot
        return None

    def check_integrity(self) -> None:
        """Every host slot is free, staged or holds one block, once; a pinned slot is one of them."""
        slots = [*self._free, *self._staged, *self._host.values()]
        assert sorted(slots) == list(range(self.num_host_slots)), "host tier slots lost or duplicated"
        assert self._pinned <= set(slots), "a pinned host slot is lost"
