import pytest

from hybridkv.memory.block_pool import BlockPool
from hybridkv.memory.managers import FullAttentionManager
from hybridkv.memory.window_managers import ChunkedLocalManager, SlidingWindowManager

from alloc_helpers import restore_layout

BLOCK_SIZE = 4


def cached_pattern(manager, pattern: str) -> list[bytes]:
    """Block hashes of a request where '1' marks a block cached in the manager's group."""
    hashes = [f"h{i}".encode() for i in range(len(pattern))]
    pool = manager.pool
    blocks = pool.get_new_blocks(pattern.count("1"))
    for block, i in zip(blocks, [i for i, c in enumerate(pattern) if c == "1"], strict=True):
        pool.cache_blocks([block], [hashes[i]], manager.group_id)
    pool.free_blocks(blocks)
    return hashes


def hit_layout(hit) -> str:
    """'n' for a null block, 'b' for a real one."""
    return "".join("n" if b.is_null else "b" for b in hit)


@pytest.mark.parametrize(
    ("pattern", "max_blocks", "expected"),
    [
        ("11011101", 8, "nnnnbb"),  # last run of 2 cached blocks ends at block 6
        ("0111", 4, "nnbb"),
        ("1000", 4, "b"),  # p=4 < W-1: everything from block 0 is needed, and it is cached
        ("1100", 4, "bb"),
        ("0010", 4, ""),  # a lone cached block is not enough for a window of 2 blocks
        ("111111", 3, "nbb"),  # the hit never passes max_blocks
        ("", 4, ""),
    ],
)
def test_sliding_window_hit_needs_only_the_last_window_blocks(pattern, max_blocks, expected):
    pool = BlockPool(num_blocks=16, num_groups=1)
    manager = SlidingWindowManager(0, pool, BLOCK_SIZE, sliding_window=9)  # W-1 = 8 tokens = 2 blocks
    assert manager.num_window_blocks == 2
    hashes = cached_pattern(manager, pattern)
    assert hit_layout(manager.find_longest_cache_hit(hashes, max_blocks)) == expected


def test_window_of_one_token_hits_everything_without_reading_blocks():
    pool = BlockPool(num_blocks=4, num_groups=1)
    manager = SlidingWindowManager(0, pool, BLOCK_SIZE, sliding_window=1)
    assert hit_layout(manager.find_longest_cache_hit([b"x", b"y", b"z"], 2)) == "nn"


@pytest.mark.parametrize(
    ("pattern", "max_blocks", "expected"),
    [
        ("0000111", 7, "nnnnbbb"),  # ends at 28 in the chunk [16, 32): blocks 4-6 hit, 0-3 are never read
        ("0000101", 7, "nnnnb"),  # block 5 missing: the longest hit ends at 20 and needs block 4 only
        ("110", 3, "bb"),  # ends at 8 in the first chunk: blocks 0-1 needed and cached
        ("010", 3, ""),  # block 0 missing: no end before 16 has its chunk cached
        ("00000000", 8, "nnnnnnnn"),  # at 32, a chunk boundary, the next query needs no block
        ("11111", 3, "bbb"),
    ],
)
def test_chunked_hit_needs_only_the_blocks_of_its_last_chunk(pattern, max_blocks, expected):
    pool = BlockPool(num_blocks=16, num_groups=1)
    manager = ChunkedLocalManager(0, pool, BLOCK_SIZE, attention_chunk_size=16)  # chunks of 4 blocks
    hashes = cached_pattern(manager, pattern)
    assert hit_layout(manager.find_longest_cache_hit(hashes, max_blocks)) == expected


def test_chunked_manager_holds_only_the_blocks_of_the_querys_chunk():
    pool = BlockPool(num_blocks=16, num_groups=1)
    manager = ChunkedLocalManager(0, pool, BLOCK_SIZE, attention_chunk_size=12)  # chunk ends inside block 2
    manager.allocate_new_blocks("r", 0, 26)  # the query at 26 sees [24, 26]: blocks 0-5 are read in flight
    assert hit_layout(manager.blocks_of("r")) == "nnnnnnb"
    manager.remove_skipped_blocks("r", 26)
    manager.allocate_new_blocks("r", 26, 30)
    assert hit_layout(manager.blocks_of("r")) == "nnnnnnbb"
    assert pool.num_free_blocks == 15 - 2


@pytest.mark.parametrize(("pattern", "expected"), [("1101", 2), ("0111", 0), ("1111", 4), ("", 0)])
def test_full_attention_hit_is_the_cached_run_from_block_zero(pattern, expected):
    pool = BlockPool(num_blocks=16, num_groups=1)
    manager = FullAttentionManager(0, pool, BLOCK_SIZE)
    hashes = cached_pattern(manager, pattern)
    assert len(manager.find_longest_cache_hit(hashes, 8)) == expected


@pytest.mark.parametrize(
    ("num_computed", "nulled_positions"),
    [(8, []), (11, []), (12, [0]), (13, [0]), (16, [0, 1]), (32, [0, 1, 2, 3, 4, 5])],
)
def test_out_of_window_blocks_return_to_the_pool(num_computed, nulled_positions):
    pool = BlockPool(num_blocks=10, num_groups=1)
    manager = SlidingWindowManager(0, pool, BLOCK_SIZE, sliding_window=9)
    restore_layout(manager, "r", [True] * 8)  # blocks 1..8 at positions 0..7 (a swapped-in request)
    manager.remove_skipped_blocks("r", num_computed)
    blocks = manager.blocks_of("r")
    assert [i for i, b in enumerate(blocks) if b.is_null] == nulled_positions
    assert pool.num_free_blocks == 1 + len(nulled_positions)
    # A query at num_computed sees keys from num_computed - 8: every such block is still real.
    assert all(not b.is_null for b in blocks[max(0, num_computed - 8) // BLOCK_SIZE :])
    pool.check_integrity()


def test_removal_resumes_where_the_last_one_ended():
    pool = BlockPool(num_blocks=10, num_groups=1)
    manager = SlidingWindowManager(0, pool, BLOCK_SIZE, sliding_window=9)
    restore_layout(manager, "r", [True] * 8)
    manager.remove_skipped_blocks("r", 16)
    manager.remove_skipped_blocks("r", 20)
    assert hit_layout(manager.blocks_of("r")) == "nnnbbbbb"
    assert pool.num_free_blocks == 4


def test_sliding_allocation_stores_only_what_the_next_query_reads():
    pool = BlockPool(num_blocks=16, num_groups=1)
    manager = SlidingWindowManager(0, pool, BLOCK_SIZE, sliding_window=9)
    # Tokens 0..31 are known computed elsewhere (e.g. a hit), the chunk is 32..39: its queries read their
    # own keys in flight, and after it the query at 40 sees keys from 32 on: positions 8 and 9.
    assert manager.num_blocks_to_allocate("r", 32, 40, []) == 2
    new = manager.allocate_new_blocks("r", 32, 40)
    assert len(new) == 2
    assert hit_layout(manager.blocks_of("r")) == "nnnnnnnnbb"


def test_full_allocation_counts_every_block():
    pool = BlockPool(num_blocks=16, num_groups=1)
    manager = FullAttentionManager(0, pool, BLOCK_SIZE)
    assert manager.num_blocks_to_allocate("r", 32, 40, []) == 10


def test_free_returns_blocks_deepest_first():
    pool = BlockPool(num_blocks=5, num_groups=1)
    manager = FullAttentionManager(0, pool, BLOCK_SIZE)
    blocks = manager.allocate_new_blocks("r", 0, 16)
    manager.cache_blocks("r", [b"a", b"b", b"c", b"d"], 16)
    manager.free("r")
    assert [b.block_id for b in pool.free_queue] == [4, 3, 2, 1]
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    assert manager.blocks_of("r") == []


@pytest.mark.parametrize("hash_stride", [1, 2, 3])
def test_block_hashes_between_are_block_hash_of_each_block(hash_stride):
    manager = FullAttentionManager(0, BlockPool(num_blocks=4, num_groups=1), 16 * hash_stride, hash_stride)
    hashes = [bytes([i]) for i in range(12)]
    for start in range(0, 12 // hash_stride + 1):
        for end in range(start, 12 // hash_stride + 1):
            expected = [manager.block_hash(hashes, index) for index in range(start, end)]
            assert list(manager.block_hashes_between(hashes, start, end)) == expected
