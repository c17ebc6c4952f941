"""Latent attention layers (multi-head latent attention, MLA: DeepSeek V2/V3, Kimi, GLM-4 MoE Lite, MiniCPM3, ...),
found by what a layer does at patch time, not by its name.

Such a layer computes one compressed latent per token (`kv_lora_rank` values) and one rotary key shared by every
head (`qk_rope_head_dim`), hands those two to its cache (`cache.update(latent, rotary_key, layer_idx)`, as
transformers' MLA modules do), and only then expands what the cache returns into per-head keys and values
through one linear up-projection (`kv_b_proj`). hybridkv pages what the layer hands its cache, 576 values a token
for DeepSeek's layout instead of the expanded heads' 5,120 or more, as vLLM does: one "head" whose K row is the
latent then the rotary key and whose V row is a view of the latent (`LayerSpec(num_kv_heads=1, head_dim=latent +
rotary, v_head_dim=latent, value_in_key=True)`). In a step, the cache's update stores the step's rows
(hybridkv/execution/latent_layers.py), and the attention op attends over the pages through the up-projection
(`LayerKV.latent`, hybridkv/kernels/latent_attention.py).

A layer is latent when the probe forward shows both: a linear layer inside its attention module whose output, per
head, is exactly the keys' leading columns and the values the attention function received (`up_projection`), and,
in a forward with a recording cache, one `update` of that layer whose first tensor is that linear layer's input and
whose second, repeated over the heads, is the keys' remaining columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LatentLayer:
    """One latent attention layer as hybridkv pages it: K rows of `latent_dim` + `rope_dim` values, and the largest
    magnitudes of each part seen by the probe (fp8 pages' scale: one for the whole row)."""

    layer_idx: int
    latent_dim: int
    rope_dim: int
    latent_amax: float
    rope_amax: float
    # The up-projection's qualified name in the model, and how many of each head's key columns it gives (the rest
    # of a key is the rotary key); what it gives after them is the head's value.
    up_proj: str = ""
    nope_dim: int = 0


def up_projection(call: Any, linears: dict[int, tuple[torch.nn.Module, torch.Tensor, torch.Tensor]]):
    """The linear layer inside `call.module` whose last output, split per head, is the call's keys' leading columns
    and its values, with the number of those key columns; None where there is none."""
    key, value = call.key, call.value
    if key.dim() != 4 or value.dim() != 4 or key.shape[0] != 1:
        return None
    _, heads, tokens, key_dim = key.shape
    value_dim = value.shape[-1]
    inside = {id(module) for module in call.module.modules()}
    for module_id, (module, _, output) in linears.items():
        if module_id not in inside or output.shape[-1] % heads or output.numel() != tokens * output.shape[-1]:
            continue
        per_head = output.shape[-1] // heads
        nope_dim = per_head - value_dim
        if not 0 < nope_dim < key_dim:
            continue
        split = output.reshape(1, tokens, heads, per_head).transpose(1, 2)
        if torch.equal(split[..., :nope_dim], key[..., :nope_dim]) and torch.equal(split[..., nope_dim:], value):
            return module, nope_dim
    return None


def latent_layer(call: Any, found: tuple[torch.nn.Module, int], updates: list[tuple[torch.Tensor, torch.Tensor]],
                 linear_input: torch.Tensor) -> LatentLayer | str:  # fmt: skip
    """The latent layer `call`'s module is, given its up-projection (`found`, from `up_projection`), the input that
    projection received, and the layer's cache updates in a forward with a recording cache; or why it cannot be
    paged in latent space."""
    module, nope_dim = found
    key = call.key
    _, heads, tokens, key_dim = key.shape
    if len(updates) != 1:
        return (
            f"its keys and values are a linear up-projection of a latent ({type(module).__name__} "
            f"{tuple(linear_input.shape[-1:])} -> {heads} heads), but the layer does not hand that latent to its cache "
            f"once per forward ({len(updates)} cache updates), so hybridkv cannot page it"
        )
    latent, rope = updates[0]
    latent_dim, rope_dim = latent.shape[-1], rope.shape[-1]
    shapes_fit = latent.shape == (1, 1, tokens, latent_dim) and rope.shape == (1, 1, tokens, rope_dim)
    if not shapes_fit or rope_dim != key_dim - nope_dim:
        return (
            f"its cache update passes {tuple(latent.shape)} and {tuple(rope.shape)}, not one latent and one rotary key "
            f"of {key_dim - nope_dim} values per token, so hybridkv cannot page it in latent space"
        )
    same_latent = linear_input.numel() == latent.numel() and torch.equal(linear_input.reshape(latent.shape), latent)
    same_rope = torch.equal(key[..., nope_dim:], rope.expand(1, heads, tokens, rope_dim))
    if not (same_latent and same_rope):
        return (
            "what it hands its cache is not what it expands into keys and values (the up-projection's input and the "
            "keys' rotary columns), so hybridkv cannot page it in latent space"
        )
    return LatentLayer(call.module.layer_idx, latent_dim, rope_dim, _amax(latent), _amax(rope), nope_dim=nope_dim)


def _amax(tensor: torch.Tensor) -> float:
    return float(tensor.detach().abs().amax().float())
