"""A windowed group's step: the old window moves into the tail, spare fresh blocks come back on demand,
the middle is stored for caching only with free blocks, and an undone step leaves what it found."""

from __future__ import annotations

from hybridkv.memory.block_pool import BlockPool
from hybridkv.memory.window_managers import SlidingWindowManager

from alloc_helpers import restore_layout

BLOCK_SIZE = 4
HASHES = [f"h{i}".encode() for i in range(20)]


def manager_after_32_tokens(num_blocks: int = 16) -> tuple[BlockPool, SlidingWindowManager]:
    """W = 9 (2 window blocks): a request that computed 32 tokens holds positions 6 and 7 (blocks 1, 2)."""
    pool = BlockPool(num_blocks=num_blocks, num_groups=1)
    manager = SlidingWindowManager(0, pool, BLOCK_SIZE, sliding_window=9)
    restore_layout(manager, "r", [False] * 6 + [True] * 2)
    assert manager.block_table("r") == [0] * 6 + [1, 2]
    return pool, manager


def test_a_long_chunk_moves_the_old_window_into_its_tail_and_needs_no_block():
    pool, manager = manager_after_32_tokens()
    assert manager.blocks_needed("r", 32, 64, []) == (0, 2)
    assert manager.allocate_step("r", 64, HASHES, num_spare=0) == []
    # Read at 6 and 7 (-id), stored into at 14 and 15; the middle 8..13 is read in flight only.
    assert manager.block_table("r") == [0] * 6 + [-1, -2] + [0] * 6 + [1, 2]
    assert manager.num_real_blocks("r") == 2 and pool.num_free_blocks == 13
    manager.remove_skipped_blocks("r", 64)
    assert manager.block_table("r") == [0] * 14 + [1, 2]
    assert pool.num_free_blocks == 13


def test_unhashed_blocks_move_first_and_a_moved_block_forgets_its_hash():
    pool = BlockPool(num_blocks=16, num_groups=1)
    manager = SlidingWindowManager(0, pool, BLOCK_SIZE, sliding_window=9)
    restore_layout(manager, "r", [False] * 6 + [True] * 3)  # after 33 tokens: positions 6, 7, 8 (blocks 1, 2, 3)
    pool.cache_blocks(pool.blocks[1:3], HASHES[6:8], 0)
    pool.blocks[2].block_hash = None  # only block 1 still caches something
    del pool.cached[0][HASHES[7]]
    manager.allocate_step("r", 40, HASHES, num_spare=0)  # the tail needs position 9; 6 and 7 may move
    assert manager.block_table("r") == [0] * 6 + [1, -2, 3, 2]
    assert pool.cached[0] == {HASHES[6]: pool.blocks[1]} and pool.num_evictions == 0
    pool, manager = manager_after_32_tokens()
    pool.cache_blocks([pool.blocks[1]], [HASHES[6]], 0)
    manager.allocate_step("r", 64, HASHES, num_spare=0)  # both move: block 1's keys will be overwritten
    assert pool.blocks[1].block_hash is None and pool.cached[0] == {}
    assert pool.num_evictions == 1


def test_a_block_another_request_also_holds_never_moves():
    pool, manager = manager_after_32_tokens()
    pool.touch([pool.blocks[1]])  # a prefix-cache hit of another request
    assert manager.blocks_needed("r", 32, 64, []) == (1, 2)
    assert [b.block_id for b in manager.allocate_step("r", 64, HASHES, num_spare=0)] == [3]
    assert manager.block_table("r") == [0] * 6 + [1, -2] + [0] * 6 + [2, 3]
    assert manager.bound_excess("r") == 1  # the shared block, paid for by the other request


def test_spare_fresh_tail_blocks_come_back_and_the_old_window_moves_after_all():
    pool, manager = manager_after_32_tokens()
    fresh = manager.allocate_step("r", 64, HASHES, num_spare=2)
    assert [b.block_id for b in fresh] == [3, 4]
    assert manager.block_table("r") == [0] * 6 + [1, 2] + [0] * 6 + [3, 4]
    assert manager.bound_excess("r") == 2 and manager.num_reclaimable() == 2
    assert manager.num_reclaimable(except_request="r") == 0
    assert manager.reclaim(1) == 1
    assert manager.block_table("r") == [0] * 6 + [-1, 2] + [0] * 6 + [1, 4]
    assert next(iter(pool.free_queue)).block_id == 3  # unhashed: reused first
    assert manager.num_reclaimable() == 1 and manager.bound_excess("r") == 1


def test_each_spare_block_saves_one_old_window_block_from_moving():
    pool, manager = manager_after_32_tokens()
    pool.touch([pool.blocks[1]])  # another request holds block 1 too: only block 2 could move
    assert manager.blocks_needed("r", 32, 64, []) == (1, 2)
    fresh = manager.allocate_step("r", 64, HASHES, num_spare=1)  # the one spare block keeps block 2 in place
    assert [b.block_id for b in fresh] == [3, 4] and manager.num_reclaimable() == 1
    assert manager.block_table("r") == [0] * 6 + [1, 2] + [0] * 6 + [3, 4]


def test_the_middle_takes_free_blocks_where_its_hash_is_uncached_lowest_first():
    pool, manager = manager_after_32_tokens()
    manager.allocate_step("r", 64, HASHES, num_spare=0)
    cached = pool.get_new_blocks(1)[0]
    pool.cache_blocks([cached], [HASHES[9]], 0)  # position 9's keys are cached by another block
    assert manager.fill_middle(max_blocks=3) == 3
    assert [block_id > 0 for block_id in manager.block_table("r")[8:14]] == [True, False, True, True, False, False]
    assert manager.bound_excess("r") == 3
    manager.remove_skipped_blocks("r", 64)
    assert manager.num_real_blocks("r") == 2


def test_the_middle_stops_at_the_known_hashes():
    _, manager = manager_after_32_tokens()
    manager.allocate_step("r", 64, HASHES[:10], num_spare=0)
    assert manager.fill_middle(max_blocks=10) == 2  # positions 8 and 9 only


def test_truncate_undoes_a_pending_step():
    pool, manager = manager_after_32_tokens()
    manager.allocate_step("r", 64, HASHES, num_spare=1)
    manager.fill_middle(max_blocks=2)
    assert pool.num_free_blocks == 15 - 2 - 1 - 2
    manager.truncate("r", 32)
    assert manager.block_table("r") == [0] * 6 + [1, 2]
    assert pool.num_free_blocks == 13
    assert manager.steps == {} and manager.bound_excess("r") == 0


def test_a_block_list_copied_from_another_request_frees_its_old_window_after_the_next_step():
    """A fork (n > 1, beams) may copy a request's list without the manager's own bookkeeping: the first
    position that may hold a real block is then found by a scan."""
    pool, manager = manager_after_32_tokens()
    parent = manager.blocks_of("r")
    pool.touch(parent)  # the null blocks are skipped
    manager.req_to_blocks["child"] = list(parent)
    manager.req_to_block_ids["child"] = [b.block_id for b in parent]
    manager.num_cached_blocks["child"] = 0
    manager.allocate_step("child", 64, HASHES, num_spare=0)  # shared blocks never move: two fresh ones
    manager.remove_skipped_blocks("child", 64)
    assert manager.block_table("child") == [0] * 14 + [3, 4]
    assert [b.ref_cnt for b in parent[6:]] == [1, 1]  # the parent's alone again
