"""Latent attention layers in a step (hybridkv/patches/latent.py): the cache a step passes the model, and each layer's
up-projection as the attention op reads it.

Such a layer hands its cache the step's latent and rotary-key rows (`cache.update(latent, rotary_key, layer_idx)`)
and expands whatever the cache returns into its keys and values. `StepKVCache.update` stores the rows into the
layer's pages (`torch.ops.hybridkv.store_latent`, hybridkv/patches/attention.py: K rows of the latent then the rotary
key, whose latent is also the V row, at the step's slot mapping) and returns them: the layer expands only the step's
rows, and its attention op reads the whole contexts from the pages and attends through the up-projection
(hybridkv/kernels/latent_attention.py). Every other layer's update passes its K/V through (the paged attention op
keeps them), as `PassThroughCache` does."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hybridkv.patches.attention import LatentUp
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
    """The cache a step passes a model with latent attention layers (`latent_layers`, layer indices): their updates
    go to the running step's pages (`store_latent`, which finds them as the attention op does)."""

    def __init__(self, config: Any, latent_layers: frozenset[int] = frozenset()):
        super().__init__(config=config)
        self.latent_layers = latent_layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx not in self.latent_layers:
            return key_states, value_states
        return torch.ops.hybridkv.store_latent(key_states, value_states, layer_idx)


def cache_argument(model: torch.nn.Module) -> str:
    """The name the model's forward takes its cache by: `cache` (transformers 5.24), else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
