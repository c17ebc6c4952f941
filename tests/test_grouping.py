import pytest

from hybridkv.grouping import group_layers
from hybridkv.kv_spec import LayerSpec

from alloc_helpers import specs


def pattern(num_layers: int, full_every: int, window: int = 512) -> list[int | None]:
    """Gemma-style layout: every full_every-th layer is full attention."""
    return [None if (i + 1) % full_every == 0 else window for i in range(num_layers)]


def summary(windows):
    config = group_layers(specs(windows), block_size=16)
    return config.group_size, len(config.groups), config.padding_layers


def test_three_sliding_to_one_full_makes_four_groups_of_nine():
    assert summary(pattern(36, 4)) == (9, 4, 0)


def test_gemma3_12b_makes_six_groups_of_eight():
    assert summary(pattern(48, 6)) == (8, 6, 0)


def test_gemma3_27b_keeps_padding_out_of_the_full_attention_group():
    windows = pattern(60, 6) + [512, 512]  # 62 layers: 52 sliding, 10 full
    assert windows.count(None) == 10
    assert summary(windows) == (10, 7, 8)
    config = group_layers(specs(windows), block_size=16)
    assert [g.padding_slots for g in config.groups if g.sliding_window is None] == [0]


def test_full_attention_padding_costs_more_than_extra_groups():
    # 10 full + 52 sliding at 32k tokens, window 1,024, 16-token blocks: the full group holds 2,048
    # blocks a request, each sliding group 65. Size 13 (3 padding slots in the full group) would hold
    # 26% more than the ideal; size 10 holds 2% more.
    def layer_pages(group_size, groups_by_kind):
        return sum(count * blocks * group_size for count, blocks in groups_by_kind)

    ideal = 10 * 2048 + 52 * 65
    assert layer_pages(13, [(1, 2048), (4, 65)]) / ideal == pytest.approx(1.2575, abs=1e-3)
    assert layer_pages(10, [(1, 2048), (6, 65)]) / ideal == pytest.approx(1.0218, abs=1e-3)


def test_all_full_is_one_group():
    assert summary([None] * 12) == (12, 1, 0)


def test_all_sliding_is_one_group():
    assert summary([64] * 12) == (12, 1, 0)


def test_one_full_and_one_sliding_are_two_groups_of_one():
    assert summary([None, 64]) == (1, 2, 0)


def test_two_window_sizes_are_two_kinds():
    config = group_layers(specs([32, 64, 32, 64]), block_size=16)
    assert [(g.sliding_window, g.layer_indices) for g in config.groups] == [(32, (0, 2)), (64, (1, 3))]


def test_groups_list_layers_in_order_and_slots_map_back():
    config = group_layers(specs(pattern(8, 4)), block_size=16)
    assert [(g.sliding_window, g.layer_indices) for g in config.groups] == [
        (512, (0, 1)),
        (512, (2, 4)),
        (512, (5, 6)),
        (None, (3, 7)),
    ]
    assert config.layer_slot(4) == (1, 1)
    assert config.layer_slot(7) == (3, 1)


def test_block_bytes_cover_one_page_in_every_slot():
    config = group_layers(specs(pattern(36, 4)), block_size=16)
    # 9 slots x 16 tokens x (K+V) x 2 heads x 8 dims x 2 bytes
    assert config.block_bytes == 9 * 16 * 2 * 2 * 8 * 2


def test_padding_fraction_is_reported():
    config = group_layers(specs(pattern(60, 6) + [512, 512]), block_size=16)
    assert config.padding_fraction == pytest.approx(8 / 70)


def test_a_kind_of_half_the_bytes_per_token_gets_blocks_of_twice_the_tokens():
    mixed = [LayerSpec(0, None, 2, 8, 2), LayerSpec(1, 64, 2, 16, 2)]  # 64 and 128 bytes per token
    config = group_layers(mixed, block_size=16)
    assert [(g.sliding_window, g.block_size, g.slot_bytes) for g in config.groups] == [(None, 32, 2048), (64, 16, 2048)]
    assert config.block_bytes == 2048 and config.padding_fraction == 0
    assert config.hit_alignment == 32 and config.kv_bytes_per_token == 192


def test_one_block_size_pads_the_narrower_slots_instead():
    mixed = [LayerSpec(0, None, 2, 8, 2), LayerSpec(1, 64, 2, 16, 2)]
    config = group_layers(mixed, block_size=16, uniform_block_size=True)
    assert [(g.block_size, g.slot_bytes) for g in config.groups] == [(16, 2048), (16, 2048)]
    assert config.padding_fraction == pytest.approx(0.25)  # the full layer writes 1,024 of its 2,048 bytes
    assert config.hit_alignment == 16


def test_a_ratio_that_is_not_whole_pads_the_page_tail():
    mixed = [LayerSpec(0, None, 3, 8, 2), LayerSpec(1, 64, 2, 8, 2)]  # 96 and 64 bytes per token
    config = group_layers(mixed, block_size=16)
    assert [(g.block_size, g.slot_bytes) for g in config.groups] == [(16, 1536), (16, 1024)]
    assert config.padding_fraction == pytest.approx(512 / 3072)


def test_layers_of_one_window_and_different_bytes_are_different_kinds():
    layers = [LayerSpec(0, 64, 2, 8, 2), LayerSpec(1, 64, 4, 8, 2), LayerSpec(2, 64, 2, 8, 2)]
    config = group_layers(layers, block_size=8)
    assert [(g.layer_indices, g.block_size) for g in config.groups] == [((0, 2), 16), ((1,), 8)]


def test_key_and_value_head_dims_may_differ_when_the_bytes_per_token_match():
    layers = [LayerSpec(0, None, 2, 24, 2, v_head_dim=8), LayerSpec(1, 64, 2, 16, 2)]
    config = group_layers(layers, block_size=16)
    assert config.block_bytes == 16 * 2 * 32 * 2
    assert config.kv_bytes_per_token == 2 * 2 * 32 * 2


def gemma3n_e4b() -> list[LayerSpec]:
    """Gemma 3n E4B's published text layout (transformers' Gemma3nTextConfig defaults document it):
    35 layers, 4 sliding (window 512) : 1 full, 2 kv heads of 256, bf16; layers 20-34 reuse the K/V of
    layer 18 (the last sliding layer before them) or 19 (the last full one)."""
    windows = [None if (i + 1) % 5 == 0 else 512 for i in range(35)]
    return [
        LayerSpec(i, window, 2, 256, 2, kv_source=None if i < 20 else (19 if window is None else 18))
        for i, window in enumerate(windows)
    ]


def test_gemma3n_e4b_shared_layers_hold_no_pages():
    config = group_layers(gemma3n_e4b(), block_size=16)
    assert [(g.sliding_window, len(g.layer_indices)) for g in config.groups] == [(512, 4)] * 4 + [(None, 4)]
    assert config.padding_layers == 0
    assert len(config.shared_layers) == 15 and config.shared_layers[34] == 19 and config.shared_layers[33] == 18
    assert all(layer < 20 for g in config.groups for layer in g.layer_indices)
    # 20 of 35 layers hold K/V: 2 heads x (256 + 256) x 2 bytes each, 43% less than a page per layer.
    assert config.kv_bytes_per_token == 20 * 2048
    assert 1 - config.kv_bytes_per_token / (35 * 2048) == pytest.approx(0.4286, abs=1e-4)
    assert config.block_bytes == 4 * 16 * 2048


def test_a_shared_layer_cannot_see_further_back_than_its_source_keeps():
    layers = [LayerSpec(0, 64, 2, 8, 2), LayerSpec(1, None, 2, 8, 2, kv_source=0)]
    with pytest.raises(ValueError, match=r"layer 1 attends further back \(full attention\) than layer 0"):
        group_layers(layers, block_size=16)
    chained = [
        LayerSpec(0, None, 2, 8, 2),
        LayerSpec(1, None, 2, 8, 2, kv_source=0),
        LayerSpec(2, None, 2, 8, 2, kv_source=1),
    ]
    with pytest.raises(ValueError, match="layer 2 reads the K/V of layer 1, which holds no pages"):
        group_layers(chained, block_size=16)


def test_no_layers_is_a_clear_error():
    with pytest.raises(ValueError, match="no attention layers"):
        group_layers([], block_size=16)
