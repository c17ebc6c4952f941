"""Single-type managers: one per KV cache group, each applying its attention kind's rules.

All managers share one interface: find the longest cache hit under the kind's rule, count and
allocate the blocks a step needs, cache blocks that became full, return blocks that can no longer
be attended to, and free a request. Block lists are append-only and indexed by block position
(block i covers tokens [i * block_size, (i + 1) * block_size)); the null block stands in for
positions a sliding window no longer sees. The windowed kinds are in
hybridkv/memory/window_managers.py.

Block hashes come per `block_size / hash_stride` tokens (the engine's block size); a group whose blocks
hold `hash_stride` times as many tokens names its block i by hash `(i + 1) * hash_stride - 1`, the
chained hash of everything up to the block's end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import KeysView, Sequence
from itertools import repeat
from typing import TYPE_CHECKING

from hybridkv.memory.block_pool import NULL_BLOCK_ID, BlockLookup, BlockPool, KVBlock, cdiv

if TYPE_CHECKING:
    from hybridkv.memory.grouping import KVCacheGroupSpec


def num_window_blocks(sliding_window: int, block_size: int) -> int:
    """Blocks that hold the W - 1 keys before a block-aligned position: ceil((W - 1) / block_size)."""
    return cdiv(sliding_window - 1, block_size)


class SingleTypeManager(ABC):
    """Block lists of every request in one KV cache group."""

    # What the group's layers attend to, in words (`KVCacheCoordinator.explain_miss`).
    kind = "attention"

    #: True when a cache hit of n blocks implies hits of every shorter length (full attention).
    hits_are_prefix_closed: bool = True

    def __init__(self, group_id: int, pool: BlockPool, block_size: int, hash_stride: int = 1) -> None:
        self.group_id = group_id
        self.pool = pool
        self.block_size = block_size
        self.hash_stride = hash_stride
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # The same lists as block ids, kept in step with req_to_blocks: the rows of the step's block
        # tables, read by the model runner without touching a block object.
        self.req_to_block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # Per request, the first position of req_to_block_ids changed since the coordinator last reported
        # changes (its `take_table_updates`): what the model runner's persistent block tables must copy.
        self.changed_from: dict[str, int] = {}

    @classmethod
    def for_group(cls, group: KVCacheGroupSpec, pool: BlockPool, hash_stride: int) -> SingleTypeManager:
        """The manager of `group`'s blocks (the coordinator picks the class by the group's attention type)."""
        return cls(group.group_id, pool, group.block_size, hash_stride)

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_num_blocks: int, cached: BlockLookup | None = None
    ) -> list[KVBlock]:
        """The longest hit of at most max_num_blocks of this group's blocks, as the block list it would
        start with; `block_hashes` are the request's (see the module docstring).

        The returned list may contain the null block (positions the kind never reads again).
        """

    def block_hash(self, block_hashes: Sequence[bytes], index: int) -> bytes:
        """This group's hash of its block `index`."""
        return block_hashes[(index + 1) * self.hash_stride - 1]

    def block_hashes_between(self, block_hashes: Sequence[bytes], start: int, end: int) -> Sequence[bytes]:
        """This group's hashes of its blocks `start` to `end - 1` (`block_hash` of each, as one slice)."""
        stride = self.hash_stride
        return block_hashes[(start + 1) * stride - 1 : end * stride : stride]

    def num_hashed_blocks(self, block_hashes: Sequence[bytes]) -> int:
        return len(block_hashes) // self.hash_stride

    @abstractmethod
    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block a query at position num_computed_tokens can attend to."""

    def mark_changed(self, request_id: str, position: int) -> None:
        """Record that the request's block ids changed from `position` on (see `changed_from`)."""
        first = self.changed_from.get(request_id)
        if first is None or position < first:
            self.changed_from[request_id] = position

    def blocks_of(self, request_id: str) -> list[KVBlock]:
        """The request's blocks by position (the null block where it holds none); the live list: read it, never
        change it."""
        return self.req_to_blocks.get(request_id, [])

    def request_ids(self) -> KeysView[str]:
        """The requests that have a block list in this group (it may be empty)."""
        return self.req_to_blocks.keys()

    def num_positions(self, request_id: str) -> int | None:
        """The length of the request's block list, null entries included; None when it has no list."""
        blocks = self.req_to_blocks.get(request_id)
        return None if blocks is None else len(blocks)

    def covers(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's list already reaches num_tokens tokens: a step up to there takes no block here."""
        return num_tokens <= len(self.req_to_blocks.get(request_id, ())) * self.block_size

    def num_positions_each(self, request_ids: Sequence[str]) -> list[int]:
        """`num_positions` of each request at once, 0 for one with no list (its list reaches that many times
        `block_size` tokens: `covers` of a batch)."""
        return list(map(len, map(self.req_to_blocks.get, request_ids, repeat((), len(request_ids)))))

    def num_cached(self, request_id: str) -> int:
        """How many of the request's first blocks are registered under their hashes."""
        return self.num_cached_blocks.get(request_id, 0)

    def block_to_cache(self, request_id: str, index: int) -> KVBlock | None:
        """The request's block `index` when its first `index` blocks, and no more, are registered under their hashes
        (the next one to register); else None."""
        if self.num_cached_blocks.get(request_id, 0) != index:
            return None
        return self.req_to_blocks[request_id][index]

    def num_blocks_in_use(self) -> int:
        """Distinct real blocks this group's requests hold."""
        return len({b.block_id for blocks in self.req_to_blocks.values() for b in blocks if not b.is_null})

    def block_table_rows(self, request_ids: Sequence[str]) -> list[list[int]]:
        """The block-table row of each request, which must have a list (the live lists: read, never change)."""
        tables = self.req_to_block_ids
        return [tables[request_id] for request_id in request_ids]

    def take_changes(self) -> list[tuple[int, str, int, list[int]]]:
        """(group id, request id, first changed position, the request's ids from there on) of each request whose
        block ids changed since the last call (`changed_from`), which it forgets."""
        if not self.changed_from:  # most decode steps change no table
            return []
        changed, self.changed_from = self.changed_from, {}
        tables, group_id = self.req_to_block_ids, self.group_id
        return [(group_id, request_id, start, tables[request_id][start:]) for request_id, start in changed.items()]

    def check_tables(self) -> None:
        """Assert that the block-id lists agree with the block lists: the same requests and lengths, and at each
        position the block's id, but for a moved block's -id where the request holds the block further on."""
        assert self.req_to_block_ids.keys() == self.req_to_blocks.keys(), "block tables out of step"
        for request_id, blocks in self.req_to_blocks.items():
            table = self.req_to_block_ids[request_id]
            assert len(table) == len(blocks), f"{request_id}'s block table in group {self.group_id}"
            held = {block.block_id for block in blocks if not block.is_null}
            for position, (block_id, block) in enumerate(zip(table, blocks, strict=True)):
                moved = block_id < 0 and block.is_null and -block_id in held
                assert block_id == block.block_id or moved, (
                    f"{request_id}'s block table in group {self.group_id} disagrees with its blocks at {position}"
                )

    def append_block(self, request_id: str, block: KVBlock) -> None:
        """Give the request a fresh block at the position just past its list (the coordinator's decode fast path)."""
        blocks = self.req_to_blocks[request_id]
        self.mark_changed(request_id, len(blocks))
        blocks.append(block)
        self.req_to_block_ids[request_id].append(block.block_id)

    def set_num_cached_blocks(self, request_id: str, num_blocks: int) -> None:
        """Record that the request's first num_blocks blocks are registered under their hashes (the coordinator's
        fast path registers a block of every group in one pool call)."""
        self.num_cached_blocks[request_id] = num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids by position (the null block's id where it holds none); the live
        list, changed by later allocations: read it, never change it."""
        return self.req_to_block_ids.get(request_id, [])

    def num_blocks_to_allocate(
        self, request_id: str, num_computed_tokens: int, num_total_tokens: int, hit_blocks: Sequence[KVBlock]
    ) -> int:
        """Free blocks the pool must hand out to take hit_blocks and cover num_total_tokens.

        num_computed_tokens counts the hit's tokens. Positions before first_needed_block get the
        null block; a hit block with ref count 0 counts too, since taking it leaves the free queue.
        """
        num_held = len(self.req_to_blocks.get(request_id, ())) + len(hit_blocks)
        num_required = cdiv(num_total_tokens, self.block_size)
        start = max(num_held, self.first_needed_block(num_computed_tokens))
        num_new = max(0, num_required - start)
        return num_new + sum(1 for b in hit_blocks if b.ref_cnt == 0 and not b.is_null)

    def take_hit_blocks(self, request_id: str, hit_blocks: Sequence[KVBlock]) -> None:
        """Add a cache hit to a request that holds no blocks yet; hit blocks are already cached."""
        if self.req_to_blocks.get(request_id):
            raise ValueError(
                f"request {request_id!r} already holds blocks in group {self.group_id}; "
                "a cache hit applies only to a request's first allocation"
            )
        self.pool.touch(hit_blocks)
        self.req_to_blocks[request_id] = list(hit_blocks)
        self.req_to_block_ids[request_id] = [b.block_id for b in hit_blocks]
        self.num_cached_blocks[request_id] = len(hit_blocks)
        self.mark_changed(request_id, 0)

    def allocate_new_blocks(self, request_id: str, num_computed_tokens: int, num_total_tokens: int) -> list[KVBlock]:
        """Extend the request's list to cover num_total_tokens; returns the new real blocks."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        block_ids = self.req_to_block_ids.setdefault(request_id, [])
        self.num_cached_blocks.setdefault(request_id, 0)
        num_required = cdiv(num_total_tokens, self.block_size)
        if num_required <= len(blocks):
            return []
        self.mark_changed(request_id, len(blocks))
        num_null = max(0, self.first_needed_block(num_computed_tokens) - len(blocks))
        num_null = min(num_null, num_required - len(blocks))
        if num_null:
            blocks.extend([self.pool.null_block] * num_null)
            block_ids.extend([NULL_BLOCK_ID] * num_null)
        new_blocks = self.pool.get_new_blocks(num_required - len(blocks))
        blocks.extend(new_blocks)
        block_ids.extend([b.block_id for b in new_blocks])
        return new_blocks

    def restore(self, request_id: str, blocks: list[KVBlock]) -> None:
        """Give a request that holds nothing the given block list (swapped back in); the caller has
        counted the request's reference on each block."""
        self.req_to_blocks[request_id] = blocks
        self.req_to_block_ids[request_id] = [b.block_id for b in blocks]
        self.num_cached_blocks[request_id] = 0
        self.mark_changed(request_id, 0)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give a request that holds nothing the same block list as another, every block shared (one
        more reference each), the partial last block and the null entries included."""
        blocks = list(self.req_to_blocks.get(parent_id, ()))
        for block in blocks:
            if block.block_id != NULL_BLOCK_ID:
                block.ref_cnt += 1
        self.req_to_blocks[child_id] = blocks
        self.req_to_block_ids[child_id] = list(self.req_to_block_ids.get(parent_id, ()))
        self.num_cached_blocks[child_id] = self.num_cached_blocks.get(parent_id, 0)
        self.mark_changed(child_id, 0)

    def shared_write_block(self, request_id: str, num_computed_tokens: int) -> int | None:
        """The position of the block the request's next token is written into when another request
        also holds it (a fork's partial last block), else None."""
        blocks = self.req_to_blocks.get(request_id)
        index = num_computed_tokens // self.block_size
        if blocks is None or index >= len(blocks) or blocks[index].ref_cnt < 2:
            return None
        return index

    def replace_block(self, request_id: str, index: int, block: KVBlock) -> KVBlock:
        """Put `block` (whose reference the caller has taken for the request) at position `index` of the
        request's list; drops the request's reference on the block it replaces, which is returned."""
        blocks = self.req_to_blocks[request_id]
        old = blocks[index]
        blocks[index] = block
        self.req_to_block_ids[request_id][index] = block.block_id
        self.mark_changed(request_id, index)
        self.pool.free_blocks([old])
        return old

    def cache_blocks(self, request_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int) -> None:
        """Register the request's blocks that num_computed_tokens filled, from num_cached on, under
        their hashes."""
        stride = self.hash_stride
        num_full_blocks = min(num_computed_tokens // self.block_size, len(block_hashes) // stride)
        start = self.num_cached_blocks.get(request_id, 0)
        if num_full_blocks <= start:
            return
        blocks = self.req_to_blocks[request_id]
        if num_full_blocks == start + 1:  # one block (a decode step's): no slices
            self.pool.cache_blocks((blocks[start],), (block_hashes[num_full_blocks * stride - 1],), self.group_id)
        else:
            hashes = block_hashes[(start + 1) * stride - 1 : num_full_blocks * stride : stride]
            self.pool.cache_blocks(blocks[start:num_full_blocks], hashes, self.group_id)
        self.num_cached_blocks[request_id] = num_full_blocks

    @abstractmethod
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Return blocks no future query of the request can attend to (null blocks take their place)."""

    def free(self, request_id: str) -> None:
        """Drop the request's blocks, deepest first, so its least shareable blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.req_to_block_ids.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        self.changed_from.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Return the request's blocks past those of its first `num_tokens` tokens (a step that was
        allocated but will not run), deepest first."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        keep = cdiv(num_tokens, self.block_size)
        released = blocks[keep:]
        del blocks[keep:]
        del self.req_to_block_ids[request_id][keep:]
        self.num_cached_blocks[request_id] = min(self.num_cached_blocks.get(request_id, 0), keep)
        self.pool.free_blocks(reversed(released))

    def num_real_blocks(self, request_id: str) -> int:
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if not b.is_null)


class FullAttentionManager(SingleTypeManager):
    """Every query attends to every earlier token: a hit is the longest run of cached blocks from 0."""

    kind = "full attention"

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_num_blocks: int, cached: BlockLookup | None = None
    ) -> list[KVBlock]:
        cached = self.pool.cached[self.group_id] if cached is None else cached
        stride = self.hash_stride
        hit = []
        for block_hash in block_hashes[stride - 1 : max_num_blocks * stride : stride]:
            block = cached.get(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def first_needed_block(self, num_computed_tokens: int) -> int:
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        return
