"""Single-type managers: one per KV cache group, each applying its attention kind's rules.

All managers share one interface: find the longest cache hit under the kind's rule, count and
allocate the blocks a step needs, cache blocks that became full, return blocks that can no longer
be attended to, and free a request. Block lists are append-only and indexed by block position
(block i covers tokens [i * block_size, (i + 1) * block_size)); the null block stands in for
positions a sliding window no longer sees.

Block hashes come per `block_size / hash_stride` tokens (the engine's block size); a group whose blocks
hold `hash_stride` times as many tokens names its block i by hash `(i + 1) * hash_stride - 1`, the
chained hash of everything up to the block's end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from hybridkv.block_pool import BlockPool, KVBlock
from hybridkv.utils import NULL_BLOCK_ID, cdiv


def num_window_blocks(sliding_window: int, block_size: int) -> int:
    """Blocks that hold the W - 1 keys before a block-aligned position: ceil((W - 1) / block_size)."""
    return cdiv(sliding_window - 1, block_size)


class SingleTypeManager(ABC):
    """Block lists of every request in one KV cache group."""

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

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_num_blocks: int) -> list[KVBlock]:
        """The longest hit of at most max_num_blocks of this group's blocks, as the block list it would
        start with; `block_hashes` are the request's (see the module docstring).

        The returned list may contain the null block (positions the kind never reads again).
        """

    def block_hash(self, block_hashes: Sequence[bytes], index: int) -> bytes:
        """This group's hash of its block `index`."""
        return block_hashes[(index + 1) * self.hash_stride - 1]

    def num_hashed_blocks(self, block_hashes: Sequence[bytes]) -> int:
        return len(block_hashes) // self.hash_stride

    @abstractmethod
    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block a query at position num_computed_tokens can attend to."""

    def blocks_of(self, request_id: str) -> list[KVBlock]:
        return self.req_to_blocks.get(request_id, [])

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

    def allocate_new_blocks(self, request_id: str, num_computed_tokens: int, num_total_tokens: int) -> list[KVBlock]:
        """Extend the request's list to cover num_total_tokens; returns the new real blocks."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        block_ids = self.req_to_block_ids.setdefault(request_id, [])
        self.num_cached_blocks.setdefault(request_id, 0)
        num_required = cdiv(num_total_tokens, self.block_size)
        if num_required <= len(blocks):
            return []
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
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def num_real_blocks(self, request_id: str) -> int:
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if not b.is_null)


class FullAttentionManager(SingleTypeManager):
    """Every query attends to every earlier token: a hit is the longest run of cached blocks from 0."""

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_num_blocks: int) -> list[KVBlock]:
        cached = self.pool.cached[self.group_id]
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


class SlidingWindowManager(SingleTypeManager):
    """A query at position i attends to keys in (i - W, i].

    A hit ending at (block-aligned) position p needs only the blocks covering tokens
    [p - W + 1, p): ceil((W - 1) / block_size) blocks, all earlier positions become null blocks.
    """

    hits_are_prefix_closed = False

    def __init__(
        self, group_id: int, pool: BlockPool, block_size: int, sliding_window: int, hash_stride: int = 1
    ) -> None:
        super().__init__(group_id, pool, block_size, hash_stride)
        self.sliding_window = sliding_window
        self.num_window_blocks = num_window_blocks(sliding_window, block_size)

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_num_blocks: int) -> list[KVBlock]:
        cached = self.pool.cached[self.group_id]
        need = self.num_window_blocks
        stride = self.hash_stride
        max_num_blocks = min(max_num_blocks, len(block_hashes) // stride)
        if need == 0:
            return [self.pool.null_block] * max_num_blocks
        run: list[KVBlock] = []
        for i in range(max_num_blocks - 1, -1, -1):
            block = cached.get(block_hashes[(i + 1) * stride - 1])
            if block is None:
                run.clear()
                continue
            run.append(block)
            if len(run) == need:
                run.reverse()
                return [self.pool.null_block] * i + run
        # The run reaches block 0: every position before the end is covered.
        run.reverse()
        return run

    def first_needed_block(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        _return_blocks_before(self, request_id, self.first_needed_block(num_computed_tokens))


class ChunkedLocalManager(SingleTypeManager):
    """Chunked local attention (Llama 4): a query at position i sees [C * (i // C), i], its own chunk.

    A hit ending at (block-aligned) position p needs only the blocks from its chunk's start, C * (p // C),
    to p; earlier positions become null blocks, and at a chunk boundary no block at all is needed. A
    shorter hit may start in an earlier chunk, whose blocks a longer hit did not need: hits are not
    prefix-closed.
    """

    hits_are_prefix_closed = False

    def __init__(
        self, group_id: int, pool: BlockPool, block_size: int, attention_chunk_size: int, hash_stride: int = 1
    ) -> None:
        super().__init__(group_id, pool, block_size, hash_stride)
        self.attention_chunk_size = attention_chunk_size
        # Real blocks one request holds at most, besides those of the tokens being computed: the
        # C - 1 keys before a query, wherever in a block its chunk starts.
        self.num_window_blocks = num_window_blocks(attention_chunk_size, block_size)

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_num_blocks: int) -> list[KVBlock]:
        cached = self.pool.cached[self.group_id]
        stride = self.hash_stride
        max_num_blocks = min(max_num_blocks, len(block_hashes) // stride)
        blocks = [cached.get(h) for h in block_hashes[stride - 1 : max_num_blocks * stride : stride]]
        # last_miss[end]: the last block index below `end` that is not cached (-1: none).
        last_miss = [-1] * (max_num_blocks + 1)
        for index, block in enumerate(blocks):
            last_miss[index + 1] = index if block is None else last_miss[index]
        for end in range(max_num_blocks, 0, -1):
            first = self.first_needed_block(end * self.block_size)
            if last_miss[end] < first:
                return [self.pool.null_block] * first + blocks[first:end]
        return []

    def first_needed_block(self, num_computed_tokens: int) -> int:
        chunk_size = self.attention_chunk_size
        return num_computed_tokens // chunk_size * chunk_size // self.block_size

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        _return_blocks_before(self, request_id, self.first_needed_block(num_computed_tokens))


def _return_blocks_before(manager: SingleTypeManager, request_id: str, first_needed: int) -> None:
    """Put the null block in place of the request's real blocks before `first_needed` and return them
    to the pool, walking back from there until a null block (everything before it went earlier)."""
    blocks = manager.req_to_blocks.get(request_id)
    if not blocks:
        return
    block_ids = manager.req_to_block_ids[request_id]
    null_block = manager.pool.null_block
    skipped = []
    for i in range(min(first_needed, len(blocks)) - 1, -1, -1):
        block = blocks[i]
        if block is null_block:
            break
        skipped.append(block)
        blocks[i] = null_block
        block_ids[i] = NULL_BLOCK_ID
    if skipped:
        manager.pool.free_blocks(skipped)
