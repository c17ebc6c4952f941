"""Latent attention layers in a step (patches/latent.py): the cache a step passes the model, and each layer's
up-projection as the attention op reads it.

Such a layer hands its cache the step's latent and rotary-key rows (`cache.update(latent, rotary_key, layer_idx)`)
and expands whatever the cache returns into its keys and values. `StepKVCache.update` stores the rows into the
layer's pages (`store_kv`, at the step's slot mapping: K rows of the latent then the rotary key, whose latent is
also the V row) and returns them as given: the layer expands only the
step's rows, and its attention op reads the whole contexts from the pages and attends through the up-projection
(kernels/contexts.py). Every other layer's update passes its K/V through (the paged attention op keeps them), as
`PassThroughCache` does.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridkv.kernels import store_kv
from hybridkv.patches.attention import LatentUp, StepContext
from hybridkv.patches.latent import LatentLayer
from hybridkv.patches.probe import PassThroughCache


def latent_ups(model: torch.nn.Module, latent: dict[int, LatentLayer]) -> dict[int, LatentUp]:
    """Each latent layer's up-projection (`LatentLayer.up_proj`, a qualified name) as its owner module and name."""
    named = dict(model.named_modules())
    ups = {}
    for layer_idx, found in latent.items():
        owner, _, name = found.up_proj.rpartition(".")
        ups[layer_idx] = LatentUp(named[owner], name, found.nope_dim)
    return ups


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
        # [1, 1, rows, dim] -> [rows, 1, dim]: a K row is the latent then the rotary key; the V rows, a view of the
        # K rows' latents, get the same bytes again.
        latent = key_states[0].transpose(0, 1)
        row = torch.cat([latent, value_states[0].transpose(0, 1)], dim=-1)
        store_kv(row, latent, layer.key_cache, layer.value_cache, metadata, layer.k_scale, layer.v_scale)
        return key_states, value_states


def cache_argument(model: torch.nn.Module) -> str:
    """The name the model's forward takes its cache by: `cache` (transformers 5.24), else `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
