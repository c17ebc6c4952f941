"""The coordinator: all KV cache groups of one model, allocated and freed as one.

It finds the longest prefix that hits in every group, allocates a step's blocks in every group or in
none, caches blocks that became full and returns blocks that fell out of a sliding window. Groups may
hold different numbers of tokens per block (hybridkv/memory/grouping.py); token counts are the common unit.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from hybridkv.memory.block_pool import BlockLookup, BlockPool, KVBlock, cdiv
from hybridkv.memory.grouping import KVCacheConfig
from hybridkv.memory.kv_events import SPEC_KINDS, BlockChain, GroupShape, KVEventRecorder
from hybridkv.memory.kv_request import KVRequest
from hybridkv.memory.managers import FullAttentionManager, SingleTypeManager, num_window_blocks
from hybridkv.memory.state_slots import STATE_GROUP, StateCheckpoints, StateSlots
from hybridkv.memory.tiers import BlockTiers, TierCopies, TierKey
from hybridkv.memory.window_managers import ChunkedLocalManager, SlidingWindowManager, WindowedManager

# update_computed's next changes for a request it has not updated yet (both of its parts run), and the number of
# computed tokens of a change that never comes (no group with a window or chunk: `_next_change_after`).
_NOW = (0, 0, 0)
_request_id = attrgetter("request_id")
_NEVER = sys.maxsize

# The manager of each attention type (`KVCacheGroupSpec.attention_type`; vLLM's `spec_manager_map`).
MANAGER_CLASSES: dict[str, type[SingleTypeManager]] = {
    "full": FullAttentionManager,
    "sliding_window": SlidingWindowManager,
    "chunked_local": ChunkedLocalManager,
}


@dataclass(slots=True)
class TableUpdates:
    """What changed in the block lists since the coordinator last reported (`take_table_updates`): `freed`, the
    requests that gave back every block, and `entries` (group id, request id, first changed position, the
    list's entries from there on), applied after `freed` (a request freed and given blocks again has an entry
    from position 0). Plain lists: a tensor-parallel driver sends them to the other ranks."""

    entries: list[tuple[int, str, int, list[int]]] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)
    # (request id, state slot) of the requests given a state slot (a model with state layers).
    slots: list[tuple[str, int]] = field(default_factory=list)


@dataclass(slots=True)
class CacheHit:
    """A prefix-cache hit: the starting block list of each group and the tokens it covers."""

    blocks: list[list[KVBlock]]
    num_tokens: int
    # A model with state layers: the checkpoint slot of the state at the hit's end (hybridkv/memory/state_slots.py).
    state_slot: int | None = None
    # Of num_tokens, those whose blocks were copied back from the host tier and from disk (hybridkv/memory/tiers.py).
    host_tokens: int = 0
    disk_tokens: int = 0
    # Where the hit stopped short of the prompt, and why (`explain_miss`); None for a full hit.
    miss: dict[str, int | str] | None = None


@dataclass
class KVCacheStats:
    """Counters since the coordinator was built; blocks_in_use_per_group counts distinct real blocks."""

    num_blocks: int
    num_free_blocks: int
    blocks_in_use: int
    blocks_in_use_per_group: list[int]
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions: int
    group_size: int
    padding_layers: int
    group_block_sizes: list[int]
    padding_fraction: float
    # The prompt tokens each tier served ("device", "host", "disk"; the last two with tiers) and each tier's
    # counters of blocks stored, restored and evicted.
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


# What a tiered lookup finds for a block kept below the pool: a hit to copy back (never a block of the pool).
BELOW_POOL = KVBlock(-2)


class TieredLookup:
    """One group's blocks seen across the pool and the tiers below it (`BlockLookup`): the pool's block for a hash,
    else `BELOW_POOL` where a tier keeps it, else None."""

    __slots__ = ("cached", "group_id", "tiers")

    def __init__(self, cached: dict[bytes, KVBlock], tiers: BlockTiers | None, group_id: int) -> None:
        self.cached, self.tiers, self.group_id = cached, tiers, group_id

    def get(self, block_hash: bytes, /) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None and self.tiers is not None and self.tiers.locate((self.group_id, block_hash)) is not None:
            return BELOW_POOL
        return block


def _with_tiers(hit: CacheHit, tier_tokens: dict[str, set[int]]) -> CacheHit:
    """The hit with the tokens of it whose blocks came back from disk, and from the host alone."""
    disk = {t for t in tier_tokens["disk"] if t < hit.num_tokens}
    hit.disk_tokens = len(disk)
    hit.host_tokens = len({t for t in tier_tokens["host"] if t < hit.num_tokens} - disk)
    return hit


def blocks_for_request(config: KVCacheConfig, num_tokens: int) -> int:
    """The most blocks one request of num_tokens tokens needs at once, whatever its chunks: a full
    group holds a block per block_size tokens, a sliding group never more than ceil((W-1)/block_size) + 1
    blocks (its chunks are read in flight: hybridkv/memory/window_managers.py), a chunked local group the same
    with the attention chunk size C for W."""
    total = 0
    for group in config.groups:
        block_size = group.block_size
        all_blocks = cdiv(num_tokens, block_size)
        if group.is_full_attention:
            total += all_blocks
        else:
            reach = group.sliding_window or group.attention_chunk_size
            total += min(all_blocks, num_window_blocks(reach, block_size) + 1)
    return total


class KVCacheCoordinator:
    """Every group's manager over one shared block pool.

    Contract: allocate_slots either succeeds in every group or changes no request's blocks (it may take
    back spare blocks of other requests' pending steps, which only moves their tails); free returns every
    block of a request in every group; after update_computed the request holds no block that its
    next query cannot attend to.
    """

    # Blocks a window leaves behind as it moves on are reused before other cached blocks (`BlockPool.free_blocks`'s
    # `low`): a hit reads a window's blocks only at its end, and most ends are where a request stopped, whose blocks
    # go back with the request. Measured against plain LRU in benchmarks/tiered_cache.py --eviction.
    window_aware_eviction = True

    def __init__(
        self,
        config: KVCacheConfig,
        num_blocks: int,
        enable_caching: bool = True,
        num_state_slots: int = 0,
        num_state_checkpoints: int = 0,
        state_checkpoint_interval: int = 0,
        checkpoints_in_prompts_only: bool = False,
    ) -> None:
        self.config = config
        # A model whose state layers' decode form computes other numbers than their prompt form (beyond rounding):
        # a state reached through generated tokens is not the one a prompt of those tokens has, so only prompts'
        # states are kept for hits.
        self.checkpoints_in_prompts_only = checkpoints_in_prompts_only
        # A model with state layers: one state slot per request that holds blocks, and with prefix caching the
        # states at block boundaries that hits restore, in the slots after those (hybridkv/memory/state_slots.py).
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        self.state_checkpoints = None
        if num_state_slots and enable_caching and num_state_checkpoints:
            if state_checkpoint_interval % config.hit_alignment:
                raise ValueError(
                    f"state_checkpoint_interval={state_checkpoint_interval} must be a multiple of every group's "
                    f"block size ({config.hit_alignment} tokens)"
                )
            self.state_checkpoints = StateCheckpoints(num_state_slots, num_state_checkpoints, state_checkpoint_interval)
        self._slot_updates: list[tuple[str, int]] = []
        self._state_copies: list[tuple[int, int]] = []
        self.block_size = config.block_size  # of prefix-cache hashes; the smallest group block size
        self.hit_alignment = config.hit_alignment
        self.enable_caching = enable_caching
        # The model as it computes now (hybridkv/execution/model_watch.py; b"": as patched): a request is admitted only
        # with block hashes chained from it (`Scheduler` rekeys one hashed under another), so no hit is ever K/V, or a
        # state checkpoint, that another model computed.
        self.model_key = b""
        self.pool = BlockPool(num_blocks, len(config.groups), enable_caching)
        self.managers: list[SingleTypeManager] = [
            MANAGER_CLASSES[group.attention_type].for_group(group, self.pool, group.block_size // config.block_size)
            for group in config.groups
        ]
        self._windowed = [m for m in self.managers if isinstance(m, WindowedManager)]
        self._is_windowed = [isinstance(m, WindowedManager) for m in self.managers]
        # Prefix-closed kinds first: their hit only shrinks the search of the others.
        self._search_order = sorted(self.managers, key=lambda m: not m.hits_are_prefix_closed)
        # With one block size, one group's list length says whether any group needs a block.
        self._one_block_size = len({m.block_size for m in self.managers}) == 1
        self._first = self.managers[0]
        # Whether every group's list covers a request's first n tokens: with one block size, the first group's says.
        self._covered = self._first.covers if self._one_block_size else self._every_group_covers
        # Requests that may share a block they write into (forks, and groups swapped back in together):
        # only they pay the copy-on-write check.
        self._may_share: set[str] = set()
        # Copy-on-write copies made since the last take_copies, per request: (manager, position, the
        # shared source block, the request's new block).
        self._copies: dict[str, list[tuple[SingleTypeManager, int, KVBlock, KVBlock]]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.host_hit_tokens = self.disk_hit_tokens = 0
        # vLLM's KV events (`record_events`), and the blocks the pool registered in the update being made.
        self.events: KVEventRecorder | None = None
        self._just_cached: list[KVBlock] = []
        # Tiers beyond the pool (`attach_tiers`).
        self.tiers: BlockTiers | None = None
        self._restored: list[KVBlock] = []
        # Requests freed since the last take_table_updates.
        self._freed: list[str] = []
        # update_computed's fast path: per request, the numbers of computed tokens at which an update can next
        # change something (the nearest of the two that follow), at which a block next fills (caching waits for
        # it) and at which a window or chunk start next passes a block (returning blocks waits for it, or for a
        # windowed group's pending step, which an update drops).
        self._next_change: dict[str, tuple[int, int, int]] = {}
        # What `_next_change_after` reads of each group: (block size, window, chunk size), once per distinct kind.
        self._change_rules = list(
            dict.fromkeys(
                (m.block_size, getattr(m, "sliding_window", None), getattr(m, "attention_chunk_size", None))
                for m in self.managers
            )
        )

    def find_longest_cache_hit(self, request: KVRequest) -> CacheHit:
        """The longest block-aligned prefix of the request's tokens cached in every group.

        Called before a request's first allocation (new, or back after preemption, when its known
        tokens include its outputs). Never covers the last token: it must be computed to produce
        logits. A hit ends where every group's blocks end (a multiple of `hit_alignment` tokens).
        Iterates to a fixed point, since a shorter hit in one group can move a sliding group's hit. A model with
        state layers hits only where a state checkpoint is kept too (a multiple of its interval): the state at
        the hit's end is restored from it.
        """
        checkpoints = self.state_checkpoints
        if (
            not self.enable_caching
            or not request.reads_prefix_cache
            or (self.state_slots is not None and checkpoints is None)
        ):
            return CacheHit([[] for _ in self.managers], 0)
        align = self.hit_alignment if checkpoints is None else checkpoints.interval
        max_tokens = min(request.num_tokens - 1, len(request.block_hashes) * self.block_size) // align * align
        if self.tiers is not None:
            hit = self._tiered_cache_hit(request, max_tokens, align)
        else:
            hit = self._cache_hit(request, max_tokens, align)
        if hit.num_tokens < max_tokens:
            hit.miss = self.explain_miss(request, hit.num_tokens, align)
        return hit

    def explain_miss(self, request: KVRequest, num_tokens: int, align: int) -> dict[str, int | str]:
        """Why a hit of `num_tokens` went no further: the first group (in group order) lacking a block that a hit one
        alignment step longer reads, and whether that block was evicted (from every tier) or never cached; else a
        state checkpoint missing there. {"group": id or -1 for the checkpoint, "kind", "tokens": where the hit
        ended, "reason"}."""
        end = num_tokens + align
        for manager in self.managers:
            size = manager.block_size
            lookup = TieredLookup(self.pool.cached[manager.group_id], self.tiers, manager.group_id)
            for index in range(manager.first_needed_block(end - 1), min(end // size, len(request.block_hashes))):
                block_hash = manager.block_hash(request.block_hashes, index)
                if lookup.get(block_hash) is None:
                    evicted = block_hash in self.pool.evicted_keys[manager.group_id]
                    return {
                        "group": manager.group_id,
                        "kind": manager.kind,
                        "tokens": num_tokens,
                        "reason": "evicted" if evicted else "never cached",
                    }
        return {"group": -1, "kind": "state checkpoint", "tokens": num_tokens, "reason": "no checkpoint kept there"}

    def _cache_hit(
        self, request: KVRequest, max_tokens: int, align: int, lookups: Sequence[BlockLookup | None] | None = None
    ) -> CacheHit:
        """`find_longest_cache_hit` of at most max_tokens tokens (a multiple of `align`), each group's blocks looked
        up in its `lookups` entry (default: the pool's map)."""
        checkpoints = self.state_checkpoints
        if lookups is None:
            lookups = [None] * len(self.managers)
        hits: list[list[KVBlock]] = [[] for _ in self.managers]
        state_slot = None
        settled = False
        while not settled and max_tokens > 0:
            settled = True
            for manager in self._search_order:
                hit = manager.find_longest_cache_hit(
                    request.block_hashes, max_tokens // manager.block_size, lookups[manager.group_id]
                )
                hits[manager.group_id] = hit
                hit_tokens = len(hit) * manager.block_size
                if hit_tokens < max_tokens:
                    max_tokens = hit_tokens // align * align
                    # A shorter prefix of a prefix-closed kind's hit is a hit; a window's is not.
                    settled = manager.hits_are_prefix_closed and settled
            if checkpoints is not None and max_tokens > 0:
                kept, state_slot = self._longest_checkpoint(request.block_hashes, max_tokens)
                # A checkpoint short of the groups' hit: search them again up to it (a window's hit moves).
                settled = settled and kept == max_tokens
                max_tokens = kept
        if max_tokens == 0:
            hits = [[] for _ in self.managers]
            state_slot = None
        for manager, hit in zip(self.managers, hits, strict=True):
            del hit[max_tokens // manager.block_size :]
        return CacheHit(hits, max_tokens, state_slot)

    def _tiered_cache_hit(self, request: KVRequest, max_tokens: int, align: int) -> CacheHit:
        """`find_longest_cache_hit` where blocks kept below the pool count too: the hit is searched with each
        group's pool map and tiers seen as one (`TieredLookup`), then every block of it found below the pool is
        copied back into a fresh block (`BlockTiers.restore`), registered under its hash in the pool and held
        until the step's copies are taken. A block whose file proved damaged is forgotten by its store and the
        search runs again without it; a pool that lacks the fresh blocks gives the pool's own hit."""
        tiers = self.tiers
        pool = self.pool
        # The token positions whose blocks came back from each tier, over every pass (a block restored in a pass that
        # lost another is in the pool at the next: still the tier's).
        tier_tokens: dict[str, set[int]] = {"host": set(), "disk": set()}
        while True:
            lookups = [TieredLookup(pool.cached[m.group_id], tiers, m.group_id) for m in self.managers]
            hit = self._cache_hit(request, max_tokens, align, lookups)
            below = [
                (manager, index)
                for manager, blocks in zip(self.managers, hit.blocks, strict=True)
                for index, block in enumerate(blocks)
                if block is BELOW_POOL
            ]
            if not below:
                return _with_tiers(hit, tier_tokens)
            # The hit's blocks in the pool and in the host tier must survive the fresh blocks' evictions (which the
            # host tier keeps): held while those are popped.
            tiers.hold(
                [(manager.group_id, manager.block_hash(request.block_hashes, index)) for manager, index in below]
            )
            held = [block for blocks in hit.blocks for block in blocks if block is not BELOW_POOL and not block.is_null]
            pool.touch(held)
            if len(below) > pool.num_free_blocks:
                pool.free_blocks(reversed(held))
                return _with_tiers(self._cache_hit(request, max_tokens, align), tier_tokens)
            fresh = pool.get_new_blocks(len(below))
            lost = []
            no_room = False
            for (manager, index), block in zip(below, fresh, strict=True):
                block_hash = manager.block_hash(request.block_hashes, index)
                key = (manager.group_id, block_hash)
                tier = tiers.restore(key, block.block_id)
                if tier is None:  # a damaged file (forgotten now), or no host slot to read it into this step
                    no_room = no_room or tiers.locate(key) is not None
                    lost.append(block)
                    continue
                pool.cache_restored(block, block_hash, manager.group_id)
                if self.events is not None:
                    self.events.stored([manager.group_id], self._chain(request, manager, index, index + 1))
                hit.blocks[manager.group_id][index] = block
                self._restored.append(block)
                size = manager.block_size
                tier_tokens[tier].update(range(index * size, (index + 1) * size))
            pool.free_blocks(lost)
            pool.free_blocks(reversed(held))
            if no_room:  # what came back is in the pool now: the pool's own hit
                return _with_tiers(self._cache_hit(request, max_tokens, align), tier_tokens)
            if not lost:
                return _with_tiers(hit, tier_tokens)

    def attach_tiers(self, tiers: BlockTiers, state_tiers: BlockTiers | None = None) -> None:
        """Keep blocks beyond the pool (hybridkv/memory/tiers.py): the pool tells the tiers what it evicts and caches;
        a lookup finds blocks there too and copies them back into fresh blocks, held until the step's copies are
        taken (`take_tier_copies`). A model with state layers keeps its state checkpoints in `state_tiers`."""
        assert self.enable_caching, "tiers keep prefix-cache blocks: prefix caching must be on"
        self.tiers = tiers
        self.pool.on_evict = self._evicted
        self.pool.on_cache = self._cached
        tiers.on_drop = self._forgotten
        tiers.events = self.events
        if self.state_checkpoints is not None:
            self.state_checkpoints.tiers = state_tiers
            if state_tiers is not None:
                state_tiers.events = self.events

    def _evicted(self, block: KVBlock) -> None:
        """The pool reuses a block that still holds a cached prefix: the host tier keeps a copy."""
        self.tiers.evicted((block.hash_group, block.block_hash), block.block_id)

    def _forgotten(self, key: TierKey) -> None:
        """The host tier dropped the block `key` for room: an eviction `explain_miss` may name."""
        self.pool.record_evicted(*key)

    def _cached(self, block: KVBlock) -> None:
        """The pool registered a computed block under its hash: the disk store writes it, and the events announce
        it once the update is made (`_announce_cached`)."""
        if self.tiers is not None:
            self.tiers.cached((block.hash_group, block.block_hash), block.block_id)
        if self.events is not None:
            self._just_cached.append(block)

    def record_events(self, hybrid_groups: bool = True) -> KVEventRecorder:
        """Record vLLM's KV events from now on (hybridkv/memory/kv_events.py): the pool's blocks as they are cached
        and evicted, the state checkpoints', and the tiers'. Groups are published prefix-closed ones first (group 0
        is the one a single-group index reads), the state checkpoints last; `hybrid_groups` False: group 0 alone."""
        shapes = [
            GroupShape(m.block_size, SPEC_KINDS[m.kind], getattr(m, "sliding_window", None)) for m in self.managers
        ]
        published = sorted(range(len(self.managers)), key=lambda g: not self.managers[g].hits_are_prefix_closed)
        order = [published.index(group_id) for group_id in range(len(self.managers))]
        state_group = len(self.managers) if self.state_checkpoints is not None else None
        recorder = KVEventRecorder(shapes, order, state_group, STATE_GROUP, hybrid_groups)
        self.events = recorder
        self._group_ids = list(range(len(self.managers)))
        self.pool.events = recorder
        self.pool.on_cache = self._cached
        if self.state_checkpoints is not None:
            self.state_checkpoints.events = recorder
        for tier in (self.tiers, self.state_checkpoints.tiers if self.state_checkpoints is not None else None):
            if tier is not None:
                tier.events = recorder
        return recorder

    def _announce_cached(self, request: KVRequest) -> None:
        """`BlockStored` for the blocks the pool registered in the request's update: in each group, they are among
        its last cached positions (a block whose hash another block holds already is not registered: a gap). Groups
        of one block size that registered the same positions (most updates of a hybrid model) share one chain."""
        request_id = request.request_id
        cached, self._just_cached = self._just_cached, []
        if self._one_block_size and len(cached) == len(self.managers):  # a block filled in every group, in order
            index = self._first.num_cached(request_id) - 1
            pairs = zip(self.managers, cached, strict=True)
            if index >= 0 and all(manager.blocks_of(request_id)[index] is block for manager, block in pairs):
                self.events.stored(self._group_ids, self._chain(request, self._first, index, index + 1))
                return
        just = {id(block) for block in cached}
        counts = Counter(block.hash_group for block in cached)
        chains: dict[tuple[int, int, int], list[int]] = {}
        for group_id, count in counts.items():
            manager = self.managers[group_id]
            blocks = manager.blocks_of(request_id)
            indices = []
            index = manager.num_cached(request_id) - 1
            while count and index >= 0:
                if id(blocks[index]) in just:
                    indices.append(index)
                    count -= 1
                index -= 1
            indices.reverse()
            for run in _runs(indices):
                chains.setdefault((manager.hash_stride, run[0], run[-1] + 1), []).append(group_id)
        for (_, start, end), group_ids in chains.items():
            self.events.stored(group_ids, self._chain(request, self.managers[group_ids[0]], start, end))

    def _chain(self, request: KVRequest, manager: SingleTypeManager, start: int, end: int) -> BlockChain:
        """The request's blocks start..end-1 in the manager's group, as the events announce them."""
        hashes, size = request.block_hashes, manager.block_size
        return BlockChain(
            list(manager.block_hashes_between(hashes, start, end)),
            manager.block_hash(hashes, start - 1) if start else None,
            request.token_ids[start * size : end * size],
            request.adapter_id,
        )

    def take_tier_copies(self) -> tuple[TierCopies, TierCopies]:
        """The copies between the pool and the tiers planned since the last call (the runner makes them before the
        step's forward), of blocks and of state checkpoints; the blocks restored in them are no longer held."""
        if self.tiers is None:
            return TierCopies(), TierCopies()
        restored, self._restored = self._restored, []
        self.pool.free_blocks(reversed(restored))
        state_tiers = self.state_checkpoints.tiers if self.state_checkpoints is not None else None
        return self.tiers.take_copies(), state_tiers.take_copies() if state_tiers is not None else TierCopies()

    def model_changed(self, key: bytes) -> None:
        """The model computes as `key` now: no block of another model is found in a tier (the disk tier is read and
        written only while the model is as patched, b"", the one its files name)."""
        self.model_key = key
        if self.events is not None:  # what the pool and the tiers hold is another model's: no request hits it
            self.events.cleared()
        tiers = [self.tiers, self.state_checkpoints.tiers if self.state_checkpoints is not None else None]
        for tier in tiers:
            if tier is not None:
                tier.model_changed(as_patched=key == b"")

    def _longest_checkpoint(self, block_hashes: Sequence[bytes], max_tokens: int) -> tuple[int, int | None]:
        """The longest prefix of at most max_tokens tokens whose state is kept, and its checkpoint slot."""
        checkpoints = self.state_checkpoints
        interval, size = checkpoints.interval, self.block_size
        for end in range(max_tokens // interval * interval, 0, -interval):
            slot = checkpoints.find(block_hashes[end // size - 1])
            if slot is not None:
                return end, slot
        return 0, None

    def plan_state_checkpoints(self, scheduled: Sequence[tuple[KVRequest, int, object]]) -> dict[str, list]:
        """Before a step runs: per request, (tokens into its step, checkpoint slot) of each boundary of the
        checkpoint interval that its step computes across and that no checkpoint holds yet; the state layers
        copy the request's state there as they pass it (hybridkv/execution/state_layers.py)."""
        checkpoints = self.state_checkpoints
        interval, size = checkpoints.interval, self.block_size
        planned: dict[str, list[tuple[int, int]]] = {}
        for request, num_new, _ in scheduled:
            start = request.num_computed_tokens
            end = min(start + num_new, len(request.block_hashes) * size)
            if self.checkpoints_in_prompts_only:
                end = min(end, request.num_prompt_tokens)
            first = (start // interval + 1) * interval
            if first > end:
                continue
            found = []
            for boundary in range(first, end + 1, interval):
                block_hash = request.block_hashes[boundary // size - 1]
                slot = checkpoints.reserve(block_hash)
                if slot is not None:
                    found.append((boundary - start, slot))
                    if self.events is not None:
                        self._checkpoint_planned(request, boundary // size - 1)
            if found:
                planned[request.request_id] = found
        return planned

    def _checkpoint_planned(self, request: KVRequest, index: int) -> None:
        """Tell the events of a state checkpoint planned after the request's block `index` (announced once written)."""
        hashes, size = request.block_hashes, self.block_size
        parent = hashes[index - 1] if index else None
        tokens = request.token_ids[index * size : (index + 1) * size]
        chain = BlockChain([hashes[index]], parent, tokens, request.adapter_id)
        self.events.checkpoint_planned(hashes[index], chain)

    def allocate_slots(self, request: KVRequest, num_new_tokens: int, hit: CacheHit | None = None) -> bool:
        """Give the request blocks for num_new_tokens more tokens (after the hit, if any).

        On success the hit's blocks are taken (and counted in the prefix-cache stats) and the
        request's num_computed_tokens is NOT changed (the caller advances it). On failure no block,
        ref count, block list or stat of this request changes. A windowed group's tail takes fresh
        blocks where the pool has them to spare (its old window stays cached), else moved ones; when the
        pool is short, spare fresh blocks of other pending steps come back first (`WindowedManager`).
        """
        request_id = request.request_id
        if hit is None and self._needs_nothing(request_id, request.num_computed_tokens + num_new_tokens):
            return True  # most decode steps
        slots = self.state_slots
        if slots is not None and request_id not in slots.held:
            if not slots.num_free:
                return False
            if not self._allocate_blocks(request, num_new_tokens, hit):
                return False
            slot = slots.take(request_id)
            self._slot_updates.append((request_id, slot))
            if hit is not None and hit.state_slot is not None:  # the state at the hit's end, before the forward
                self._state_copies.append((hit.state_slot, slot))
            return True
        return self._allocate_blocks(request, num_new_tokens, hit)

    def decode_needs(self, requests: Sequence[KVRequest]) -> list[KVRequest] | None:
        """For a decode step of `requests` (each one token, its last known): None unless each is one token short of
        its known tokens; else those whose token `allocate_slots` does not pass at its first test (no block to
        take, its state slot held, nothing shared), in order, which the caller allocates for, and no other: the
        rest need nothing (a few requests a step start a block). One pass, where a call of `allocate_slots` per
        request would cost more than its first test (`_needs_nothing`), which is the one made here."""
        request_ids = list(map(_request_id, requests))
        # `_needs_nothing`'s test for the batch: each group is asked once for every request's reach, in loops of C
        # (a call per request was the largest difference from the code before issue 62: benchmarks/RESULTS.md).
        if self._one_block_size:
            size, reached = self._first.block_size, self._first.num_positions_each(request_ids)
        else:  # in tokens: the group that reaches least
            size = 1
            reached = list(
                map(min, *([num * m.block_size for num in m.num_positions_each(request_ids)] for m in self.managers))
            )
        shared = self._may_share
        held = self.state_slots.held if self.state_slots is not None else None
        needs = []
        for request, request_id, num_reached in zip(requests, request_ids, reached, strict=True):
            num_tokens = request.num_computed_tokens + 1
            if num_tokens != len(request.token_ids) + request.num_pending_tokens:
                return None
            if num_tokens > num_reached * size or request_id in shared or (held is not None and request_id not in held):
                needs.append(request)
        return needs

    def _needs_nothing(self, request_id: str, num_tokens: int) -> bool:
        """Whether a step of the request up to num_tokens tokens, without a cache hit, takes nothing: every group's
        list covers them, the request holds its state slot and may share no block it writes. The first test of
        `allocate_slots` (`decode_needs` makes it for a batch at once)."""
        slots = self.state_slots
        return (
            request_id not in self._may_share
            and (slots is None or request_id in slots.held)
            and self._covered(request_id, num_tokens)
        )

    def _allocate_blocks(self, request: KVRequest, num_new_tokens: int, hit: CacheHit | None) -> bool:
        """`allocate_slots` in every KV cache group (the state slot aside)."""
        request_id = request.request_id
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        num_total = num_computed + num_new_tokens
        shared = self._shared_writes(request_id, num_computed) if request_id in self._may_share else []
        # A request that may share, or takes its state slot now, may still need no block.
        if hit is None and not shared and self._covered(request_id, num_total):
            return True
        if hit is None and not shared and self._one_block_size and self._append_one_block(request_id, num_total):
            return True
        hits = hit.blocks if hit else [[] for _ in self.managers]
        most = [
            manager.most_blocks_needed(request_id, num_total, hit_blocks)
            if windowed
            else manager.num_blocks_to_allocate(request_id, num_computed, num_total, hit_blocks)
            for manager, windowed, hit_blocks in zip(self.managers, self._is_windowed, hits, strict=True)
        ]
        if self.enable_caching and not shared and sum(most) <= self.pool.num_free_blocks:
            # Room for every new tail to take fresh blocks: no old-window block moves, none need be counted.
            spare_by_group = most
        else:
            spare_by_group = self._fit(request_id, num_computed, num_total, hits, len(shared))
            if spare_by_group is None:
                return False
        if shared:
            copies = self._copies.setdefault(request_id, [])
            for (manager, index), block in zip(shared, self.pool.get_new_blocks(len(shared)), strict=True):
                copies.append((manager, index, manager.replace_block(request_id, index, block), block))
        # Every group takes its hit before any group pops new blocks: a free hit block of one
        # group may sit at the head of the free queue, where another group's allocation would
        # evict it.
        if hit is not None:
            for manager in self.managers:
                manager.take_hit_blocks(request_id, hit.blocks[manager.group_id])
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += hit.num_tokens
                self.host_hit_tokens += hit.host_tokens
                self.disk_hit_tokens += hit.disk_tokens
        for manager, windowed, num_spare in zip(self.managers, self._is_windowed, spare_by_group, strict=True):
            if windowed:
                manager.allocate_step(request_id, num_total, request.block_hashes, num_spare)
            else:
                manager.allocate_new_blocks(request_id, num_computed, num_total)
        return True

    def _append_one_block(self, request_id: str, num_total: int) -> bool:
        """Most steps that need blocks (a decode step's token starting a block): with one block size, the step ends
        in the position just past the request's lists, and no windowed group holds a block that its window leaves
        this step (nothing to move or keep). Then every group takes one fresh block, popped together, as
        `allocate_step` and `allocate_new_blocks` would give them one by one. False, changing nothing, for any
        other step, or when the pool lacks a block per group."""
        position = self._first.num_positions(request_id)
        if position is None:
            return False
        size = self._first.block_size
        managers = self.managers
        # The step is [position * size, num_total): the whole of the new position, and only it.
        if not position * size < num_total <= (position + 1) * size or len(managers) > self.pool.num_free_blocks:
            return False
        for manager in self._windowed:
            if not manager.keeps_window(request_id, num_total):
                return False
        for manager, block in zip(managers, self.pool.get_new_blocks(len(managers)), strict=True):
            manager.append_block(request_id, block)
        return True

    def _fit(
        self, request_id: str, num_computed: int, num_total: int, hits: list[list[KVBlock]], num_copies: int
    ) -> list[int] | None:
        """Make room for the step's fewest blocks (every movable old-window block moves, `num_copies`
        copy-on-write copies), taking back other pending steps' spare blocks if the pool lacks them; then
        per group, how many fresh tail blocks beyond its fewest the pool has left for it. None, changing
        nothing, when even the fewest do not fit."""
        fewest = num_copies
        wanted = []
        for manager, windowed, hit_blocks in zip(self.managers, self._is_windowed, hits, strict=True):
            if windowed:
                low, high = manager.blocks_needed(request_id, num_computed, num_total, hit_blocks)
            else:
                low = high = manager.num_blocks_to_allocate(request_id, num_computed, num_total, hit_blocks)
            fewest += low
            wanted.append(high - low)
        shortfall = fewest - self.pool.num_free_blocks
        # A block this request is about to take as a hit must not move: its keys stay as they are.
        if shortfall > 0 and not self._reclaim(shortfall, request_id, {b.block_id for run in hits for b in run}):
            return None
        # Blocks beyond the fewest keep old windows cached: without caching there is nothing to keep.
        spare = self.pool.num_free_blocks - fewest if self.enable_caching else 0
        given = []
        for num_wanted in wanted:
            given.append(min(spare, num_wanted))
            spare -= given[-1]
        return given

    def _shared_writes(self, request_id: str, num_computed: int) -> list[tuple[SingleTypeManager, int]]:
        """The (manager, position) of each block the request writes next that another request holds too:
        each needs a copy of its own before the step writes (copy-on-write). Only the block holding
        position num_computed can be both written and shared: full blocks are never written again."""
        shared = []
        for manager in self.managers:
            index = manager.shared_write_block(request_id, num_computed)
            if index is not None:
                shared.append((manager, index))
        return shared

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give child_id (holding nothing) every block of parent_id in every group, shared: nothing is
        copied or recomputed until one of them writes into a shared block (see allocate_slots)."""
        for manager in self.managers:
            manager.fork(parent_id, child_id)
        self._may_share.add(parent_id)
        self._may_share.add(child_id)
        slots = self.state_slots
        if slots is not None:  # the child's state: a copy of its parent's, in a slot of its own
            if not slots.num_free:
                raise RuntimeError("no state slot left for a fork: the scheduler's seats should have kept one")
            child_slot = slots.take(child_id)
            self._slot_updates.append((child_id, child_slot))
            self._state_copies.append((slots.held[parent_id], child_slot))

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) state-slot copies made since the last call (forks, and hits' checkpoints
        restored), to run before the step's forward."""
        pairs, self._state_copies = self._state_copies, []
        return pairs

    def requeue_state_copies(self, pairs: list[tuple[int, int]]) -> None:
        """State copies taken for a plan that reached no runner: first in line again."""
        self._state_copies[:0] = pairs

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies made since the last call, to run before the step's
        forward: each destination takes its source's contents in every KV tensor of the group."""
        pairs = [(source.block_id, block.block_id) for copies in self._copies.values() for *_, source, block in copies]
        self._copies.clear()
        return pairs

    def swap_table(self, request_id: str) -> list[list[int]]:
        """The request's block table per group as a swap-out must read it: a block whose copy-on-write copy
        this step has not run yet is read from the copy's source, which holds those contents now."""
        tables = [list(row) for row in self.block_ids(request_id)]
        for manager, index, source, _ in self._copies.get(request_id, ()):
            tables[manager.group_id][index] = source.block_id
        return tables

    def _reclaim(self, num_blocks: int, request_id: str, keep: set[int] | None = None) -> bool:
        """Free `num_blocks` by taking back spare fresh tail blocks of other pending steps (never moving a
        block in `keep`), if they have that many (else change nothing and return False)."""
        keep = keep or set()
        if sum(m.num_reclaimable(request_id, keep) for m in self._windowed) < num_blocks:
            return False
        for manager in self._windowed:
            num_blocks -= manager.reclaim(num_blocks, request_id, keep)
        return True

    def use_slack_for_caching(self) -> int:
        """After a step's allocations: give the middles of windowed groups' pending steps free blocks, so
        their keys are stored and hashed (and go back to the pool after the step, still hashed). Returns
        how many blocks were given. Nothing is allocated after this until the step's update."""
        if not self.enable_caching:
            return 0
        given = 0
        # Window-aware: a middle is read only by a hit that ends inside it, so it takes only blocks whose reuse
        # loses as little (`num_spare_blocks`), never one that caches a prefix's end. Blocks are taken from the
        # queue's head, spare ones first, so each given block is one spare block fewer.
        queue = self.pool.free_queue
        spare = queue.num_spare_blocks if self.window_aware_eviction else queue.num_free_blocks
        for manager in self._windowed:
            if spare > given:
                given += manager.fill_middle(spare - given)
        return given

    def _every_group_covers(self, request_id: str, num_tokens: int) -> bool:
        """Whether every group's block list already covers num_tokens tokens of the request (`_covered`)."""
        return all(m.covers(request_id, num_tokens) for m in self.managers)

    def update_computed(self, request: KVRequest, pending: Collection[str] | None = None) -> None:
        """After a step computed tokens: cache blocks that became full, then return the blocks that
        request.num_computed_tokens has left out of every sliding window.

        Caching comes first so that out-of-window blocks go back to the pool still hashed. Each part runs only
        where it can change something: caching where a block filled since the last update, returning where a
        window or chunk start passed a block or a windowed group holds a pending step (decode steps meet one
        or the other, a token apart). `pending`: the requests with a pending step in some windowed group, where
        the caller has them (`update_computed_many`); else each windowed group is asked.
        """
        request_id = request.request_id
        num_computed = request.num_computed_tokens
        _, fills_at, moves_at = self._next_change.get(request_id, _NOW)
        caches = num_computed >= fills_at
        if pending is None:
            pending = self._pending_requests()
        returns = num_computed >= moves_at or request_id in pending
        if not (caches or returns):  # most decode steps
            return
        # Counted from the known tokens: a token still on the device (async scheduling) is computed, but the block
        # it fills is cached at the next update, once the token (and so the block's hash) is known.
        self._next_change[request_id] = self._next_change_after(min(num_computed, len(request.token_ids)))
        hashes = request.block_hashes
        if (
            caches
            and self.enable_caching
            and not (self._one_block_size and self._cache_one_block(request_id, hashes, num_computed))
        ):
            for manager in self.managers:
                manager.cache_blocks(request_id, hashes, num_computed)
        if self._just_cached:
            self._announce_cached(request)
        if not returns:
            return
        # The blocks every window left go back to the pool in one call, in the order the groups would return them
        # one by one (no group's caching touches another group's blocks or the free queue).
        released: list[KVBlock] = []
        for manager, windowed in zip(self.managers, self._is_windowed, strict=True):
            if windowed:
                released += manager.take_skipped_blocks(request_id, num_computed)
            else:
                manager.remove_skipped_blocks(request_id, num_computed)
        if released:
            self.pool.free_blocks(released, low=self.window_aware_eviction)

    def _cache_one_block(self, request_id: str, block_hashes: Sequence[bytes], num_computed: int) -> bool:
        """Most caching (a decode step's token filling a block): with one block size, every group's cached blocks
        end one block short of the computed tokens' full blocks. Then each group's block there is registered under
        its hash, as `cache_blocks` would, without a call per group. False, changing nothing, for any other case."""
        full = num_computed // self._first.block_size
        if not 0 < full <= len(block_hashes):
            return False
        before = full - 1
        managers = self.managers
        blocks = []
        for manager in managers:
            block = manager.block_to_cache(request_id, before)
            if block is None:
                return False
            blocks.append(block)
        for manager in managers:
            manager.set_num_cached_blocks(request_id, full)
        self.pool.cache_block_per_group(blocks, block_hashes[before])
        return True

    def update_computed_many(self, requests: Sequence[KVRequest]) -> None:
        """`update_computed` of each request, in order (a step's update): the requests that crossed no boundary
        and have no pending step are passed over with one comparison each."""
        next_change = self._next_change
        pending = self._pending_requests()
        for request in requests:
            request_id = request.request_id
            if request.num_computed_tokens >= next_change.get(request_id, _NOW)[0] or request_id in pending:
                self.update_computed(request, pending)

    def _pending_requests(self) -> Collection[str]:
        """The requests with a pending step in some windowed group (`WindowedManager.has_pending_step`)."""
        pending_lists = [m.pending_requests() for m in self._windowed]
        return set().union(*pending_lists) if any(pending_lists) else ()

    def _next_change_after(self, num_computed: int) -> tuple[int, int, int]:
        """The fewest computed tokens, past `num_computed`, at which an update changes anything in some group,
        the fewest at which a block fills, and the fewest at which a window's or chunk's first needed block moves
        on (`_NEVER` where no group has a window or chunk)."""
        fills = moves = _NEVER
        for block_size, window, chunk in self._change_rules:
            fills = min(fills, (num_computed // block_size + 1) * block_size)
            if window is not None:
                moves = min(moves, (max(0, num_computed - window + 1) // block_size + 1) * block_size + window - 1)
            if chunk is not None:
                moves = min(moves, (num_computed // chunk + 1) * chunk)
        return min(fills, moves), fills, moves

    def restore(self, tables: dict[str, list[list[int | None]]]) -> list[tuple[int, int]] | None:
        """Give requests that hold nothing (swapped out together) fresh blocks: per request and group, a
        table of swap ids by position (None where the null block was). A swap id in several tables
        becomes one block that all of them share; a model with state layers gives each a state slot too (the
        scheduler copies its swapped state there). None, changing nothing, if the pool lacks the blocks (after
        taking back other pending steps' spare blocks) or the slots; else the (swap id, new block id) pairs to
        copy."""
        slots = self.state_slots
        if slots is not None and slots.num_free < len(tables):  # each takes a state slot, for its swapped state
            return None
        unique = dict.fromkeys(swap_id for rows in tables.values() for row in rows for swap_id in row)
        unique.pop(None, None)
        shortfall = len(unique) - self.pool.num_free_blocks
        if shortfall > 0 and not self._reclaim(shortfall, None):
            return None
        fresh = dict(zip(unique, self.pool.get_new_blocks(len(unique)), strict=True))
        null = self.pool.null_block
        for request_id, rows in tables.items():
            for manager, row in zip(self.managers, rows, strict=True):
                manager.restore(request_id, [null if swap_id is None else fresh[swap_id] for swap_id in row])
        holders = Counter(swap_id for rows in tables.values() for row in rows for swap_id in row)
        for swap_id, block in fresh.items():
            block.ref_cnt = holders[swap_id]  # one reference per request that holds it
        if len(tables) > 1:
            self._may_share.update(tables)
        if slots is not None:
            self._slot_updates.extend((request_id, slots.take(request_id)) for request_id in tables)
        return [(swap_id, block.block_id) for swap_id, block in fresh.items()]

    def forget_cached(self) -> None:
        """Nothing is a prefix-cache hit any more, blocks nor state checkpoints (`LLMEngine.sleep`, which drops the
        pages' and the states' contents); every request must have ended. The host tiers forget theirs too (copies
        planned into them may not run); the disk keeps its files."""
        self.take_tier_copies()
        self.pool.forget_cached()
        if self.events is not None:
            self.events.cleared()
        if self.state_checkpoints is not None:
            self.state_checkpoints.forget()
        for tier in (self.tiers, self.state_checkpoints.tiers if self.state_checkpoints is not None else None):
            if tier is not None:
                tier.forget()

    def close(self) -> None:
        """Unlink the pool's blocks and drop the callbacks the pool and the tiers hold into this coordinator, so that
        all of it is freed by reference counting when dropped; unusable after."""
        self.pool.close()
        for tier in (self.tiers, self.state_checkpoints.tiers if self.state_checkpoints is not None else None):
            if tier is not None:
                tier.on_drop = None

    def keep_prefix_end(self, request: KVRequest) -> None:
        """A request that finished: where its computed prefix ends is where it is likeliest to be hit again (a
        returning session), so each windowed group's blocks that a hit ending there reads, which its window left
        behind as of little worth, become the most recently used cached blocks (window-aware eviction)."""
        if not self.window_aware_eviction or not self._windowed:
            return
        hashes = request.block_hashes
        end = min(request.num_computed_tokens, len(hashes) * self.block_size) // self.hit_alignment * self.hit_alignment
        keep, cached = self.pool.free_queue.keep, self.pool.cached
        for manager in self._windowed:
            found = cached[manager.group_id].get
            read = manager.block_hashes_between(hashes, manager.first_needed_block(end), end // manager.block_size)
            keep(map(found, read))

    def free(self, request_id: str) -> None:
        """Return every block the request holds, in every group."""
        for manager in self.managers:
            manager.free(request_id)
        self._copies.pop(request_id, None)
        self._may_share.discard(request_id)
        self._next_change.pop(request_id, None)
        if self.state_slots is not None:
            self.state_slots.release(request_id)
        self._freed.append(request_id)

    def take_table_updates(self) -> TableUpdates:
        """What changed in the block tables since the last call: the freed requests, then per group and request
        the entries from the first changed position on (the model runner's persistent batch applies them:
        hybridkv/execution/input_batch.py). Called once a step's allocations are made."""
        updates = TableUpdates(freed=self._freed, slots=self._slot_updates)
        self._freed, self._slot_updates = [], []
        for manager in self.managers:
            updates.entries += manager.take_changes()
        return updates

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Undo an allocation whose step will not run (a request preempted after it was scheduled): the
        request keeps only the blocks its first num_tokens tokens left it, as after its last step."""
        for manager in self.managers:
            manager.truncate(request_id, num_tokens)

    def num_blocks_for(self, num_tokens: int) -> int:
        """See blocks_for_request."""
        return blocks_for_request(self.config, num_tokens)

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table in each group (the null block's id where it holds none)."""
        return [m.block_table(request_id) for m in self.managers]

    def block_tables(self, request_ids: list[str]) -> list[list[list[int]]]:
        """Per group, the block-table row of each request, which must hold blocks (the managers' live
        lists: read, never change)."""
        return [m.block_table_rows(request_ids) for m in self.managers]

    def stats(self) -> KVCacheStats:
        per_group = [m.num_blocks_in_use() for m in self.managers]
        return KVCacheStats(
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            blocks_in_use=self.pool.num_used_blocks,
            blocks_in_use_per_group=per_group,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_evictions=self.pool.num_evictions,
            group_size=self.config.group_size,
            padding_layers=self.config.padding_layers,
            group_block_sizes=[group.block_size for group in self.config.groups],
            padding_fraction=self.config.padding_fraction,
            **self._tier_stats(),
        )

    def _tier_stats(self) -> dict[str, dict]:
        """`KVCacheStats`' tier fields: hit tokens by tier and, with tiers, each one's counters."""
        below = self.host_hit_tokens + self.disk_hit_tokens
        by_tier = {"device": self.prefix_cache_hits - below}
        tiers: dict[str, dict[str, int]] = {}
        if self.tiers is not None and self.tiers.host_keeps:
            by_tier["host"] = self.host_hit_tokens
            host = self.tiers.host.as_dict()
            tiers["host"] = {**host, "hit_tokens": self.host_hit_tokens, "blocks": self.tiers.num_host_blocks}
        if self.tiers is not None and self.tiers.disk is not None:
            by_tier["disk"] = self.disk_hit_tokens
            tiers["disk"] = {
                "hit_tokens": self.disk_hit_tokens,
                "restored": self.tiers.disk_counters.restored,
                **self.tiers.disk.counters(),
            }
        state_tiers = self.state_checkpoints.tiers if self.state_checkpoints is not None else None
        if state_tiers is not None:
            if state_tiers.host_keeps:
                host = state_tiers.host
                tiers["host"].update(checkpoints_stored=host.stored, checkpoints_restored=host.restored)
            if state_tiers.disk is not None:
                tiers["disk"].update(checkpoints_restored=state_tiers.disk_counters.restored)
        return {"hit_tokens_by_tier": by_tier, "tiers": tiers}

    def check_writable(self, request_id: str, num_computed: int, num_new_tokens: int) -> None:
        """Assert that every block the request's next num_new_tokens tokens are stored into is held by the
        request alone (the copy-on-write rule); a windowed group's null positions are read in flight only."""
        for manager in self.managers:
            blocks = manager.blocks_of(request_id)
            bs = manager.block_size
            for index in range(num_computed // bs, cdiv(num_computed + num_new_tokens, bs)):
                block = blocks[index]
                if block.is_null:
                    assert isinstance(manager, WindowedManager), (
                        f"{request_id} writes position {index} of full-attention group {manager.group_id}: null"
                    )
                    continue
                assert block.ref_cnt == 1, (
                    f"{request_id} writes {block} at position {index} of group {manager.group_id} while it is shared"
                )


def _runs(indices: list[int]) -> list[list[int]]:
    """Ascending indices split into runs of consecutive ones."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs
