"""Inference on a model in training mode: what hybridkv runs of a policy being trained is run with eval semantics.

A training loop leaves its model in `train()` mode, and a rollout must not sample through dropout (nor may patch's
probe and step check compare a forward with dropout against one without). `eval_modules` switches every module
of a model in training mode to eval and returns them; `restore_training` switches exactly those back, so a model
whose submodules are in mixed modes comes back as it was. A model in eval mode costs one attribute read: its
submodules are taken as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def eval_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Switch the modules of `model` that are in training mode to eval (the flag alone, as `Module.eval` sets it);
    returns them, none when the model itself is in eval mode."""
    if not model.training:
        return []
    switched = [module for module in model.modules() if module.training]
    for module in switched:
        module.training = False
    return switched


def restore_training(modules: list[torch.nn.Module]) -> None:
    """Put back in training mode the modules `eval_modules` switched."""
    for module in modules:
        module.training = True


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """`model` with eval semantics for the block, its modes restored after (an exception too)."""
    switched = eval_modules(model)
    try:
        yield
    finally:
        restore_training(switched)
