from hybridkv.memory.integrity import check_coordinator
from hybridkv.memory.kv_request import KVRequest

from alloc_helpers import free_order, make_coordinator, run_prefill

BS = 4


def request(request_id, tokens, salt=None):
    return KVRequest(request_id, tokens, BS, cache_salt=salt)


def ref_counts(coordinator):
    return [b.ref_cnt for b in coordinator.pool.blocks]


def test_second_request_sharing_three_full_blocks_hits_exactly_three():
    coordinator = make_coordinator([None], num_blocks=16)
    a = request("a", list(range(14)))  # 3 full blocks + 2 tokens
    assert run_prefill(coordinator, a)
    b = request("b", list(range(12)) + [99, 98, 97, 96, 95])
    hit = coordinator.find_longest_cache_hit(b)
    assert hit.num_tokens == 12
    assert coordinator.allocate_slots(b, b.num_tokens - 12, hit)
    shared = coordinator.block_ids("a")[0][:3]
    assert coordinator.block_ids("b")[0][:3] == shared
    assert [coordinator.pool.blocks[i].ref_cnt for i in shared] == [2, 2, 2]
    check_coordinator(coordinator, {"a": a, "b": b})


def test_hit_never_covers_the_last_prompt_token():
    coordinator = make_coordinator([None], num_blocks=16)
    assert run_prefill(coordinator, request("a", list(range(12))))
    assert coordinator.find_longest_cache_hit(request("b", list(range(12)))).num_tokens == 8
    assert coordinator.find_longest_cache_hit(request("c", list(range(13)))).num_tokens == 12


def test_eviction_order_is_deepest_block_first_then_least_recently_freed():
    coordinator = make_coordinator([None], num_blocks=10)
    a, b = request("a", list(range(12))), request("b", list(range(100, 112)))
    assert run_prefill(coordinator, a) and run_prefill(coordinator, b)  # a: 1,2,3  b: 4,5,6
    coordinator.free("a")
    coordinator.free("b")
    assert free_order(coordinator) == [7, 8, 9, 3, 2, 1, 6, 5, 4]
    c = request("c", list(range(200, 220)))  # 5 blocks: 3 never-used ones, then a's deepest two
    assert run_prefill(coordinator, c)
    assert coordinator.block_ids("c")[0] == [7, 8, 9, 3, 2]
    assert coordinator.pool.num_evictions == 2
    assert coordinator.find_longest_cache_hit(request("a2", list(range(12)) + [1])).num_tokens == 4
    assert coordinator.find_longest_cache_hit(request("b2", list(range(100, 112)) + [1])).num_tokens == 12


def test_hit_on_a_free_block_never_evicts_that_block():
    coordinator = make_coordinator([None], num_blocks=3)  # blocks 1 and 2
    a, c = request("a", list(range(4))), request("c", list(range(50, 54)))
    assert run_prefill(coordinator, a) and run_prefill(coordinator, c)
    coordinator.free("a")
    coordinator.free("c")
    assert free_order(coordinator) == [1, 2]  # a's block is at the head: next to be evicted
    b = request("b", list(range(4)) + [7, 7])
    hit = coordinator.find_longest_cache_hit(b)
    assert [blk.block_id for blk in hit.blocks[0]] == [1]
    assert coordinator.allocate_slots(b, 2, hit)
    assert coordinator.block_ids("b")[0] == [1, 2]
    assert coordinator.pool.blocks[1].block_hash == a.block_hashes[0]
    assert coordinator.pool.num_evictions == 1  # c's block, not a's


def test_failed_allocation_changes_nothing():
    coordinator = make_coordinator([None, 9], num_blocks=12)
    a = request("a", list(range(16)))
    assert run_prefill(coordinator, a)
    coordinator.free("a")
    refs, order = ref_counts(coordinator), free_order(coordinator)
    b = request("b", list(range(16)) + list(range(500, 540)))  # hits 4 blocks, needs far more
    hit = coordinator.find_longest_cache_hit(b)
    assert hit.num_tokens == 16
    assert not coordinator.allocate_slots(b, b.num_tokens - 16, hit)
    assert ref_counts(coordinator) == refs
    assert free_order(coordinator) == order
    assert coordinator.block_ids("b") == [[], []]
    check_coordinator(coordinator)


def test_cache_salt_isolates_requests():
    coordinator = make_coordinator([None], num_blocks=16)
    assert run_prefill(coordinator, request("a", list(range(13)), salt="alice"))
    assert coordinator.find_longest_cache_hit(request("b", list(range(13)), salt="bob")).num_tokens == 0
    assert coordinator.find_longest_cache_hit(request("c", list(range(13)))).num_tokens == 0
    assert coordinator.find_longest_cache_hit(request("d", list(range(13)), salt="alice")).num_tokens == 12


def test_evicting_one_sliding_block_shortens_the_common_hit_exactly():
    # full + sliding + sliding, W = 9: a hit at p needs the 2 blocks before p in each sliding group.
    coordinator = make_coordinator([None, 9, 9], num_blocks=19)
    a = request("a", list(range(24)))
    assert run_prefill(coordinator, a)
    coordinator.free("a")
    b = request("b", list(range(16)) + [77])
    assert coordinator.find_longest_cache_hit(b).num_tokens == 16
    # Group 1 returned its out-of-window blocks first (deepest first), so the least recently used
    # free block is group 1's block at position 3. One allocation evicts exactly that block.
    head = next(iter(coordinator.pool.free_queue))
    assert (head.block_hash, head.hash_group) == (a.block_hashes[3], 1)
    (evicted,) = coordinator.pool.get_new_blocks(1)
    assert evicted is head and evicted.block_hash is None
    coordinator.pool.free_blocks([evicted])
    assert coordinator.pool.num_evictions == 1
    hit = coordinator.find_longest_cache_hit(b)
    # Group 1 now lacks position 3, so its longest hit ends at 3 blocks (positions 1, 2);
    # group 2 accepts 3 too (positions 1, 2), and full attention any prefix.
    assert hit.num_tokens == 12
    assert ["".join("n" if blk.is_null else "b" for blk in group) for group in hit.blocks] == ["bbb", "nbb", "nbb"]


def test_sliding_group_is_charged_for_its_window_only_whatever_the_chunk():
    coordinator = make_coordinator([9], num_blocks=40, enable_caching=False)
    long_prompt = request("a", list(range(160)))
    assert coordinator.allocate_slots(long_prompt, 32)
    # A query at 32 sees keys from 24: only positions 6 and 7 are stored; 0..5 are read in flight.
    assert coordinator.block_ids("a") == [[0, 0, 0, 0, 0, 0, 1, 2]]
    long_prompt.num_computed_tokens = 32
    coordinator.update_computed(long_prompt)
    assert coordinator.pool.num_used_blocks == 2
    # The chunk 32..63 needs positions 14, 15 after it; 6 and 7 are read by its first queries, then move
    # there (-id where they are read): no new block.
    assert coordinator.allocate_slots(long_prompt, 32)
    assert coordinator.block_ids("a") == [[0] * 6 + [-1, -2] + [0] * 6 + [1, 2]]
    assert coordinator.pool.num_used_blocks == 2
    check_coordinator(coordinator, {"a": long_prompt})
    long_prompt.num_computed_tokens = 64
    coordinator.update_computed(long_prompt)
    assert coordinator.block_ids("a") == [[0] * 14 + [1, 2]]
    check_coordinator(coordinator, {"a": long_prompt})


def test_with_blocks_to_spare_the_old_window_stays_cached_and_the_middle_is_stored():
    coordinator = make_coordinator([9], num_blocks=40)
    long_prompt = request("a", list(range(160)))
    assert coordinator.allocate_slots(long_prompt, 32)
    coordinator.use_slack_for_caching()  # positions 0..5 take free blocks, to be hashed
    long_prompt.num_computed_tokens = 32
    coordinator.update_computed(long_prompt)
    assert len(coordinator.pool.cached[0]) == 8 and coordinator.pool.num_used_blocks == 2
    assert coordinator.allocate_slots(long_prompt, 32)  # the tail takes fresh blocks: 6, 7 stay cached
    assert coordinator.pool.num_used_blocks == 4
    assert coordinator.use_slack_for_caching() == 6  # positions 8..13
    check_coordinator(coordinator, {"a": long_prompt})
    long_prompt.num_computed_tokens = 64
    coordinator.update_computed(long_prompt)
    assert len(coordinator.pool.cached[0]) == 16 and coordinator.pool.num_used_blocks == 2
    # A prompt sharing the first 48 tokens hits there: its window's blocks (positions 10, 11) are cached.
    assert coordinator.find_longest_cache_hit(request("b", list(range(48)) + [500])).num_tokens == 48


def test_stats_count_queries_hits_and_blocks_per_group():
    coordinator = make_coordinator([None, 9], num_blocks=40)
    a = request("a", list(range(24)))
    assert run_prefill(coordinator, a)
    b = request("b", list(range(20)) + [1, 2, 3])
    assert run_prefill(coordinator, b)
    stats = coordinator.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (24 + 23, 20)
    # Full group: a's 6 blocks + b's 1 new (5 shared). Sliding group: a keeps positions 4, 5; b took
    # a's freed position 3 and shared position 4 as its hit, and added position 5.
    assert stats.blocks_in_use_per_group == [7, 4]
    assert stats.blocks_in_use == 11
    assert stats.num_free_blocks == 40 - 1 - stats.blocks_in_use


def test_no_hits_when_caching_is_off():
    coordinator = make_coordinator([None], num_blocks=16, enable_caching=False)
    assert run_prefill(coordinator, request("a", list(range(13))))
    coordinator.free("a")
    assert coordinator.find_longest_cache_hit(request("b", list(range(13)))).num_tokens == 0
    assert all(b.block_hash is None for b in coordinator.pool.blocks)


def test_free_returns_every_block_of_every_group():
    coordinator = make_coordinator([None, 9, 9], num_blocks=40)
    a = request("a", list(range(30)))
    assert run_prefill(coordinator, a)
    coordinator.free("a")
    assert coordinator.pool.num_used_blocks == 0
    assert coordinator.block_ids("a") == [[], [], []]
    check_coordinator(coordinator)


def test_free_hit_block_of_a_sliding_group_is_not_evicted_by_the_full_groups_allocation():
    coordinator = make_coordinator([None, 5], num_blocks=7)  # blocks 1..6
    a = request("a", list(range(12)))
    # Full [1, 2, 3]; sliding: the tail (position 2) takes 4, the middle (0, 1) takes 5 and 6 for caching,
    # which go back to the pool after the step, hashed, the deeper one first.
    assert run_prefill(coordinator, a)
    coordinator.free("a")
    assert free_order(coordinator) == [6, 5, 3, 2, 1, 4]  # the sliding group's hit block 6 leads
    b = request("b", list(range(8)) + [40])
    hit = coordinator.find_longest_cache_hit(b)
    assert [[blk.block_id for blk in group] for group in hit.blocks] == [[1, 2], [0, 6]]
    assert coordinator.allocate_slots(b, 1, hit)
    assert coordinator.block_ids("b") == [[1, 2, 5], [0, 6, 3]]
    assert coordinator.pool.blocks[6].block_hash == a.block_hashes[1]
    b.num_computed_tokens = hit.num_tokens
    check_coordinator(coordinator, {"b": b})


def test_groups_of_different_block_sizes_hit_where_every_groups_blocks_end():
    # The full layer has 1 kv head: blocks of 8 tokens; the sliding layer (window 5, 2 heads) blocks of 4.
    coordinator = make_coordinator([None, 5], num_blocks=32, kv_heads=[1, 2])
    assert [m.block_size for m in coordinator.managers] == [8, 4]
    a = request("a", list(range(21)))
    assert run_prefill(coordinator, a)
    # The full group hashed 2 blocks of 8 (by the hashes of tokens 0-7 and 0-15), the sliding one 5 of 4.
    assert len(coordinator.pool.cached[0]) == 2
    assert coordinator.pool.cached[0][a.block_hashes[3]].block_id == coordinator.block_ids("a")[0][1]
    # 12 tokens are cached in the sliding group but end inside a full-group block: the hit is 8.
    b = request("b", list(range(12)) + [99] * 5)
    hit = coordinator.find_longest_cache_hit(b)
    assert hit.num_tokens == 8 and [len(blocks) for blocks in hit.blocks] == [1, 2]
    assert coordinator.allocate_slots(b, b.num_tokens - 8, hit)
    b.num_computed_tokens = b.num_tokens
    coordinator.update_computed(b)
    check_coordinator(coordinator, {"a": a, "b": b})
    # 20 shared tokens hit 16: two full-group blocks, and the sliding window's blocks before 16.
    c = request("c", list(range(20)) + [7])
    hit = coordinator.find_longest_cache_hit(c)
    assert hit.num_tokens == 16
    assert [len(blocks) for blocks in hit.blocks] == [2, 4] and hit.blocks[1][0].is_null


def test_block_sizes_that_do_not_divide_each_other_allocate_and_hit_where_all_blocks_end():
    # 6, 3 and 2 kv heads: blocks of 4, 8 and 12 tokens (the engine block size is 4); hits are multiples of 24.
    coordinator = make_coordinator([None, None, None], num_blocks=64, kv_heads=[6, 3, 2])
    assert [m.block_size for m in coordinator.managers] == [4, 8, 12] and coordinator.hit_alignment == 24
    a = request("a", list(range(9)))
    assert run_prefill(coordinator, a)
    # 9 tokens fill 3 blocks of 4, 2 of 8 (16 tokens) and 1 of 12: decoding to 13 tokens needs a block of
    # 4 and one of 12 even though the groups of 8 have room.
    a.append_token_ids([1, 2, 3, 4])
    assert coordinator.allocate_slots(a, 4)
    assert [len(blocks) for blocks in coordinator.block_ids("a")] == [4, 2, 2]
    a.num_computed_tokens = 13
    coordinator.update_computed(a)
    check_coordinator(coordinator, {"a": a})
    b = request("b", list(range(30)))
    assert run_prefill(coordinator, b)
    c = request("c", list(range(30)) + [5])
    hit = coordinator.find_longest_cache_hit(c)
    assert hit.num_tokens == 24 and [len(blocks) for blocks in hit.blocks] == [6, 3, 2]
