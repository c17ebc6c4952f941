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


def test_gemma3_27b_wastes_three_padding_slots():
    windows = pattern(60, 6) + [512, 512]  # 62 layers: 52 sliding, 10 full
    assert windows.count(None) == 10
    assert summary(windows) == (13, 5, 3)


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
    assert config.padding_fraction == pytest.approx(3 / 65)


def test_layers_of_different_kv_shapes_are_refused():
    mixed = [LayerSpec(0, None, 2, 8, 2), LayerSpec(1, 64, 2, 16, 2)]
    with pytest.raises(ValueError, match=r"one K/V shape.*layer 0: 2 kv heads of dim 8; layer 1: 2 kv heads of dim 16"):
        group_layers(mixed, block_size=16)


def test_no_layers_is_a_clear_error():
    with pytest.raises(ValueError, match="no attention layers"):
        group_layers([], block_size=16)
