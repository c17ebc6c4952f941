"""Layer kinds from a Hugging Face config: which layers attend fully, which through a sliding window and
which only within their chunk (chunked local attention, Llama 4's `attention_chunk_size`).

transformers' configs describe hybrid layouts with `layer_types` (Gemma 2 alternating, Gemma 3
5 local : 1 global, GPT-OSS alternating, Cohere2 3 : 1, OLMo 3, Ministral; Qwen2/3 build it from
`use_sliding_window` and `max_window_layers`). Configs without it (Llama, Mistral, Phi-3) use one rule
for every layer: a window when `sliding_window` is set, full attention otherwise.

The config is only the first witness: `hybridkv/patches/inspection.py` checks each layer's kind against what
its attention module really does before anything is served.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.memory.kv_spec import LayerSpec

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"
SUPPORTED_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION)
# Layers that keep a per-request state (linear attention, SSM, short convolution) instead of K/V: served when
# the probe sees the state go through transformers' cache interface (hybridkv/patches/inspection.py).
STATE_LAYER_TYPES = frozenset({"linear_attention", "conv", "mamba"})
# A layer that attends and keeps a state side by side (Falcon-H1 attends fully; Zaya's attention projects q/k/v
# through a state of its own, over every key or a sliding window), and layers that do neither (Nemotron-H's MLP
# and MoE layers: nothing to cache).
HYBRID_SLIDING = "hybrid_sliding"
HYBRID_LAYER_TYPES = frozenset({"hybrid", HYBRID_SLIDING})
STATELESS_LAYER_TYPES = frozenset({"mlp", "moe"})


@dataclass(frozen=True, slots=True)
class ConfigLayer:
    """What the config declares for one decoder layer: its `layer_types` entry, the window of a
    sliding layer and the chunk size of a chunked one (None otherwise)."""

    layer_type: str
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


def text_config(config: Any) -> Any:
    """The decoder's config: the text part of a multimodal config, the config itself otherwise."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def decoder_layers(model: torch.nn.Module) -> Iterator[tuple[int, torch.nn.Module]]:
    """(index, module) of each decoder layer: the items of every list of `num_hidden_layers` modules in the model."""
    num_layers = text_config(model.config).num_hidden_layers
    for layers in model.modules():
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == num_layers:
            yield from enumerate(layers)


def config_layers(config: Any) -> list[ConfigLayer]:
    """Per decoder layer, as the config declares it. Layer types hybridkv does not implement are
    returned as they are (the caller decides how to refuse them)."""
    config = text_config(config)
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        if getattr(config, "use_sliding_window", True) is False or window is None:
            return [ConfigLayer(FULL_ATTENTION)] * num_layers
        return [ConfigLayer(SLIDING_ATTENTION, window)] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"config.layer_types has {len(layer_types)} entries for {num_layers} layers; fix the config")
    layers = []
    for layer_idx, layer_type in enumerate(layer_types):
        if layer_type in (SLIDING_ATTENTION, HYBRID_SLIDING):
            if window is None:
                raise ValueError(
                    f"layer {layer_idx} is a {layer_type} layer but config.sliding_window is None; "
                    "set config.sliding_window"
                )
            layers.append(ConfigLayer(layer_type, window))
        elif layer_type == CHUNKED_ATTENTION:
            chunk_size = getattr(config, "attention_chunk_size", None)
            if not chunk_size:
                raise ValueError(
                    f"layer {layer_idx} is a chunked_attention layer but config.attention_chunk_size is not set; "
                    "set config.attention_chunk_size"
                )
            layers.append(ConfigLayer(CHUNKED_ATTENTION, attention_chunk_size=chunk_size))
        else:
            layers.append(ConfigLayer(layer_type))
    return layers


def supported_layers(config: Any) -> list[ConfigLayer]:
    """`config_layers`, with a ValueError for a layer type hybridkv does not implement, or for a
    bidirectional (encoder) config."""
    if getattr(text_config(config), "use_bidirectional_attention", False) is True:
        raise ValueError("this config uses bidirectional attention (an encoder); hybridkv serves causal decoders only")
    layers = config_layers(config)
    for layer_idx, layer in enumerate(layers):
        if layer.layer_type not in SUPPORTED_LAYER_TYPES:
            raise ValueError(
                f"layer {layer_idx} has layer type {layer.layer_type!r}; hybridkv supports "
                + ", ".join(repr(kind) for kind in SUPPORTED_LAYER_TYPES)
                + " layers"
            )
    return layers


def layer_windows(config: Any) -> list[int | None]:
    """Per layer: None for full attention, W for a sliding window of W tokens (and None for a chunked
    layer: see `supported_layers`)."""
    return [layer.sliding_window for layer in supported_layers(config)]


def layer_specs_from_config(config: Any, dtype: torch.dtype | str | None = None) -> list[LayerSpec]:
    """One LayerSpec per decoder layer from the config alone (for planning memory from a published
    config; a loaded model's layout comes from `patches.inspection.inspect_model`). dtype defaults to
    the config's dtype (float32 if unset)."""
    config = text_config(config)
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    dtype = dtype if dtype is not None else getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    return [
        LayerSpec(
            layer_idx,
            layer.sliding_window,
            num_kv_heads,
            head_dim,
            dtype.itemsize,
            attention_chunk_size=layer.attention_chunk_size,
        )
        for layer_idx, layer in enumerate(supported_layers(config))
    ]
