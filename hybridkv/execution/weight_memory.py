"""`WeightMemory`: the weights of a model the engine loaded itself, which `sleep` may give back (vLLM's sleep levels).

vLLM's `sleep(level=1)` offloads the weights to host memory and `sleep(level=2)` discards them; `wake_up(tags=
["weights"])` makes room for them again. A model the caller holds is theirs, and its weights stay at either level. A
model `LLM(model=path)` or `LLMEngine.from_engine_args` loaded is the engine's, and its weights on a device (a GPU)
are given back:
- level 1 copies each weight storage to host memory and empties it on the device;
- level 2 empties each storage, and waking loads the checkpoint's weights into them again (`reload`: vLLM leaves
  them unset for the caller to load, `collective_rpc("reload_weights")`; here they are never served unset).
Weights in host memory (on the CPU) stay at either level: it is where level 1 puts them, and there they cannot be
emptied in place anyway (mapped from the checkpoint's file, or read by the model watch through numpy, which fixes a
storage's size), which level 2 says.

Each storage is emptied in place (`resize_(0)`), so the parameters, and every view of them the engine holds (the
model watch's sample, compiled code), stay the same objects; waking gives them new memory, at a new address, which
the model watch sees (CUDA graphs are captured again). Only the parameters the checkpoint loaded are given back, at
the shape and dtype it loaded them with: a storage shared with anything else (a buffer, an adapter's weight) stays.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# The checkpoint's parameters by name, loaded again (on the CPU), for `sleep(level=2)`'s wake-up.
Reload = Callable[[], dict[str, torch.Tensor]]


class WeightMemory:
    """The weights of `model` as its checkpoint loaded them (see the module docstring): `sleep(level)` gives their
    memory back, `wake_up()` restores them. `reload` is None where the weights cannot be loaded again (random weights,
    `load_format="dummy"`): level 2 then keeps them as level 1 does."""

    def __init__(self, model: torch.nn.Module, reload: Reload | None, *, include_host: bool = False) -> None:
        self.model = model
        self.reload = reload
        self.include_host = include_host  # give back weights in host memory too (a test's way onto the device path)
        self.layout = {name: (p.shape, p.dtype) for name, p in model.named_parameters(remove_duplicate=False)}
        self.level = 0  # the sleep level the weights are at; 0: awake
        self._emptied: list[tuple[torch.Tensor, int]] = []  # a tensor on each emptied storage, and its bytes
        self._host: list[torch.UntypedStorage] = []  # level 1: each emptied storage's copy in host memory

    @property
    def asleep(self) -> bool:
        return self.level != 0

    def sleep(self, level: int) -> str | None:
        """Give the weights' memory back at vLLM's `level` (1: copy to host memory first; 2: discard). None when
        done, or when there is nothing to give back; otherwise why the weights stay, for the caller to say."""
        if self.asleep:
            return None
        changed = self._changed_layout()
        if changed:
            return f"the model's parameters are no longer as its checkpoint loaded them ({changed})"
        if level == 2 and self.reload is None:
            level = 1  # random weights cannot be loaded again: kept in host memory
        every = self._storages()
        storages = [(t, n) for t, n in every if self.include_host or t.device.type != "cpu"]
        fixed = sum(not t.untyped_storage().resizable() for t, _ in storages)
        if fixed:
            return (
                f"{fixed} of the model's weight storages cannot be emptied in place (mapped from the checkpoint's "
                "file, or read through numpy)"
            )
        if level == 2 and len(storages) < len(every):
            return "they are in host memory (the CPU), which level 1 offloads to and level 2 does not free here"
        if not storages:
            return None
        if level == 1:
            self._host = [_host_copy(tensor.untyped_storage()) for tensor, _ in storages]
        for tensor, _ in storages:
            tensor.untyped_storage().resize_(0)
        self._emptied = storages
        self.level = level
        if any(tensor.device.type == "cuda" for tensor, _ in storages):
            torch.cuda.empty_cache()  # to the device, for another process too
        return None

    def wake_up(self) -> None:
        """Give the emptied storages their memory again and fill it: from the host copies (level 1) or from the
        checkpoint (level 2; its parameters must match the model's by name, shape and dtype)."""
        if not self.asleep:
            return
        loaded = self.reload() if self.level == 2 else None  # read before any memory is taken
        for tensor, nbytes in self._emptied:
            tensor.untyped_storage().resize_(nbytes)
        if loaded is None:
            for (tensor, _), host in zip(self._emptied, self._host, strict=True):
                tensor.untyped_storage().copy_(host)
        else:
            self._fill(loaded)
        self._emptied, self._host, self.level = [], [], 0

    def reload_in_place(self) -> None:
        """Load the checkpoint's weights into the awake model again (the worker's `reload_weights`)."""
        if self.asleep:
            raise RuntimeError("the weights are asleep: wake them first (llm.wake_up(tags=['weights']))")
        if self.reload is None:
            raise RuntimeError("the weights were made at random (load_format='dummy'): there is nothing to load again")
        self._fill(self.reload())

    def nbytes_asleep(self) -> int:
        """The bytes the emptied storages held."""
        return sum(nbytes for _, nbytes in self._emptied)

    def _changed_layout(self) -> str:
        """The first parameter whose name, shape or dtype is not the checkpoint's ('' if none)."""
        now = {name: (p.shape, p.dtype) for name, p in self.model.named_parameters(remove_duplicate=False)}
        for name, (shape, dtype) in self.layout.items():
            if name not in now:
                return f"{name} is gone"
            if now[name] != (shape, dtype):
                return f"{name} is {tuple(now[name][0])} {now[name][1]}, loaded as {tuple(shape)} {dtype}"
        return ""

    def _storages(self) -> list[tuple[torch.Tensor, int]]:
        """One parameter on each storage that only the checkpoint's parameters use, with the storage's bytes."""
        named = self.model.named_parameters(remove_duplicate=False)
        keep = {_storage_key(buffer) for buffer in self.model.buffers()}
        keep |= {_storage_key(param) for name, param in named if name not in self.layout}
        seen: dict[int, tuple[torch.Tensor, int]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            key = _storage_key(param)
            if name in self.layout and key not in keep and key not in seen:
                seen[key] = (param, param.untyped_storage().nbytes())
        return list(seen.values())

    def _fill(self, loaded: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.model.named_parameters(remove_duplicate=False):
                if name not in self.layout:
                    continue
                source = loaded.get(name)
                if source is None or source.shape != param.shape or source.dtype != param.dtype:
                    found = "missing" if source is None else f"{tuple(source.shape)} {source.dtype}"
                    raise RuntimeError(
                        f"the checkpoint loaded again does not hold {name} as the model has it ({tuple(param.shape)} "
                        f"{param.dtype}; the checkpoint: {found}): was it replaced on disk since the model loaded?"
                    )
                param.copy_(source)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _host_copy(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A copy of `storage` in host memory (pinned where it comes from a CUDA device, for a fast copy back)."""
    host = torch.UntypedStorage(storage.nbytes(), device="cpu")
    if storage.device.type == "cuda":
        host = host.pin_memory()
    host.copy_(storage)
    return host
