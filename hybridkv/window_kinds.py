"""The windowed kinds' own rules: which blocks a query reads and which cached runs make a hit.

Sliding windows (a query at i sees keys in (i - W, i]) and chunked local attention (Llama 4: a query at
i sees [C * (i // C), i]). How their groups allocate, move and free blocks is `window_managers.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.block_pool import BlockPool, KVBlock
from hybridkv.window_managers import WindowedManager


class SlidingWindowManager(WindowedManager):
    """A query at position i attends to keys in (i - W, i].

    A hit ending at (block-aligned) position p needs only the blocks covering tokens
    [p - W + 1, p): ceil((W - 1) / block_size) blocks, all earlier positions become null blocks.
    """

    def __init__(
        self, group_id: int, pool: BlockPool, block_size: int, sliding_window: int, hash_stride: int = 1
    ) -> None:
        super().__init__(group_id, pool, block_size, sliding_window, hash_stride)
        self.sliding_window = sliding_window

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


class ChunkedLocalManager(WindowedManager):
    """Chunked local attention (Llama 4): a query at position i sees [C * (i // C), i], its own chunk.

    A hit ending at (block-aligned) position p needs only the blocks from its chunk's start, C * (p // C),
    to p; earlier positions become null blocks, and at a chunk boundary no block at all is needed. A
    shorter hit may start in an earlier chunk, whose blocks a longer hit did not need: hits are not
    prefix-closed.
    """

    def __init__(
        self, group_id: int, pool: BlockPool, block_size: int, attention_chunk_size: int, hash_stride: int = 1
    ) -> None:
        super().__init__(group_id, pool, block_size, attention_chunk_size, hash_stride)
        self.attention_chunk_size = attention_chunk_size

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
