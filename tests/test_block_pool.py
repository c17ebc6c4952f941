import pytest

from hybridkv.memory.block_pool import BlockPool, FreeBlockQueue, KVBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_starts_in_id_order_and_pops_from_the_head():
    queue = FreeBlockQueue([KVBlock(i) for i in range(1, 6)])
    assert queue.popleft().block_id == 1
    assert ids(queue.popleft_n(2)) == [2, 3]
    assert ids(queue) == [4, 5]
    assert len(queue) == 2


def test_free_queue_removes_from_the_middle_and_appends_at_the_tail():
    blocks = [KVBlock(i) for i in range(1, 6)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [1, 2, 4, 5]
    queue.append(blocks[2])
    assert ids(queue) == [1, 2, 4, 5, 3]
    assert len(queue) == 5


def test_free_queue_release_puts_hashed_blocks_at_the_tail_and_others_at_the_head():
    blocks = [KVBlock(i) for i in range(1, 6)]
    queue = FreeBlockQueue(blocks[:2])
    blocks[2].block_hash = b"x"
    blocks[4].block_hash = b"y"
    queue.release(blocks[2:])
    assert ids(queue) == [4, 1, 2, 3, 5]
    assert len(queue) == 5


def test_free_queue_keeps_blocks_of_little_worth_between_the_unhashed_and_the_cached():
    blocks = [KVBlock(i) for i in range(1, 9)]
    queue = FreeBlockQueue(blocks[:2])
    for block, digest in zip(blocks[2:], b"abcdef", strict=True):
        block.block_hash = bytes([digest])
    queue.release(blocks[2:4])  # cached: the tail
    queue.release(blocks[4:7], low=True)  # left behind by a window: oldest first, before the cached
    queue.release([blocks[7]])
    assert ids(queue) == [1, 2, 5, 6, 7, 3, 4, 8]
    assert queue.run_sizes == [2, 3, 3] and queue.num_spare_blocks == 5
    queue.keep([blocks[5], blocks[2]])  # a prefix's end (3 is cached: stays): now the most recently used
    assert ids(queue) == [1, 2, 5, 7, 3, 4, 8, 6] and queue.run_sizes == [2, 2, 4]
    queue.remove(blocks[4])
    assert ids(queue.popleft_n(3)) == [1, 2, 7]  # the sentinels between runs are passed over and stay
    assert queue.run_sizes == [0, 0, 4] and ids(queue) == [3, 4, 8, 6]
    queue.release([blocks[0]])
    assert ids(queue) == [1, 3, 4, 8, 6] and queue.popleft().block_id == 1 and len(queue) == 4


def test_free_queue_refuses_to_pop_more_than_it_holds():
    queue = FreeBlockQueue([KVBlock(1)])
    with pytest.raises(IndexError):
        queue.popleft_n(2)
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_free_queue_refuses_to_remove_a_block_it_does_not_hold():
    queue = FreeBlockQueue([])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(KVBlock(7))


def test_null_block_is_never_allocated():
    pool = BlockPool(num_blocks=4, num_groups=1)
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert pool.num_free_blocks == 0
    assert pool.null_block.ref_cnt == 0


def test_pool_needs_a_block_besides_the_null_block():
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(num_blocks=1, num_groups=1)


def test_freed_hashed_blocks_join_the_tail_and_unhashed_ones_the_head():
    pool = BlockPool(num_blocks=7, num_groups=1)
    blocks = pool.get_new_blocks(3)  # ids 1, 2, 3; free queue [4, 5, 6]
    pool.cache_blocks([blocks[0]], [b"h1"], 0)
    pool.cache_blocks([blocks[1]], [b"h2"], 0)
    pool.free_blocks(reversed(blocks))  # tail-first: 3 (no hash), 2, 1
    assert ids(pool.free_queue) == [3, 4, 5, 6, 2, 1]
    pool.check_integrity()


def test_reused_block_loses_its_hash_at_allocation():
    pool = BlockPool(num_blocks=2, num_groups=1)
    (block,) = pool.get_new_blocks(1)
    pool.cache_blocks([block], [b"h"], 0)
    pool.free_blocks([block])
    assert pool.cached[0].get(b"h") is block
    (again,) = pool.get_new_blocks(1)
    assert again is block and block.block_hash is None
    assert pool.cached[0].get(b"h") is None
    assert pool.num_evictions == 1


def test_second_block_with_a_cached_hash_is_not_registered():
    pool = BlockPool(num_blocks=3, num_groups=1)
    first, second = pool.get_new_blocks(2)
    pool.cache_blocks([first], [b"h"], 0)
    pool.cache_blocks([second], [b"h"], 0)
    assert pool.cached[0].get(b"h") is first
    assert second.block_hash is None


def test_hash_maps_are_per_group():
    pool = BlockPool(num_blocks=3, num_groups=2)
    a, b = pool.get_new_blocks(2)
    pool.cache_blocks([a], [b"h"], 0)
    pool.cache_blocks([b], [b"h"], 1)
    assert pool.cached[0].get(b"h") is a
    assert pool.cached[1].get(b"h") is b


def test_touch_takes_a_free_block_out_of_the_queue():
    pool = BlockPool(num_blocks=4, num_groups=1)
    blocks = pool.get_new_blocks(3)
    pool.cache_blocks([blocks[1]], [b"h"], 0)
    pool.free_blocks([blocks[1]])
    assert pool.num_free_blocks == 1
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1 and pool.num_free_blocks == 0
    pool.touch([blocks[1], pool.null_block])
    assert blocks[1].ref_cnt == 2 and pool.null_block.ref_cnt == 0
    pool.check_integrity()


def test_shared_block_returns_to_the_queue_only_with_its_last_reference():
    pool = BlockPool(num_blocks=2, num_groups=1)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.free_blocks([block, pool.null_block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 1
    pool.check_integrity()
