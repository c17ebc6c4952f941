"""Latent attention layers in a step (patches/latent.py): the cache a step passes the model.

Such a layer hands its cache the step's latent and rotary-key rows (`cache.update(latent, rotary_key, layer_idx)`)
and expands whatever the cache returns into its keys and values. `StepKVCache.update` stores the rows into the
layer's K and V slots (`store_kv`, at the step's slot mapping) and returns each sequence's whole context read back
from them (kernels/contexts.py), as transformers' own cache returns the past with the new rows: the layer then
computes what it computes with its own cache, and the attention op attends over those dense rows (`LayerKV.dense`).
Every other layer's update passes its K/V through (the paged attention op keeps them), as `PassThroughCache` does.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridkv.kernels import store_kv
from hybridkv.kernels.contexts import gather_contexts
from hybridkv.patches.attention import StepContext
from hybridkv.patches.probe import PassThroughCache


class StepKVCache(PassThroughCache):
    """The cache a step passes a model with latent attention layers (`latent_layers`, layer indices) whose pages and
    metadata are in `context`."""

    def __init__(self, config: Any, context: StepContext | None = None, latent_layers: frozenset[int] = frozenset()):
        super().__init__(config=config)
        self.context = context
        self.latent_layers = latent_layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx not in self.latent_layers:
            return key_states, value_states
        context = self.context
        layer = context.layers[layer_idx]
        metadata = context.metadata[layer.metadata_index]
        # [1, 1, rows, dim] -> [rows, 1, dim]: one "head"
        store_kv(
            key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), layer.key_cache, layer.value_cache,
            metadata, layer.k_scale, layer.v_scale,
        )  # fmt: skip
        latent = gather_contexts(layer.key_cache, metadata, layer.k_scale, key_states.dtype)
        rotary = gather_contexts(layer.value_cache, metadata, layer.v_scale, value_states.dtype)
        return latent[None, None], rotary[None, None]


def cache_argument(model: torch.nn.Module) -> str:
    """The name the model's forward takes its cache by: `cache` (transformers 5.24), else `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
