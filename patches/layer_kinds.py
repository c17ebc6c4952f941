"""Layer kinds from a Hugging Face config: which layers attend fully and which through a window.

transformers' own configs describe hybrid layouts with `layer_types` (Gemma 2 alternating, Gemma 3
5 local : 1 global, GPT-OSS alternating, Cohere2 3 : 1, Ministral, Qwen2/3 from `use_sliding_window`
and `max_window_layers`). Configs without it (Llama, Mistral, Phi-3) use one rule for every layer:
a window when `sliding_window` is set, full attention otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridkv.kv_spec import LayerSpec

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def layer_windows(config: Any) -> list[int | None]:
    """Per layer: None for full attention, W for a sliding window of W tokens."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = config.num_hidden_layers
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("this config uses bidirectional attention (an encoder); hybridkv serves causal decoders only")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        return [window] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"config.layer_types has {len(layer_types)} entries for {num_layers} layers; fix the config")
    windows: list[int | None] = []
    for layer_idx, layer_type in enumerate(layer_types):
        if layer_type == FULL_ATTENTION:
            windows.append(None)
        elif layer_type == SLIDING_ATTENTION:
            if window is None:
                raise ValueError(
                    f"layer {layer_idx} is a sliding_attention layer but config.sliding_window is None; "
                    "set config.sliding_window"
                )
            windows.append(window)
        else:
            raise ValueError(
                f"layer {layer_idx} has layer type {layer_type!r}; hybridkv supports "
                f"{FULL_ATTENTION!r} and {SLIDING_ATTENTION!r} layers"
            )
    return windows


def layer_specs_from_config(config: Any, dtype: torch.dtype | str | None = None) -> list[LayerSpec]:
    """One LayerSpec per decoder layer. dtype defaults to the config's dtype (float32 if unset)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_heads = text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
    dtype = dtype if dtype is not None else getattr(text_config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    return [
        LayerSpec(layer_idx, window, num_kv_heads, head_dim, dtype.itemsize)
        for layer_idx, window in enumerate(layer_windows(text_config))
    ]
