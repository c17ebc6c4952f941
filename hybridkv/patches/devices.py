"""Where a model computes: accelerate's hooks first (offloaded weights sit on the meta device until
their forward), then where the weights are. The probe places its input with it, the engine its pages.
Weights on the meta device that no offload hook brings in are refused (`check_weights_loaded`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch


def execution_device(modules: dict[str, torch.nn.Module], name: str) -> torch.device:
    """Where the module `name` (in `dict(model.named_modules())`) computes: accelerate's hook on it or
    its nearest ancestor (offloaded weights sit on the meta device until forward), else where its
    weights are."""
    for hook in _hooks(modules, name):
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return next(modules[name].parameters()).device


def input_device(model: torch.nn.Module) -> torch.device:
    """Where the model's input ids must live: the execution device of its input embeddings."""
    named = dict(model.named_modules())
    embeddings = model.get_input_embeddings()
    return execution_device(named, next(name for name, module in named.items() if module is embeddings))


def check_weights_loaded(model: torch.nn.Module) -> None:
    """Refuse a model with weights on the meta device that no accelerate offload hook brings in for its
    forward: built under `torch.device("meta")` or accelerate's `init_empty_weights()` and never loaded.
    Such a forward need not fail: torch's linear of a CPU input and a meta weight returns uninitialized
    CPU memory, so a model with one empty layer generates garbage without an error."""
    named = dict(model.named_modules())
    empty = [
        name
        for name, module in named.items()
        if any(t.is_meta for t in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)))
        and not any(_offloads(hook) for hook in _hooks(named, name))
    ]
    if empty:
        shown = ", ".join(name or "(the model itself)" for name in empty[:3])
        more = f" and {len(empty) - 3} more" if len(empty) > 3 else ""
        raise ValueError(
            f"{type(model).__name__} has weights on the meta device that nothing loads ({shown}{more}): it was "
            "built without weights (torch.device('meta') or accelerate's init_empty_weights). Load the weights "
            "first, or use accelerate's offload (device_map=...)"
        )


def _hooks(modules: dict[str, torch.nn.Module], name: str) -> Iterator[Any]:
    """accelerate's hooks on the module `name` and its ancestors, nearest first."""
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        hook = getattr(modules[".".join(parts[:depth])], "_hf_hook", None)
        if hook is not None:
            yield hook


def _offloads(hook: Any) -> bool:
    """Whether the hook loads offloaded weights for the forward: an AlignDevicesHook with offload=True,
    alone or inside a SequentialHook."""
    return any(getattr(h, "offload", False) for h in getattr(hook, "hooks", [hook]))
