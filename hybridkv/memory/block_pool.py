"""The block pool: every physical KV block id, ref counts, the free queue and the prefix-cache map.

The pool knows nothing of layer kinds, requests or tensors. A block id names one page in every KV
tensor; which KV cache group a block currently serves is decided by whoever allocated it.

Free queue layout (an intrusive doubly linked list through the blocks themselves, in three runs)::

    head -> [unhashed ...] [hashed, of little worth ...] [hashed, least recently used first ...] <- tail
            ^ allocation pops here                                 freed hashed blocks join here ^

Allocation pops the head, so blocks that hold nothing reusable go first, then blocks a sliding window left behind
(window-aware eviction: a hit reads a window's blocks only where it ends), and then the least recently used cached
block.

The block arithmetic every layer shares lives here too (`NULL_BLOCK_ID`, `cdiv`). hybridkv/kernels/ imports nothing
of hybridkv/ (hybridkv/kernels/__init__.py says why), so hybridkv/kernels/cache.py states the null block id again and
tests/test_kernels_backend.py pins the two equal.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hybridkv.memory.kv_events import KVEventRecorder

# Never allocated, never freed: stands in a block table for blocks a query cannot see.
NULL_BLOCK_ID = 0


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division of integers: ``cdiv(40, 16) == 3`` blocks of 16 hold 40 tokens."""
    return -(-numerator // denominator)


class KVBlock:
    """One physical block. `ref_cnt` counts the (request, group) block lists that hold it."""

    __slots__ = ("block_hash", "block_id", "free_run", "hash_group", "next_free", "prev_free", "ref_cnt", "was_hit")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.hash_group = -1
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None
        self.free_run = 0  # which run of the free queue it is in, while free (`FreeBlockQueue`)
        self.was_hit = False  # taken as a prefix-cache hit since it was last filled: never of little worth

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={digest})"


def make_blocks(num_blocks: int) -> list[KVBlock]:
    """Blocks 0..num_blocks-1, made with Python's cycle collector paused (and left as it was after): a small model's
    pool holds hundreds of thousands of blocks, and the collector, running at every few hundred new objects over the
    growing list, took most of their making (`python benchmarks/allocator.py --pool N`)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return [KVBlock(i) for i in range(num_blocks)]
    finally:
        if enabled:
            gc.enable()


class BlockLookup(Protocol):
    """Where a group's cached blocks are looked up by hash: the pool's map (`BlockPool.cached[g]`), or a view
    that also finds blocks kept below the pool (hybridkv/memory/coordinator.py, `TieredLookup`)."""

    def get(self, block_hash: bytes, /) -> KVBlock | None: ...


class FreeBlockQueue:
    """Doubly linked queue of free blocks, linked through `prev_free`/`next_free`, in three runs that a sentinel
    block ends each of::

        head -> [unhashed] -> LOW -> [hashed, of little worth, oldest first] -> HIGH -> [hashed, LRU] <- tail

    Every operation is O(1) per block and creates no objects: removing a block from the middle (a prefix-cache hit
    on a free block) only relinks its neighbours. Popping passes the sentinels over, which stay in the queue.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._low = KVBlock(-1)  # ends the unhashed run
        self._high = KVBlock(-1)  # ends the run of little worth
        chain = (self._head, self._low, self._high, self._tail)
        self._run_starts = chain[:3]  # the sentinel before each run, in queue order
        for first, second in itertools.pairwise(chain):
            first.next_free, second.prev_free = second, first
        self.num_free_blocks = 0
        # Blocks in each run: unhashed, of little worth, the rest (`num_spare_blocks` is the first two).
        self.run_sizes = [0, 0, 0]
        for block in blocks:  # unhashed: the first run
            self._link_before(self._low, block)
            self.num_free_blocks += 1
            self.run_sizes[0] += 1

    def popleft(self) -> KVBlock:
        """Remove and return the first block; IndexError when empty."""
        if not self.num_free_blocks:
            raise IndexError("pop from an empty free block queue")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Remove and return the first n blocks in queue order; the caller checked n <= free. Run by run, each
        popped in one tight loop after its sentinel (the run sizes say how many each gives)."""
        if n > self.num_free_blocks:
            raise IndexError(f"asked for {n} blocks but only {self.num_free_blocks} are free")
        out: list[KVBlock] = []
        run_sizes = self.run_sizes
        remaining = n
        for run, start in enumerate(self._run_starts):
            count = run_sizes[run]
            if not count:
                continue
            if count > remaining:
                count = remaining
            block = start.next_free
            for _ in range(count):
                out.append(block)
                next_block = block.next_free
                block.prev_free = block.next_free = None
                block = next_block
            start.next_free = block
            block.prev_free = start
            run_sizes[run] -= count
            remaining -= count
            if not remaining:
                break
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        if block.prev_free is None:
            raise ValueError(f"{block} is not in the free queue")
        self.take((block,))

    def take(self, blocks: Sequence[KVBlock]) -> None:
        """Unlink blocks from anywhere in the queue, each of which is in it (prefix-cache hits on free blocks), in
        one pass: each relinks its neighbours."""
        run_sizes = self.run_sizes
        for block in blocks:
            before, after = block.prev_free, block.next_free
            before.next_free = after
            after.prev_free = before
            block.prev_free = block.next_free = None
            run_sizes[block.free_run] -= 1
        self.num_free_blocks -= len(blocks)

    def append(self, block: KVBlock) -> None:
        """Put a block at the tail: evicted last."""
        self._link_before(self._tail, block)
        block.free_run = 2
        self.run_sizes[2] += 1
        self.num_free_blocks += 1

    def keep(self, blocks: Iterable[KVBlock | None]) -> None:
        """Move the free blocks of little worth among `blocks` to the tail, in order (now the most recently used of
        the cached ones); the others stay where they are, and a None (a hash no block is cached under) is passed
        over."""
        for block in blocks:
            if block is not None and block.prev_free is not None and block.free_run == 1:
                self._unlink(block)
                self.append(block)

    @property
    def num_spare_blocks(self) -> int:
        """Free blocks whose reuse loses nothing a hit is likely to read: the unhashed and those of little worth."""
        return self.run_sizes[0] + self.run_sizes[1]

    def release(self, blocks: list[KVBlock], low: bool = False) -> None:
        """Link blocks that just reached ref count 0, in order: unhashed ones at the head (reused first), hashed ones
        at the tail (kept for hits, least recently used first) or, `low`, at the end of the run of little worth
        (blocks a sliding window left behind: reused after the unhashed ones, before any other hashed one), unless
        a request took the block as a hit since it was filled."""
        head, tail = self._head, self._tail
        end, run = (self._high, 1) if low else (tail, 2)
        num_unhashed = num_kept = 0  # the run sizes are added to once, after the loop
        for block in blocks:
            if block.block_hash is None:
                first = head.next_free
                first.prev_free = block
                block.next_free = first
                block.prev_free = head
                head.next_free = block
                block.free_run = 0
                num_unhashed += 1
            else:
                block_end, block_run = end, run
                if low and block.was_hit:  # a block some request took as a hit is worth keeping wherever a window
                    block_end, block_run = tail, 2  # left it (a shared prefix's end)
                    num_kept += 1
                last = block_end.prev_free
                last.next_free = block
                block.prev_free = last
                block.next_free = block_end
                block_end.prev_free = block
                block.free_run = block_run
        run_sizes = self.run_sizes
        run_sizes[0] += num_unhashed
        run_sizes[2] += num_kept
        run_sizes[run] += len(blocks) - num_unhashed - num_kept
        self.num_free_blocks += len(blocks)

    def _link_before(self, end: KVBlock, block: KVBlock) -> None:
        last = end.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = end
        end.prev_free = block

    def _unlink(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
        self.run_sizes[block.free_run] -= 1

    def close(self) -> None:
        """Drop every link, the sentinels' included."""
        for sentinel in (self._head, self._low, self._high, self._tail):
            sentinel.next_free = sentinel.prev_free = None
        self.num_free_blocks = 0
        self.run_sizes = [0, 0, 0]

    def __iter__(self) -> Iterator[KVBlock]:
        sentinels = (self._low, self._high)
        block = self._head.next_free
        while block is not self._tail:
            if block not in sentinels:
                yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """Owns blocks 0..num_blocks-1. Block 0 is the null block: never allocated, never freed.

    `cached[g]` maps a block hash to the block that holds those tokens for KV cache group g (the
    map from (block hash, group id) to block). A block carries at most one hash; it loses it when
    it is popped for reuse (an eviction).
    """

    def __init__(self, num_blocks: int, num_groups: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = make_blocks(num_blocks)
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: list[dict[bytes, KVBlock]] = [{} for _ in range(num_groups)]
        self.num_evictions = 0
        # Tiers beyond the pool (hybridkv/memory/tiers.py): told of each block about to lose its hash to a reuse
        # (its page still holds the tokens) and of each block registered under a hash (its page computed).
        self.on_evict: Callable[[KVBlock], None] | None = None
        # Per group, the hashes of the blocks evicted last (here or from a tier below), oldest first: a miss on one
        # of them is "evicted" (`KVCacheCoordinator.explain_miss`), else "never cached".
        self.evicted_keys: list[dict[bytes, None]] = [{} for _ in range(num_groups)]
        self.max_evicted_keys = min(4 * num_blocks, 1 << 17)
        self._evictions_since_cut = 0
        self.on_cache: Callable[[KVBlock], None] | None = None
        # vLLM's KV events (hybridkv/memory/kv_events.py), told of each cached block that loses its hash.
        self.events: KVEventRecorder | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - self.free_queue.num_free_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop n blocks from the head (ref count 1 each); evicts the hashes they carried."""
        blocks = self.free_queue.popleft_n(n)
        cached, on_evict, remembered, events = self.cached, self.on_evict, self.evicted_keys, self.events
        evictions = self.num_evictions
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                if on_evict is not None:
                    on_evict(block)
                group = block.hash_group
                if events is not None:
                    events.removed(group, block_hash)
                group_map = cached[group]
                if group_map.get(block_hash) is block:
                    del group_map[block_hash]
                remembered[group][block_hash] = None
                block.block_hash = None
                block.hash_group = -1
                block.was_hit = False
                evictions += 1
            block.ref_cnt = 1
        if evictions != self.num_evictions:
            self._forget_old_evictions(evictions - self.num_evictions)
            self.num_evictions = evictions
        return blocks

    def record_evicted(self, group_id: int, block_hash: bytes) -> None:
        """Remember that the block of `block_hash` in group `group_id` was evicted from a tier below the pool."""
        self.evicted_keys[group_id][block_hash] = None
        self._forget_old_evictions(1)

    def _forget_old_evictions(self, count: int) -> None:
        """`evicted_keys` keeps about the last `max_evicted_keys` evictions per group: each group's map is cut to its
        newest half of that once `count`s added since the last cut reach it (one cut per so many evictions)."""
        self._evictions_since_cut += count
        if self._evictions_since_cut < self.max_evicted_keys:
            return
        self._evictions_since_cut = 0
        keep = self.max_evicted_keys
        self.evicted_keys = [
            dict.fromkeys(list(keys)[-keep:]) if len(keys) > keep else keys for keys in self.evicted_keys
        ]

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit); free ones leave the queue."""
        free = []
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID:
                continue
            if not block.ref_cnt:
                free.append(block)
            block.ref_cnt += 1
            block.was_hit = True
        if free:
            self.free_queue.take(free)

    def cache_blocks(self, blocks: Iterable[KVBlock], block_hashes: Iterable[bytes], group_id: int) -> None:
        """Register full blocks under their hashes (pairwise). Null blocks, blocks that already
        carry a hash and hashes the map already holds (another block has those tokens) are skipped."""
        if not self.enable_caching:
            return
        group_map = self.cached[group_id]
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_id == NULL_BLOCK_ID or block.block_hash is not None:
                continue
            if group_map.setdefault(block_hash, block) is block:
                block.block_hash = block_hash
                block.hash_group = group_id
                if self.on_cache is not None:
                    self.on_cache(block)

    def cache_block_per_group(self, blocks: Sequence[KVBlock], block_hash: bytes) -> None:
        """`cache_blocks` of one block in each group: `blocks[g]` is group g's, all under `block_hash`."""
        if not self.enable_caching:
            return
        for group_id, (block, group_map) in enumerate(zip(blocks, self.cached, strict=True)):
            if block.block_id == NULL_BLOCK_ID or block.block_hash is not None:
                continue
            if group_map.setdefault(block_hash, block) is block:
                block.block_hash = block_hash
                block.hash_group = group_id
                if self.on_cache is not None:
                    self.on_cache(block)

    def cache_restored(self, block: KVBlock, block_hash: bytes, group_id: int) -> None:
        """Register a fresh block that a tier below the pool copies a cached block back into (its page is written
        before the step's forward): a hit from now on. The tiers are not told: they hold it already."""
        assert block.block_hash is None and block_hash not in self.cached[group_id], block
        self.cached[group_id][block_hash] = block
        block.block_hash = block_hash
        block.hash_group = group_id

    def drop_hash(self, block: KVBlock) -> None:
        """Forget what a held block caches (its keys are about to be overwritten): an eviction."""
        if block.block_hash is None:
            return
        group_map = self.cached[block.hash_group]
        if group_map.get(block.block_hash) is block:
            del group_map[block.block_hash]
        self.evicted_keys[block.hash_group][block.block_hash] = None
        self._forget_old_evictions(1)
        if self.events is not None:
            self.events.removed(block.hash_group, block.block_hash)
        block.block_hash = None
        block.hash_group = -1
        self.num_evictions += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock], low: bool = False) -> None:
        """Drop one reference each, in the given order (callers pass a request's blocks tail-first).

        A block reaching ref count 0 joins the tail if it carries a hash (still a cache hit until
        evicted) and the head if not (nothing to keep, so it is reused before any cached block); with `low`, a
        hashed one joins the run of little worth, reused before any other hashed block (`FreeBlockQueue`).
        """
        released = []
        for block in ordered_blocks:
            if block.block_id == NULL_BLOCK_ID:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        self.free_queue.release(released, low)

    def forget_cached(self) -> None:
        """Drop every cached block's hash (vLLM's `reset_prefix_cache`), for a pool none of whose blocks is held
        (`LLMEngine.sleep`: the pages' contents are about to go): nothing is a hit until computed again."""
        assert self.num_used_blocks == 0, "blocks are held: their requests must end first"
        for block in self.blocks:
            block.block_hash = None
            block.hash_group = -1
        self.cached = [{} for _ in self.cached]

    def close(self) -> None:
        """Unlink every block so the pool is freed by reference counting when dropped; unusable after."""
        for block in self.blocks:
            block.prev_free = block.next_free = None
        self.free_queue.close()
        self.blocks = []
        self.cached = []
        self.on_evict = self.on_cache = self.events = None  # the coordinator's: a cycle through it otherwise

    def check_integrity(self) -> None:
        """Assert the pool's own accounting: every block is exactly one of null / free / used."""
        null = self.null_block
        assert null.ref_cnt == 0 and null.prev_free is None and null.block_hash is None, null
        in_queue = set()
        for block in self.free_queue:
            assert block.block_id not in in_queue, f"{block} twice in the free queue"
            assert block.ref_cnt == 0, f"{block} is in the free queue with references"
            assert not block.is_null, "the null block is in the free queue"
            in_queue.add(block.block_id)
        assert len(in_queue) == self.free_queue.num_free_blocks
        runs = [0, 0, 0]
        for block in self.free_queue:
            runs[block.free_run] += 1
        assert runs == self.free_queue.run_sizes, f"free runs {runs} counted as {self.free_queue.run_sizes}"
        for block in self.blocks[1:]:
            if block.block_id not in in_queue:
                assert block.ref_cnt > 0, f"{block} is neither free nor used"
        assert self.num_free_blocks + self.num_used_blocks + 1 == self.num_blocks
        for group_id, group_map in enumerate(self.cached):
            for block_hash, block in group_map.items():
                assert block.block_hash == block_hash and block.hash_group == group_id, block
        for block in self.blocks:
            if block.block_hash is not None:
                assert self.cached[block.hash_group].get(block.block_hash) is block, block
