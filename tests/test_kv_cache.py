"""KV tensors: sizing, allocation, the step's slot mapping, and the cache write (both backends)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.kernels import (
    PagedAttentionMetadata,
    StepMetadata,
    allocate_kv_cache,
    allocate_kv_pages,
    build_step_metadata,
    kv_page_views,
    num_blocks_for_budget,
    num_blocks_for_memory_utilization,
    paged_attention,
    write_kv,
)
from hybridkv.kernels.torch_plan import torch_plan

from kernel_reference import make_paged_batch

BACKENDS = ["torch", "triton"]


def test_pages_hold_whole_elements_and_start_zeroed():
    pages = allocate_kv_pages(5, 147_456, torch.bfloat16, "cpu")
    assert pages.shape == (5, 73_728) and not pages.any()
    with pytest.raises(ValueError, match=r"whole torch\.float32 elements"):
        allocate_kv_pages(5, 6, torch.float32, "cpu")
    with pytest.raises(ValueError, match="at least 2"):
        allocate_kv_pages(1, 64, torch.float32, "cpu")


def test_a_layers_views_cover_its_slot_of_every_page_k_then_v():
    pages = torch.zeros(4, 2 * (8 * 2 * (16 + 8)))  # two slots of 8 tokens, 2 heads, K dim 16, V dim 8
    keys, values = kv_page_views(pages, offset_bytes=8 * 2 * 24 * 4, block_size=8, num_kv_heads=2, head_dim=16,
                                 value_head_dim=8)  # fmt: skip
    assert keys.shape == (4, 8, 2, 16) and values.shape == (4, 8, 2, 8)
    keys.fill_(1.0)
    values.fill_(2.0)
    slot = 8 * 2 * 24
    assert pages[:, :slot].eq(0).all()  # the first slot is untouched
    assert pages[:, slot : slot + 256].eq(1).all() and pages[:, slot + 256 :].eq(2).all()


def test_num_blocks_for_budget_rounds_down():
    assert num_blocks_for_budget(10_000, 1_000) == 10
    assert num_blocks_for_budget(10_999, 1_000) == 10


def test_num_blocks_for_budget_below_the_minimum_names_the_fix():
    with pytest.raises(ValueError, match=r"holds 4 blocks .* at least 9 are needed .*raise the KV cache budget"):
        num_blocks_for_budget(4_500, 1_000, min_num_blocks=9)


def test_num_blocks_for_memory_utilization_subtracts_memory_in_use():
    # 80% of 100 GB allowed, 30 GB already in use -> 50 GB for the cache.
    num_blocks = num_blocks_for_memory_utilization(0.8, 70 * 10**9, 100 * 10**9, 10**6)
    assert num_blocks == 50_000


def test_num_blocks_for_memory_utilization_when_usage_exceeds_the_share_names_the_fix():
    with pytest.raises(ValueError, match="raise memory_utilization"):
        num_blocks_for_memory_utilization(0.5, 40 * 10**9, 100 * 10**9, 10**6)


def test_num_blocks_for_memory_utilization_rejects_fractions_outside_0_1():
    with pytest.raises(ValueError, match="memory_utilization must be in"):
        num_blocks_for_memory_utilization(1.5, 10, 10, 1)


def test_allocate_kv_cache_returns_zeroed_pairs_in_the_block_slot_head_dim_layout():
    caches = allocate_kv_cache(
        3, num_blocks=10, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device="cpu"
    )
    assert len(caches) == 3
    for key_cache, value_cache in caches:
        assert key_cache.shape == value_cache.shape == (10, 16, 2, 64)
        assert key_cache.dtype == torch.bfloat16
        assert not key_cache.any() and not value_cache.any()
        assert key_cache.data_ptr() != value_cache.data_ptr()


def test_allocate_kv_cache_needs_a_real_block_besides_the_null_block():
    with pytest.raises(ValueError, match="at least 2"):
        allocate_kv_cache(1, 1, 16, 1, 64, torch.float32, "cpu")


def test_metadata_slot_mapping_follows_the_block_table():
    metadata = PagedAttentionMetadata.build(
        query_lens=[1, 3], seq_lens=[5, 19], block_table=[[7, 2], [4, 9]], block_size=16
    )
    # seq 0: position 4 in block 7; seq 1: positions 16..18 in block 9.
    assert metadata.slot_mapping.tolist() == [7 * 16 + 4, 9 * 16 + 0, 9 * 16 + 1, 9 * 16 + 2]
    assert metadata.cu_seqlens_q.tolist() == [0, 1, 4]
    assert metadata.cu_seqlens_q.dtype == metadata.seq_lens.dtype == metadata.block_table.dtype == torch.int32
    assert metadata.slot_mapping.dtype == torch.int64


def test_metadata_pads_block_table_rows_with_the_null_block():
    metadata = PagedAttentionMetadata.build([1, 1], [3, 40], [[5], [1, 2, 3]], block_size=16)
    assert metadata.block_table.tolist() == [[5, 0, 0], [1, 2, 3]]


def test_metadata_rejects_a_table_too_short_for_the_sequence():
    with pytest.raises(ValueError, match="2 blocks of 16 cannot hold 40 tokens"):
        PagedAttentionMetadata.build([1], [40], [[1, 2]], block_size=16)


def test_metadata_rejects_more_query_tokens_than_the_sequence_holds():
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        PagedAttentionMetadata.build([5], [3], [[1]], block_size=16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_each_row_at_its_slot(backend, dtype):
    key_cache, value_cache = allocate_kv_cache(1, 4, 8, 3, 96, dtype, "cpu")[0]
    key = torch.randn(3, 3, 96).to(dtype)
    value = torch.randn(3, 3, 96).to(dtype)
    slots = torch.tensor([9, 0, 31])
    write_kv(key, value, key_cache, value_cache, slots, backend=backend)
    for row, slot in enumerate(slots.tolist()):
        assert torch.equal(key_cache[slot // 8, slot % 8], key[row])
        assert torch.equal(value_cache[slot // 8, slot % 8], value[row])
    assert int((key_cache.view(-1, 3 * 96) != 0).any(dim=1).sum()) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_into_page_views_with_a_narrower_value_touches_only_its_slot(backend):
    pages = torch.full((4, 3 * 8 * 2 * (16 + 8)), 5.0)
    keys, values = kv_page_views(pages, 8 * 2 * 24 * 4, 8, 2, 16, 8)
    before = pages.clone()
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 8)
    slots = torch.tensor([9, 0, 31])
    write_kv(key, value, keys, values, slots, backend=backend)
    for row, slot in enumerate(slots.tolist()):
        assert torch.equal(keys[slot // 8, slot % 8], key[row])
        assert torch.equal(values[slot // 8, slot % 8], value[row])
    changed = (pages != before).nonzero()[:, 1]
    assert changed.min() >= 8 * 2 * 24 and changed.max() < 2 * 8 * 2 * 24


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_leaves_padding_rows_untouched(backend):
    key_cache = torch.full((4, 8, 2, 64), 7.0)
    value_cache = torch.full((4, 8, 2, 64), -7.0)
    key = torch.randn(4, 2, 64)
    value = torch.randn(4, 2, 64)
    slots = torch.tensor([-1, 10, -1, 3])
    write_kv(key, value, key_cache, value_cache, slots, backend=backend)
    expected_keys = torch.full((4, 8, 2, 64), 7.0)
    expected_values = torch.full((4, 8, 2, 64), -7.0)
    expected_keys[1, 2], expected_values[1, 2] = key[1], value[1]
    expected_keys[0, 3], expected_values[0, 3] = key[3], value[3]
    assert torch.equal(key_cache, expected_keys)
    assert torch.equal(value_cache, expected_values)


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_of_only_padding_changes_nothing(backend):
    key_cache = torch.full((2, 4, 1, 64), 3.0)
    value_cache = key_cache.clone()
    write_kv(
        torch.randn(2, 1, 64),
        torch.randn(2, 1, 64),
        key_cache,
        value_cache,
        torch.tensor([-1, -1]),
        backend=backend,
    )
    assert torch.equal(key_cache, torch.full((2, 4, 1, 64), 3.0))
    assert torch.equal(value_cache, torch.full((2, 4, 1, 64), 3.0))


def test_groups_of_one_step_share_its_lengths_and_layouts_and_attend_as_if_built_alone():
    first = make_paged_batch([1, 5, 1], [40, 64, 90], num_q_heads=4, num_kv_heads=2, sliding_window=24, seed=5)
    other = make_paged_batch([1, 5, 1], [40, 64, 90], num_q_heads=4, num_kv_heads=2, sliding_window=24, seed=6)
    step = StepMetadata.build([1, 5, 1], [40, 64, 90])
    first_group = step.for_group(first.metadata.block_table_rows, 16)
    shared = step.for_group(other.metadata.block_table_rows, 16)
    kwargs = dict(scale=0.125, sliding_window=24, backend="torch")
    first_out = paged_attention(first.query, first.key_cache, first.value_cache, first_group, **kwargs)
    expected = paged_attention(other.query, other.key_cache, other.value_cache, other.metadata, **kwargs)
    got = paged_attention(other.query, other.key_cache, other.value_cache, shared, **kwargs)
    assert torch.equal(got, expected)
    assert torch.equal(
        first_out, paged_attention(first.query, first.key_cache, first.value_cache, first.metadata, **kwargs)
    )
    assert shared.cu_seqlens_q is first_group.cu_seqlens_q and shared.seq_lens is first_group.seq_lens
    assert torch_plan(shared, 24).sequences is torch_plan(first_group, 24).sequences


def test_groups_of_other_block_sizes_get_their_own_layouts():
    step = StepMetadata.build([1, 1], [40, 64])
    small = step.for_group([[1, 2, 3], [4, 5, 6, 7]], 16)
    large = step.for_group([[8, 9], [10, 11]], 32)
    assert torch_plan(small, None).gather_block_ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert torch_plan(large, None).gather_block_ids.tolist() == [8, 9, 10, 11]
    assert torch_plan(small, None).sequences is not torch_plan(large, None).sequences
    assert large.slot_mapping.tolist() == [9 * 32 + 7, 11 * 32 + 31]


def test_a_step_builds_all_its_groups_at_once_as_each_would_be_built_alone():
    """build_step_metadata pads the tables of every group of one block size to one width and computes
    their slots together: each group's table and slots equal its own for_group's (at that width),
    with moved blocks (negative) and null blocks not stored, and groups of another size apart."""
    query_lens, seq_lens = [1, 6, 1], [40, 6, 90]
    tables = [
        [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10]],  # full attention
        [[0, 2, -3], [4], [0, 0, 0, 0, 11, 12]],  # a window: null blocks, a block moved this step
        [[13, 14], [15], [16, 17, 18]],  # blocks of 32
    ]
    built = build_step_metadata(query_lens, seq_lens, tables, [16, 16, 32], [torch.device("cpu")])
    assert len(built) == 3 and built[0].step is built[1].step is built[2].step
    for group, (table, block_size) in enumerate(zip(tables, [16, 16, 32], strict=True)):
        alone = StepMetadata.build(query_lens, seq_lens).for_group(table, block_size)
        assert built[group].block_table.tolist() == alone.block_table.tolist()
        assert built[group].slot_mapping.tolist() == alone.slot_mapping.tolist()
        assert built[group].block_table_rows == table
    assert built[1].slot_mapping.tolist() == [-1, *(4 * 16 + i for i in range(6)), 12 * 16 + 9]
    assert built[1].block_table[0].tolist() == [0, 2, 3, 0, 0, 0]
    with pytest.raises(ValueError, match="sequence 2: 2 blocks of 32 cannot hold 90 tokens"):
        build_step_metadata(query_lens, seq_lens, [tables[0], [[1, 2], [3], [4, 5]]], [16, 32], ["cpu"])


def test_a_step_of_decode_rows_only_maps_each_row_to_its_last_slot():
    """Decode rows' slots are looked up in Python (not through the tensor index): the same rule, a null or
    moved (negative) entry at the row's position is not stored."""
    seq_lens = [40, 1, 90, 33]
    tables = [[[0, 2, -3], [4], [0, 0, 0, 0, 11, 12], [7, 8, 9]], [[13, 14], [15], [16, 17, -18], [0, 19]]]
    built = build_step_metadata([1] * 4, seq_lens, tables, [16, 32], [torch.device("cpu")])
    assert built[0].slot_mapping.tolist() == [-1, 4 * 16, 12 * 16 + 9, 9 * 16]
    assert built[1].slot_mapping.tolist() == [14 * 32 + 7, 15 * 32, -1, 19 * 32]
    assert built[0].block_table.tolist()[0] == [0, 2, 3, 0, 0, 0] and built[1].block_table.tolist()[2] == [16, 17, 18]
    # The same rows with one more row in the step go through the tensor path: the decode rows agree.
    mixed = StepMetadata.build([1, 1, 1, 1, 2], [*seq_lens, 2]).for_group([*tables[0], [5]], 16)
    assert mixed.slot_mapping.tolist()[:4] == built[0].slot_mapping.tolist()


def test_a_group_table_for_another_steps_sequences_is_refused():
    step = StepMetadata.build([1, 1], [40, 64])
    with pytest.raises(ValueError, match="the block table has 3 rows for the step's 2 sequences"):
        step.for_group([[1, 2, 3], [4, 5, 6, 7], [8]], 16)
    with pytest.raises(ValueError, match="sequence 0: 2 blocks of 16 cannot hold 41 tokens"):
        StepMetadata.build([1, 1], [41, 64]).for_group([[1, 2], [4, 5, 6, 7]], 16)
