"""`Worker`: what vLLM's `collective_rpc` reaches in each process of an engine.

vLLM's `llm.collective_rpc(method, timeout=None, args=(), kwargs=None)` runs `method` on every worker (one per rank)
and returns their results in rank order: a name is one of the worker's methods (`worker_extension_cls`, an engine
argument, adds the caller's own as a base class of the worker), a function is called with the worker first. Here the
worker is the process's own side of the engine: `model_runner` (the engine's `ModelRunner`; `model_runner.model` is
the transformers model), `model`, `rank`, `world_size` and `device`. One process answers alone; a tensor-parallel
engine (torchrun) sends the call to every rank (hybridkv/execution/distributed.py), so a function must be one pickle
can send (a module-level `def`, not a lambda). The call runs on the caller's thread between two steps: `timeout`
(vLLM's, for workers in other processes) is checked, never enforced.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from hybridkv.execution.model_runner import ModelRunner
from hybridkv.execution.weight_memory import WeightMemory


class Worker:
    """The process's side of the engine that `collective_rpc` calls reach (module docstring)."""

    def __init__(self, model_runner: ModelRunner, rank: int = 0, world_size: int = 1) -> None:
        self.model_runner = model_runner
        self.rank = self.local_rank = rank
        self.world_size = world_size
        self.weights: WeightMemory | None = None  # a model the engine loaded itself (`EngineCore.own_weights`)

    @property
    def model(self) -> torch.nn.Module:
        """The transformers model this rank runs (its shard, under tensor parallel)."""
        return self.model_runner.model

    @property
    def device(self) -> torch.device:
        """The device the model's inputs go to."""
        return self.model_runner.input_device

    def reload_weights(self) -> None:
        """vLLM's: load the checkpoint's weights into the model again, in place. After `sleep(level=2)` vLLM's
        `wake_up(tags=["weights"])` leaves them unset for this call; here that wake-up has loaded them already, and
        this loads them again (undoing any change made to them since). Only a model the engine loaded itself
        (`LLM(model=path)`) has a checkpoint to load."""
        if self.weights is None:
            raise RuntimeError(
                "reload_weights: this engine serves a model the caller loaded, and knows no checkpoint to load it "
                "from; load the weights into the model yourself (model.load_state_dict)"
            )
        self.weights.reload_in_place()


def worker_class(extension: str | type | None) -> type[Worker]:
    """`Worker`, or with vLLM's `worker_extension_cls` (a class, or its qualified name: "package.module.Class") as a
    further base class; a name the two share is refused, as vLLM refuses it."""
    if extension is None:
        return Worker
    if isinstance(extension, str):
        module_name, _, class_name = extension.rpartition(".")
        try:
            extension = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as error:
            raise ValueError(
                f"worker_extension_cls={extension!r} names no class that can be imported ({error}); give the class "
                "itself or its qualified name, 'package.module.Class'"
            ) from None
    if not isinstance(extension, type):
        raise TypeError(f"worker_extension_cls must be a class or its qualified name, not {extension!r}")
    shared = sorted(name for name in vars(extension) if not name.startswith("__") and hasattr(Worker, name))
    if shared:
        raise ValueError(
            f"worker_extension_cls {extension.__qualname__} defines {', '.join(shared)}, which the worker has: "
            "rename them in the extension"
        )
    return type("Worker", (Worker, extension), {})


def run_call(worker: Worker, method: str | Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """One worker's side of `collective_rpc`: its method of that name, or the function with the worker first."""
    if isinstance(method, str):
        function = getattr(worker, method, None)
        if not callable(function):
            public = sorted(
                name for name in dir(type(worker)) if not name.startswith("_") and callable(getattr(worker, name))
            )
            raise AttributeError(
                f"the worker has no method {method!r} (its methods: {', '.join(public) or 'none'}); add it with "
                "worker_extension_cls=..., or pass a function, which is called with the worker first"
            )
        return function(*args, **kwargs)
    if not callable(method):
        raise TypeError(f"collective_rpc takes a method name or a function, not {type(method).__name__}")
    return method(worker, *args, **kwargs)


def check_call(timeout: float | None, args: Any, kwargs: Any) -> tuple[tuple, dict[str, Any]]:
    """`collective_rpc`'s arguments checked: a timeout in seconds above 0 or None, args a tuple or list, kwargs a
    dict or None."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
        raise ValueError(f"timeout must be a number of seconds above 0, or None, not {timeout!r}")
    if not isinstance(args, tuple | list):
        raise TypeError(f"args must be a tuple of positional arguments, not {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict of keyword arguments, not {type(kwargs).__name__}")
    return tuple(args), dict(kwargs or {})
