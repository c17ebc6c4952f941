import pytest

from hybridkv.memory import layouts
from hybridkv.memory.coordinator import blocks_for_request
from hybridkv.memory.grouping import group_layers
from hybridkv.memory.kv_spec import LayerSpec

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


def test_groups_list_layers_in_order():
    config = group_layers(specs(pattern(8, 4)), block_size=16)
    assert [(g.sliding_window, g.layer_indices) for g in config.groups] == [
        (512, (0, 1)),
        (512, (2, 4)),
        (512, (5, 6)),
        (None, (3, 7)),
    ]


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


def test_gemma3n_e4b_shared_layers_hold_no_pages():
    config = group_layers(layouts.gemma3n_e4b(), block_size=16)
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


# ---- published layouts (hybridkv/memory/layouts.py, from their config.json values) -----------------------


def summarize(specs, block_size=16):
    """(kind, layers, block size) per group, padding slots, page bytes, bytes per token held and the
    bytes per token a cache with a page for every layer would hold."""
    config = group_layers(specs, block_size)
    kinds = [
        (
            g.sliding_window or (f"chunk {g.attention_chunk_size}" if g.attention_chunk_size else "full"),
            len(g.layer_indices),
            g.block_size,
        )
        for g in config.groups
    ]
    every_layer = sum(spec.kv_bytes_per_token for spec in specs)
    return kinds, config.padding_layers, config.block_bytes, config.kv_bytes_per_token, every_layer


def test_gemma4_31b_gives_its_narrower_full_layers_blocks_of_twice_the_tokens():
    # 50 sliding layers of 16 x (256 + 256) bf16 = 16,384 bytes a token; 10 full of 4 x (512 + 512) = 8,192.
    kinds, padding, page, per_token, every_layer = summarize(layouts.gemma4_31b())
    assert kinds == [(1024, 10, 16)] * 5 + [("full", 10, 32)]
    assert padding == 0 and page == 10 * 16 * 16384 == 2_621_440
    assert per_token == every_layer == 50 * 16384 + 10 * 8192 == 901_120


def test_gemma4_26b_a4b_has_no_padding_at_all():
    kinds, padding, page, per_token, _ = summarize(layouts.gemma4_26b_a4b())
    assert kinds == [(1024, 5, 16)] * 5 + [("full", 5, 32)]
    assert padding == 0 and page == 5 * 16 * 8192 and per_token == 25 * 8192 + 5 * 4096 == 225_280


def test_gemma4_e4b_shares_18_layers_and_gives_its_sliding_layers_the_larger_blocks():
    # Full layers keep 2 kv heads (no k_eq_v) of 512: 4,096 bytes a token, twice a sliding layer's 2,048.
    specs = layouts.gemma4_e4b()
    kinds, padding, page, per_token, every_layer = summarize(specs)
    assert kinds == [(512, 4, 32)] * 5 + [("full", 4, 16)]
    assert padding == 0 and page == 4 * 16 * 4096
    assert per_token == 20 * 2048 + 4 * 4096 == 57_344 and every_layer == 35 * 2048 + 7 * 4096 == 100_352
    assert 1 - per_token / every_layer == pytest.approx(0.4286, abs=1e-4)
    assert {spec.kv_source for spec in specs[24:]} == {22, 23}


def test_mimo_v2_flash_sliding_layers_of_twice_the_heads_get_the_engine_block_size():
    # Sliding: 8 x (192 + 128) bf16 = 5,120 bytes a token; full: 4 x 320 x 2 = 2,560.
    kinds, padding, page, per_token, _ = summarize(layouts.mimo_v2_flash())
    assert kinds == [("full", 9, 32)] + [(129, 9, 16)] * 4 + [(129, 3, 16)]
    assert padding == 6 and page == 9 * 16 * 5120 and per_token == 39 * 5120 + 9 * 2560 == 222_720


def test_llama4_scout_chunked_layers_are_a_kind_of_their_own():
    specs = layouts.llama4_scout()
    kinds, padding, page, per_token, _ = summarize(specs)
    assert kinds == [("chunk 8192", 12, 16)] * 3 + [("full", 12, 16)]
    assert padding == 0 and page == 12 * 16 * 4096 and per_token == 48 * 4096
    # At 128k tokens a chunked group holds at most a chunk's blocks plus one, whatever the prefill chunk.
    config = group_layers(specs, 16)
    held = blocks_for_request(config, 131072) * config.block_bytes
    full_cache = 131072 * per_token
    assert held == (3 * (512 + 1) + 8192) * page
    assert full_cache / held == pytest.approx(3.367, abs=1e-3)  # 48 / 12 = 4x is the limit


def test_uniform_block_size_would_waste_a_quarter_of_gemma4_31b_pages():
    padded = group_layers(layouts.gemma4_31b(), 16, uniform_block_size=True)
    assert [g.block_size for g in padded.groups] == [16] * 6
    assert padded.padding_fraction == pytest.approx(1 / 12)  # one group of six is half padding
