"""Windowed managers (sliding window, chunked local attention): a request holds only what later queries read.

A step computes tokens [c0, c1) of a request. Each layer reads the keys before c0 from its pages and the
step's own keys in flight (kernels: `attend(..., key=, value=)`), then stores the rows. So a windowed
group must hold, per request, the blocks of the keys its first query sees before c0 (the old window,
read this step) and, after the step, the blocks of the keys the next query, at c1, sees (the tail);
the step's other tokens are read in flight only, and their positions keep the null block::

    block positions:  null ... | old window: read | middle of the chunk  | tail: stored   |
                               f0                 L0   (in flight only)   f1               e1
    f0 = first_needed_block(c0), L0 = blocks held before the step, f1 = first_needed_block(c1),
    e1 = ceil(c1 / block_size); the old window and the tail may overlap (a short chunk, a decode).

A new tail position takes a block of the old window that the tail no longer needs and that only this
request holds: the block moves (the table shows -b at its old position, read there, and b at the new
one, stored into after each layer attended; its cached hash goes, since its keys will be overwritten).
So a request holds at most `num_window_blocks + 1` blocks of a windowed group, whatever the chunk size.

Moving costs the cache what the moved block held. With free blocks to spare the tail takes fresh blocks
instead (`spare`), and the old window goes back to the pool hashed after the step; once scheduling is
done, the middle's positions that no block caches yet take free blocks too (`fill_middle`), so they are
stored and hashed, and go back to the pool at once. Neither costs concurrency: an allocation that lacks
blocks first takes the spare fresh blocks of other requests' pending steps back (`reclaim`: their tails
move after all), and the middle is filled only after every allocation of the step.

The kinds then add their own rules (which blocks a query reads, which cached runs make a hit): sliding windows
(`SlidingWindowManager`: a query at i sees keys in (i - W, i]) and chunked local attention
(`ChunkedLocalManager`, Llama 4: a query at i sees [C * (i // C), i]).
"""

from __future__ import annotations

from collections.abc import Collection, KeysView, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridkv.memory.block_pool import NULL_BLOCK_ID, BlockLookup, BlockPool, KVBlock, cdiv
from hybridkv.memory.managers import SingleTypeManager, num_window_blocks

if TYPE_CHECKING:
    from hybridkv.memory.grouping import KVCacheGroupSpec


@dataclass(slots=True)
class WindowStep:
    """A request's allocated, not yet computed step: its end, its first new position, the request's
    block hashes (the live list), the fresh tail blocks given where an old-window block could have moved
    (tail position `spare_new[k]` took a fresh block, old-window position `spare_old[k]` kept its own) and
    the middle positions given blocks for caching."""

    end: int
    first_new: int
    block_hashes: Sequence[bytes]
    spare_old: list[int] = field(default_factory=list)
    spare_new: list[int] = field(default_factory=list)
    middle: list[int] = field(default_factory=list)


class WindowedManager(SingleTypeManager):
    """A group whose queries see only the keys from `first_needed_block` on (see the module docstring)."""

    hits_are_prefix_closed = False

    def __init__(self, group_id: int, pool: BlockPool, block_size: int, reach: int, hash_stride: int = 1) -> None:
        super().__init__(group_id, pool, block_size, hash_stride)
        # Real blocks a request needs at most, besides its query's own block: the reach - 1 keys before
        # a query, wherever in a block they start.
        self.num_window_blocks = num_window_blocks(reach, block_size)
        self.steps: dict[str, WindowStep] = {}
        # Per request, the first position that may hold a real block (every earlier one is null); a list
        # that arrives some other way (a copy of another request's) is scanned once (`_window_start`).
        self.window_start: dict[str, int] = {}

    def has_pending_step(self, request_id: str) -> bool:
        """Whether the request's allocated step left something for its update to return (a middle, spare fresh
        tail blocks, old-window blocks kept past the step's end)."""
        return request_id in self.steps

    def pending_requests(self) -> KeysView[str]:
        """The requests with a pending step (`has_pending_step`)."""
        return self.steps.keys()

    def pending_step_end(self, request_id: str) -> int | None:
        """The tokens the request's pending step computes up to; None without one."""
        step = self.steps.get(request_id)
        return None if step is None else step.end

    def keeps_window(self, request_id: str, num_total_tokens: int) -> bool:
        """Whether a step up to num_total_tokens leaves none of the request's blocks behind its window (nothing to
        move or keep: its new tail takes fresh blocks); False when the request's first real position is not known."""
        start = self.window_start.get(request_id)
        return start is not None and start >= self.first_needed_block(num_total_tokens)

    @property
    def max_blocks_per_request(self) -> int:
        """The most blocks a request holds between steps, and during one but for moves the pool paid
        nothing for (`spare`, `middle`) and old-window blocks other requests hold too."""
        return self.num_window_blocks + 1

    def blocks_needed(
        self, request_id: str, num_computed_tokens: int, num_total_tokens: int, hit_blocks: Sequence[KVBlock]
    ) -> tuple[int, int]:
        """(fewest, most) free blocks the pool hands out to take `hit_blocks` and compute up to
        `num_total_tokens`: fewest when every movable old-window block moves to the tail, most when the
        tail takes only fresh blocks. A free hit block counts: taking it leaves the free queue."""
        blocks = self.req_to_blocks.get(request_id) or hit_blocks
        num_new_tail = self._num_new_tail(len(blocks), num_total_tokens)
        num_hit = _num_free(hit_blocks) if hit_blocks else 0
        if num_new_tail == 0:
            return num_hit, num_hit
        # Positions before the first query's window hold null blocks (a hit's too): start there.
        old_window = blocks[self.first_needed_block(num_computed_tokens) : self.first_needed_block(num_total_tokens)]
        # Blocks only this request will hold: free ones of a hit not taken yet, else its own (the null
        # block's ref count stays 0).
        num_movable = _num_free(old_window) if hit_blocks else [b.ref_cnt for b in old_window].count(1)
        return num_hit + max(0, num_new_tail - num_movable), num_hit + num_new_tail

    def most_blocks_needed(self, request_id: str, num_total_tokens: int, hit_blocks: Sequence[KVBlock]) -> int:
        """`blocks_needed`'s most without looking at the old window: the free hit blocks and a fresh block at
        every new tail position."""
        blocks = self.req_to_blocks.get(request_id) or hit_blocks
        num_hit = _num_free(hit_blocks) if hit_blocks else 0
        return num_hit + self._num_new_tail(len(blocks), num_total_tokens)

    def num_blocks_to_allocate(
        self, request_id: str, num_computed_tokens: int, num_total_tokens: int, hit_blocks: Sequence[KVBlock]
    ) -> int:
        return self.blocks_needed(request_id, num_computed_tokens, num_total_tokens, hit_blocks)[0]

    def take_hit_blocks(self, request_id: str, hit_blocks: Sequence[KVBlock]) -> None:
        super().take_hit_blocks(request_id, hit_blocks)
        self.window_start[request_id] = _first_real(hit_blocks) if hit_blocks else 0

    def allocate_new_blocks(self, request_id: str, num_computed_tokens: int, num_total_tokens: int) -> list[KVBlock]:
        return self.allocate_step(request_id, num_total_tokens, [], 0)

    def allocate_step(
        self, request_id: str, num_total_tokens: int, block_hashes: Sequence[bytes], num_spare: int
    ) -> list[KVBlock]:
        """Extend the request's list to `num_total_tokens`: the middle null, the tail from moved blocks
        and fresh ones, `num_spare` more fresh ones than the fewest; returns the fresh blocks."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        block_ids = self.req_to_block_ids.setdefault(request_id, [])
        self.num_cached_blocks.setdefault(request_id, 0)
        start = self._window_start(request_id)
        end = cdiv(num_total_tokens, self.block_size)
        first_new = len(blocks)
        if end <= first_new:
            return []
        self.mark_changed(request_id, first_new)
        first_kept = self.first_needed_block(num_total_tokens)
        tail_start = min(max(first_new, first_kept), end)
        old_end = min(first_kept, first_new)  # [start, old_end): old-window blocks no later query reads
        movable = self._movable(blocks, start, old_end) if start < old_end else []
        num_movable = min(len(movable), end - tail_start)  # a tail position each could take
        num_moves = max(0, num_movable - num_spare)
        fresh = self.pool.get_new_blocks(end - tail_start - num_moves)
        num_middle = tail_start - first_new
        if num_middle:
            blocks.extend([self.pool.null_block] * num_middle)
            block_ids.extend([NULL_BLOCK_ID] * num_middle)
        for old in movable[:num_moves]:
            self._move(request_id, old, len(blocks))
        blocks.extend(fresh)
        block_ids.extend([b.block_id for b in fresh])
        kept = movable[num_moves:num_movable]  # each kept in place by a fresh tail block
        # Remembered while a middle, spare blocks or old-window blocks kept past the step's end exist (the
        # integrity check reads it); most decodes have none.
        if num_middle or kept or (start < old_end and any(b.block_id != NULL_BLOCK_ID for b in blocks[start:old_end])):
            first_spare = tail_start + num_moves
            spare_new = list(range(first_spare, first_spare + len(kept)))
            self.steps[request_id] = WindowStep(num_total_tokens, first_new, block_hashes, kept, spare_new)
        return fresh

    def num_reclaimable(self, except_request: str | None = None, keep: Collection[int] = ()) -> int:
        """Fresh tail blocks of pending steps that could go back to the pool (their tail moves instead),
        but for blocks whose old-window partner is in `keep` (ids of blocks about to be taken as a hit)."""
        return sum(
            len(self._valid_spare(request_id, keep)) for request_id in self.steps if request_id != except_request
        )

    def reclaim(self, num_blocks: int, except_request: str | None = None, keep: Collection[int] = ()) -> int:
        """Give up to `num_blocks` spare fresh tail blocks back to the pool (their old-window blocks move
        into the tail after all; never one in `keep`); returns how many went back."""
        released: list[KVBlock] = []
        for request_id, step in self.steps.items():
            if request_id == except_request:
                continue
            for old, new in self._valid_spare(request_id, keep):
                if len(released) == num_blocks:
                    break
                released.append(self.req_to_blocks[request_id][new])
                index = step.spare_old.index(old)
                del step.spare_old[index], step.spare_new[index]
                self._move(request_id, old, new)
        self.pool.free_blocks(released)
        return len(released)

    def fill_middle(self, max_blocks: int) -> int:
        """Give the middles of pending steps free blocks, lowest positions first, up to `max_blocks`, where
        the block's hash is known and no block caches it yet: they are stored this step and go back to
        the pool hashed after it. Returns how many blocks were given."""
        if not self.steps:  # most decode steps leave none pending
            return 0
        cached = self.pool.cached[self.group_id]
        null = self.pool.null_block
        stride = self.hash_stride
        wanted: list[tuple[str, list[int]]] = []
        num_wanted = 0
        for request_id, step in self.steps.items():
            first, end = step.first_new, self.first_needed_block(step.end)
            if end <= first or num_wanted == max_blocks:  # no middle, or no block left for it
                continue
            end = min(end, self.num_hashed_blocks(step.block_hashes))
            hashes = step.block_hashes[(first + 1) * stride - 1 : end * stride : stride]
            positions = [position for position, block_hash in enumerate(hashes, first) if block_hash not in cached]
            if step.middle:  # an earlier call filled some (a middle holds only null blocks until filled)
                blocks = self.req_to_blocks[request_id]
                positions = [position for position in positions if blocks[position] is null]
            del positions[max_blocks - num_wanted :]
            if positions:
                wanted.append((request_id, positions))
                num_wanted += len(positions)
        if not wanted:
            return 0
        fresh = self.pool.get_new_blocks(num_wanted)
        taken = 0
        for request_id, positions in wanted:
            given = fresh[taken : taken + len(positions)]
            taken += len(positions)
            blocks, block_ids = self.req_to_blocks[request_id], self.req_to_block_ids[request_id]
            first, last = positions[0], positions[-1]
            self.mark_changed(request_id, first)
            if last - first + 1 == len(positions):  # one run (no key of it was cached): by slices
                blocks[first : last + 1] = given
                block_ids[first : last + 1] = [block.block_id for block in given]
            else:
                for position, block in zip(positions, given, strict=True):
                    blocks[position] = block
                    block_ids[position] = block.block_id
            self.steps[request_id].middle.extend(positions)
        return num_wanted

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """After a step: return the blocks no later query reads (the old window, the middle), deepest
        first, still hashed if they were; the moved blocks' old positions become null."""
        released = self.take_skipped_blocks(request_id, num_computed_tokens)
        if released:
            self.pool.free_blocks(released)

    def take_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVBlock]:
        """`remove_skipped_blocks` but for the pool: the blocks it would free, in the order it would free them (the
        caller frees them)."""
        blocks = self.req_to_blocks.get(request_id)
        self.steps.pop(request_id, None)
        if not blocks:
            return []
        start = self._window_start(request_id)
        end = min(self.first_needed_block(num_computed_tokens), len(blocks))
        if end <= start:  # most steps: the window has not left a block behind
            return []
        self.mark_changed(request_id, start)
        released = blocks[start:end]
        released.reverse()
        blocks[start:end] = [self.pool.null_block] * (end - start)
        self.req_to_block_ids[request_id][start:end] = [NULL_BLOCK_ID] * (end - start)
        self.window_start[request_id] = end
        return released

    def restore(self, request_id: str, blocks: list[KVBlock]) -> None:
        super().restore(request_id, blocks)
        self.window_start[request_id] = _first_real(blocks)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Undo a pending step: moved blocks go back to their old positions, then the base's truncate."""
        blocks, block_ids = self.req_to_blocks.get(request_id), self.req_to_block_ids.get(request_id)
        if blocks:
            for old, block_id in enumerate(block_ids):
                if block_id < 0:
                    self.mark_changed(request_id, old)
                    new = block_ids.index(-block_id)
                    blocks[old], blocks[new] = blocks[new], self.pool.null_block
                    block_ids[old], block_ids[new] = -block_id, NULL_BLOCK_ID
        self.steps.pop(request_id, None)
        super().truncate(request_id, num_tokens)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.steps.pop(request_id, None)
        self.window_start.pop(request_id, None)

    def _move(self, request_id: str, old: int, new: int) -> None:
        """Give the block at position `old` to position `new` (the list's end: appended): read at `old`
        this step (-id in the table), stored into at `new`; its hash goes, its keys will be overwritten."""
        blocks, block_ids = self.req_to_blocks[request_id], self.req_to_block_ids[request_id]
        block = blocks[old]
        self.pool.drop_hash(block)
        self.mark_changed(request_id, min(old, new))
        blocks[old] = self.pool.null_block
        block_ids[old] = -block.block_id
        if new == len(blocks):
            blocks.append(block)
            block_ids.append(block.block_id)
        else:
            blocks[new] = block
            block_ids[new] = block.block_id

    def _window_start(self, request_id: str) -> int:
        start = self.window_start.get(request_id)
        if start is None:
            start = self.window_start[request_id] = _first_real(self.req_to_blocks.get(request_id, ()))
        return start

    def _num_new_tail(self, num_held: int, num_total_tokens: int) -> int:
        """Positions past the held ones that the step's last tokens need after it (the new tail)."""
        end = cdiv(num_total_tokens, self.block_size)
        return max(0, end - max(num_held, self.first_needed_block(num_total_tokens)))

    def _movable(self, blocks: Sequence[KVBlock], start: int, end: int) -> list[int]:
        """Positions in [start, end) of blocks only this request holds, in the order they move: unhashed
        first (moving a hashed one loses what it caches), each kind by position. The null block is never
        held (its ref count stays 0)."""
        unhashed, hashed = [], []
        for position in range(start, end):
            block = blocks[position]
            if block.ref_cnt == 1:
                (unhashed if block.block_hash is None else hashed).append(position)
        return unhashed + hashed

    def _valid_spare(self, request_id: str, keep: Collection[int] = ()) -> list[tuple[int, int]]:
        """The request's spare pairs whose old-window block is still held by it alone and not in `keep`."""
        blocks = self.req_to_blocks[request_id]
        step = self.steps[request_id]
        return [
            (old, new)
            for old, new in zip(step.spare_old, step.spare_new, strict=True)
            if blocks[old].ref_cnt == 1 and blocks[old].block_id not in keep
        ]

    def bound_excess(self, request_id: str) -> int:
        """Real blocks the request holds beyond `max_blocks_per_request` that the bound allows during a
        step: spare fresh tails, middle blocks and old-window blocks other requests hold too."""
        step = self.steps.get(request_id)
        if step is None:
            return 0
        end = self.first_needed_block(step.end)
        shared = sum(1 for b in self.req_to_blocks[request_id][:end] if not b.is_null and b.ref_cnt > 1)
        return len(step.spare_old) + len(step.middle) + shared


def _num_free(blocks: Sequence[KVBlock]) -> int:
    """Real blocks among `blocks` that no request holds (in the free queue)."""
    return [b.ref_cnt == 0 and b.block_id != NULL_BLOCK_ID for b in blocks].count(True)


def _first_real(blocks: Sequence[KVBlock]) -> int:
    """The first position of a real block (the list's length when there is none)."""
    return next((i for i, block in enumerate(blocks) if block.block_id != NULL_BLOCK_ID), len(blocks))


class SlidingWindowManager(WindowedManager):
    """A query at position i attends to keys in (i - W, i].

    A hit ending at (block-aligned) position p needs only the blocks covering tokens
    [p - W + 1, p): ceil((W - 1) / block_size) blocks, all earlier positions become null blocks.
    """

    kind = "sliding window"

    def __init__(
        self, group_id: int, pool: BlockPool, block_size: int, sliding_window: int, hash_stride: int = 1
    ) -> None:
        super().__init__(group_id, pool, block_size, sliding_window, hash_stride)
        self.sliding_window = sliding_window

    @classmethod
    def for_group(cls, group: KVCacheGroupSpec, pool: BlockPool, hash_stride: int) -> SlidingWindowManager:
        return cls(group.group_id, pool, group.block_size, group.sliding_window, hash_stride)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_num_blocks: int, cached: BlockLookup | None = None
    ) -> list[KVBlock]:
        cached = self.pool.cached[self.group_id] if cached is None else cached
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


class ChunkedLocalManager(WindowedManager):
    """Chunked local attention (Llama 4): a query at position i sees [C * (i // C), i], its own chunk.

    A hit ending at (block-aligned) position p needs only the blocks from its chunk's start, C * (p // C),
    to p; earlier positions become null blocks, and at a chunk boundary no block at all is needed. A
    shorter hit may start in an earlier chunk, whose blocks a longer hit did not need: hits are not
    prefix-closed.
    """

    kind = "chunked local attention"

    def __init__(
        self, group_id: int, pool: BlockPool, block_size: int, attention_chunk_size: int, hash_stride: int = 1
    ) -> None:
        super().__init__(group_id, pool, block_size, attention_chunk_size, hash_stride)
        self.attention_chunk_size = attention_chunk_size

    @classmethod
    def for_group(cls, group: KVCacheGroupSpec, pool: BlockPool, hash_stride: int) -> ChunkedLocalManager:
        return cls(group.group_id, pool, group.block_size, group.attention_chunk_size, hash_stride)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_num_blocks: int, cached: BlockLookup | None = None
    ) -> list[KVBlock]:
        cached = self.pool.cached[self.group_id] if cached is None else cached
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
