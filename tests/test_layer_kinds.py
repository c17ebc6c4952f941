import types

import pytest
import torch
from transformers import (
    Cohere2Config,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MinistralConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from hybridkv.patches.layer_kinds import ConfigLayer, config_layers, layer_specs_from_config, layer_windows

S = 16  # a window smaller than test prompts


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (LlamaConfig(num_hidden_layers=3), [None, None, None]),
        (MistralConfig(num_hidden_layers=3, sliding_window=S), [S, S, S]),
        (Phi3Config(num_hidden_layers=2, sliding_window=S), [S, S]),
        (
            MinistralConfig(
                num_hidden_layers=4,
                head_dim=16,
                sliding_window=S,
                layer_types=["sliding_attention", "full_attention"] * 2,
            ),
            [S, None, S, None],
        ),
        (Gemma2Config(num_hidden_layers=4, sliding_window=S), [S, None, S, None]),
        (Gemma3TextConfig(num_hidden_layers=7, sliding_window=S), [S, S, S, S, S, None, S]),
        (GptOssConfig(num_hidden_layers=4, sliding_window=S), [S, None, S, None]),
        (Cohere2Config(num_hidden_layers=8, sliding_window=S), [S, S, S, None, S, S, S, None]),
        (
            Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=S, max_window_layers=2),
            [None, None, S, S],
        ),
        (Qwen2Config(num_hidden_layers=3, sliding_window=S), [None, None, None]),
        (
            Qwen3Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=S, max_window_layers=1),
            [None, S, S],
        ),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, list) else "",
)
def test_layer_windows_follow_each_family(config, expected):
    assert layer_windows(config) == expected


def test_specs_read_heads_head_dim_and_dtype():
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
    (first, _) = layer_specs_from_config(config, torch.bfloat16)
    assert (first.num_kv_heads, first.head_dim, first.dtype_bytes) == (2, 8, 2)
    assert first.kv_bytes_per_token == 2 * 2 * 8 * 2
    assert first.page_bytes(16) == 16 * 64


def test_explicit_head_dim_wins_over_hidden_size():
    config = Gemma3TextConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, head_dim=32)
    assert layer_specs_from_config(config, "float16")[0].head_dim == 32


def test_unknown_layer_type_names_the_supported_ones():
    config = LlamaConfig(num_hidden_layers=2)
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(
        ValueError, match=r"'linear_attention'.*supports 'full_attention', 'sliding_attention', 'chunked_attention'"
    ):
        layer_windows(config)


def test_chunked_layers_take_the_configs_chunk_size():
    config = LlamaConfig(num_hidden_layers=2)
    config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"set config\.attention_chunk_size"):
        layer_specs_from_config(config)
    config.attention_chunk_size = 8192
    specs = layer_specs_from_config(config)
    assert [(spec.sliding_window, spec.attention_chunk_size) for spec in specs] == [(None, 8192), (None, None)]


def test_sliding_layer_without_window_is_a_clear_error():
    config = LlamaConfig(num_hidden_layers=1)
    config.layer_types = ["sliding_attention"]
    with pytest.raises(ValueError, match=r"set config\.sliding_window"):
        layer_windows(config)


def test_config_layers_pass_unimplemented_layer_types_through_for_the_probe_to_refuse():
    config = LlamaConfig(num_hidden_layers=3)
    config.layer_types = ["linear_attention", "sliding_attention", "full_attention"]
    config.sliding_window = S
    assert config_layers(config) == [
        ConfigLayer("linear_attention"),
        ConfigLayer("sliding_attention", S),
        ConfigLayer("full_attention"),
    ]


def test_a_zero_window_means_no_window():
    config = MistralConfig(num_hidden_layers=2, sliding_window=0)
    assert layer_windows(config) == [None, None]


def test_bidirectional_attention_over_images_only_is_causal_for_text():
    # Gemma 4's text config: bidirectional over image tokens only, so text-only use is causal.
    config = types.SimpleNamespace(
        num_hidden_layers=2,
        sliding_window=S,
        layer_types=["sliding_attention", "full_attention"],
        use_bidirectional_attention="vision",
    )
    assert layer_windows(config) == [S, None]
    config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="bidirectional attention"):
        layer_windows(config)
