"""Where a model computes: accelerate's hooks first (offloaded weights sit on the meta device until
their forward), then where the weights are. The probe places its input with it, the engine its pages."""

from __future__ import annotations

import torch


def execution_device(modules: dict[str, torch.nn.Module], name: str) -> torch.device:
    """Where the module `name` (in `dict(model.named_modules())`) computes: accelerate's hook on it or
    its nearest ancestor (offloaded weights sit on the meta device until forward), else where its
    weights are."""
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        hook = getattr(modules[".".join(parts[:depth])], "_hf_hook", None)
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return next(modules[name].parameters()).device


def input_device(model: torch.nn.Module) -> torch.device:
    """Where the model's input ids must live: the execution device of its input embeddings."""
    named = dict(model.named_modules())
    embeddings = model.get_input_embeddings()
    return execution_device(named, next(name for name, module in named.items() if module is embeddings))
