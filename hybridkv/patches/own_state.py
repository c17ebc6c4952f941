"""State layers that keep their state on themselves, given a forward that keeps it through the cache instead.

transformers' RecurrentGemma keeps its recurrent blocks' states on the modules (`conv1d_state`,
`rg_lru.recurrent_states`) and only while `use_cache` is on: one state per module, whatever the batch, and none at
all in a step (hybridkv's forward runs with `use_cache=False`). Such a block is served through `cache_state_forward`:
its own layers and arithmetic, with the state read from and written to the step's cache (`get/update_conv_state`,
`get/update_recurrent_state`), which hybridkv holds per request in state slots (hybridkv/execution/state_layers.py).
With any other cache (the model's own generate, a plain forward) the block runs its own forward.

Which form computes which tokens follows generate: a prompt runs the block's prompt form (its convolution over the
chunk, the RG-LRU's linear scan), a decode token its decode form (the convolution as a sum over the last `width`
inputs); a later piece of a prompt, which generate never computes apart, continues the prompt form from the carried
state (the convolution over the state's columns and the chunk, taking the chunk's outputs: the same sums over the
same values). The RG-LRU's two forms are the same operations, `a * h + x`, one token or a loop of them.

`states_through_cache(model)` installs these forwards for the probe (and gives each block its decoder layer's index,
for the cache's calls); the model runner installs them for a step's segments while it lives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hybridkv.patches.layer_kinds import decoder_layers

# What a block keeps on itself and computes with: RecurrentGemma's (Griffin's) recurrent block.
_RECURRENT_BLOCK_PARTS = ("conv1d_state", "conv_1d", "rg_lru", "linear_x", "linear_y", "linear_out", "act_fn")


def keeps_own_state(module: torch.nn.Module) -> bool:
    """Whether `module` is a recurrent block that keeps its state on itself (RecurrentGemma's)."""
    return all(hasattr(module, name) for name in _RECURRENT_BLOCK_PARTS) and hasattr(module.rg_lru, "recurrent_states")


def cache_state_forward(module: torch.nn.Module) -> Callable[..., Any]:
    """`module`'s forward keeping its state through the cache when the cache is hybridkv's (module docstring); the
    module must have its decoder layer's `layer_idx`."""
    original = module.forward

    def forward(input_states, position_ids, attention_mask=None, use_cache=True, **kwargs):
        cache = kwargs.get("cache")
        if not getattr(cache, "holds_states_per_request", False):
            return original(input_states, position_ids, attention_mask, use_cache, **kwargs)
        return _recurrent_block(module, input_states, position_ids, cache), None

    forward.__wrapped__ = original
    return forward


def _recurrent_block(
    module: torch.nn.Module, input_states: torch.Tensor, position_ids: torch.Tensor, cache: Any
) -> torch.Tensor:
    """RecurrentGemma's recurrent block (its forward with `use_cache`) over the cache's state of this request."""
    layer_idx = module.layer_idx
    seq_len = input_states.shape[1]
    y_branch = module.act_fn(module.linear_y(input_states))
    x_branch = module.linear_x(input_states).transpose(1, 2)
    width = module.conv1d_width
    continues = getattr(cache, "continues_prompt", None)
    decode = seq_len == 1 and not (continues is not None and continues(layer_idx))
    full = cache.update_conv_state(x_branch, layer_idx, conv_kernel_size=width - 1)
    if decode:  # generate's decode: the last `width` inputs (a fresh state: zeros), summed against the kernel
        if full.shape[-1] < width:
            full = torch.nn.functional.pad(full, (width - full.shape[-1], 0))
        x_branch = (torch.sum(full * module.conv_1d.weight[:, 0, :], dim=-1) + module.conv_1d.bias).unsqueeze(-1)
    else:  # the prompt form: the convolution's outputs at the chunk's positions
        x_branch = module.conv_1d(full)[..., full.shape[-1] - seq_len : full.shape[-1]]
    rg_lru = module.rg_lru
    kept = rg_lru.recurrent_states
    rg_lru.recurrent_states = cache.get_recurrent_state(layer_idx)
    try:
        x_branch = rg_lru(x_branch.transpose(1, 2), position_ids)
        cache.update_recurrent_state(rg_lru.recurrent_states, layer_idx)
    finally:
        rg_lru.recurrent_states = kept
    return module.linear_out(x_branch * y_branch)


_MISSING = object()


@contextlib.contextmanager
def states_through_cache(model: torch.nn.Module) -> Iterator[None]:
    """While active, every block of the model that keeps its state on itself runs `cache_state_forward`, with its
    decoder layer's index as `layer_idx` (the probe's recorder attributes the state calls to it)."""
    restore = install_cache_state_forwards(model)
    try:
        yield
    finally:
        restore()


def install_cache_state_forwards(model: torch.nn.Module) -> Callable[[], None]:
    """Install `cache_state_forward` on every block that keeps its state on itself, each given its decoder layer's
    index; returns what takes them out (the model as it was)."""
    installed: list[tuple[torch.nn.Module, Any]] = []
    for layer_idx, layer in decoder_layers(model):
        for module in layer.modules():
            if keeps_own_state(module) and "forward" not in module.__dict__:
                installed.append((module, module.__dict__.get("layer_idx", _MISSING)))
                module.layer_idx = layer_idx
                module.forward = cache_state_forward(module)

    def restore() -> None:
        for module, layer_idx in installed:
            module.__dict__.pop("forward", None)
            if layer_idx is _MISSING:
                module.__dict__.pop("layer_idx", None)
            else:
                module.layer_idx = layer_idx
        installed.clear()

    return restore
