"""`ModelWatch`: the model as the engine's caches know it, and whether it has changed since.

What the engine keeps was computed by the model: K/V blocks and state checkpoints in the prefix cache, image
embeddings in the encoder cache. A model that changes in place (an optimizer step, `load_state_dict`, an edit,
a PEFT adapter switch) makes them stale. `key` names the model as it computes now: b"" while it is as it was
patched, else a digest of its weights' generation (counted up by every change to a tensor) and the state of its
adapters. The key starts every request's block-hash chain (hybridkv/memory/hashing.py), so after a change no block
computed before is ever hit; the old blocks age out of the pool like any other free block. An adapter set used
before brings its key back, and its blocks with it.

The signals, cheapest first (`python benchmarks/model_watch.py` times each):
- a parameter, buffer or submodule set on one of the model's modules (torch's global registration hooks): the
  watch reads the model's structure again;
- an optimizer step over any of its parameters (torch's global optimizer-step hook: every implementation, the
  fused AdamW too, which moves no version counter);
- each tensor's version counter and address: in-place updates autograd sees (`copy_`, `load_state_dict`, edits
  under `no_grad`), and tensors replaced or reassigned (`p.data = other`);
- the active, disabled and merged adapters of PEFT's tuner layers, and their scaling;
- a content sample, `SAMPLES` elements of every tensor compared bit for bit: the catch-all for writes that
  bypass version counters (`p.data.add_()`, `p.data.copy_()`, any write to an inference tensor, which keeps no
  counter). Its elements lie in distinct rows and columns, spread over both (`_sample_step`), every column of a row
  of at most `SAMPLES` elements. An edit that changes none of the sampled elements goes unseen:
  `LLMEngine.reset_prefix_cache()` is for such edits.

A tensor whose dtype or device changes is refused with an error naming the fix: the engine's pages, buffers and
graphs were made for the old one.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from functools import cache
from hashlib import sha256
from math import gcd
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks

SAMPLES = 64  # elements of each tensor the content sample reads
_GOLDEN_SECTION = (5**0.5 - 1) / 2
_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ModelChange(NamedTuple):
    """What `ModelWatch.check` found: the new key, whether a tensor moved to another address (a captured CUDA
    graph reads the old one), and why, for a person."""

    key: bytes
    moved: bool
    reasons: tuple[str, ...]


class ModelMoved(RuntimeError):
    """A tensor of the model changed dtype or device since `hybridkv.patch`."""


class ModelWatch:
    """Watches one model (see the module docstring). `check()` reads every signal; `key` is the model's key as of
    the last check."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.generation = 0  # changes to the weights seen so far
        self.num_checks = 0
        self.check_seconds = 0.0
        self._structure_changed = False  # set by the registration hooks (any thread)
        self._optimizer_stepped = False  # set by the optimizer-step hook (any thread)
        self._read_structure()
        self._patched_layouts = dict(zip(self._names, self._tensor_layouts(), strict=True))
        self._versions, self._addresses = self._read_counters()
        self._sample_views = self._build_sample_views()
        self._sampled = self._read_samples()
        self._merged = self._merged_adapters()
        self._patched_adapters = self._adapters = self._adapter_state()
        self.key = b""
        _watch(self)

    def close(self) -> None:
        """Stop watching: the hooks forget this watch, and the content sample's views (which hold the tensors'
        storage) are dropped."""
        _unwatch(self)
        self._sample_views = []
        self._slots = []

    # ---- the check ----------------------------------------------------------------------------------

    def check(self) -> ModelChange | None:
        """Read every signal; None if the model computes as at the last check. On a change to the weights the
        generation counts up; `key` follows the generation and the adapters. Raises `ModelMoved` (nothing
        changed here) when a tensor has another dtype or device."""
        start = time.perf_counter()
        try:
            return self._check()
        finally:
            self.num_checks += 1
            self.check_seconds += time.perf_counter() - start

    def invalidate(self, reason: str) -> ModelChange:
        """Count the weights' generation up whatever the signals say (a change no signal sees)."""
        self.generation += 1
        self.key = self._key(self._adapters)
        return ModelChange(self.key, False, (reason,))

    def _check(self) -> ModelChange | None:
        reasons = []
        structure = self._structure
        if self._structure_changed:
            self._structure_changed = False
            self._read_structure()
        versions, addresses = self._read_counters()  # reads the structure again itself if a slot was emptied
        if self._structure != structure:
            reasons.append("a parameter, buffer or submodule of the model was replaced, added or removed")
        moved = addresses != self._addresses
        if moved or reasons:
            self._refuse_moved()
            self._sample_views = self._build_sample_views()
            self._sampled = None  # read again below, from the new views
        if moved:
            reasons.append("a tensor of the model was reassigned (a new address)")
        elif versions != self._versions:
            reasons.append("a tensor of the model was updated in place")
        self._versions, self._addresses = versions, addresses
        if self._optimizer_stepped:
            self._optimizer_stepped = False
            reasons.append("an optimizer stepped over the model's parameters")
        merged = self._merged_adapters()
        if merged != self._merged:
            self._merged = merged
            reasons.append("an adapter was merged or unmerged")
        sampled = self._read_samples()
        if self._sampled is not None and not _same_samples(sampled, self._sampled):
            reasons.append("a tensor's contents changed (a write that bypasses version counters, e.g. through .data)")
        self._sampled = sampled
        if reasons:
            self.generation += 1
        adapters = self._adapter_state()
        if adapters != self._adapters:
            self._adapters = adapters
            reasons.append("the active adapters changed")
        if not reasons:
            return None
        self.key = self._key(adapters)
        return ModelChange(self.key, moved, tuple(reasons))

    def _key(self, adapters: tuple[Any, ...]) -> bytes:
        if self.generation == 0 and adapters == self._patched_adapters:
            return b""
        return sha256(repr((self.generation, adapters)).encode()).digest()

    # ---- what is read ------------------------------------------------------------------------------------

    def _read_structure(self) -> None:
        """Every parameter and buffer slot of every module (the dict that holds it, its name), the modules, the
        parameters an optimizer may step and PEFT's tuner layers; `_structure` is what a later read compares."""
        slots, names, tensors = [], [], []
        modules = list(self.model.named_modules())
        for prefix, module in modules:
            for holder in (module._parameters, module._buffers):
                for name, tensor in holder.items():
                    if tensor is not None:
                        slots.append((holder, name))
                        names.append(f"{prefix}.{name}" if prefix else name)
                        tensors.append(tensor)
        self._slots = slots
        self._names = names
        self._module_ids = {id(module) for _, module in modules}
        _index_watched_modules()
        self._parameter_ids = {id(p) for p in self.model.parameters()}
        self._tuner_layers = [module for _, module in modules if _is_tuner_layer(module)]
        self._structure = (tuple(names), tuple(map(id, tensors)), tuple(id(m) for _, m in modules))

    def _tensors(self) -> list[torch.Tensor]:
        """The tensors in the slots now; a slot emptied since (a deleted parameter: no hook sees it) reads the
        structure again (which `check` reports)."""
        try:
            return [holder[name] for holder, name in self._slots]
        except KeyError:
            self._read_structure()
            return [holder[name] for holder, name in self._slots]

    def _read_counters(self) -> tuple[list[int], list[int]]:
        tensors = self._tensors()
        try:
            versions = [t._version for t in tensors]
        except RuntimeError:  # inference tensors keep no version counter (and only inference mode writes them)
            versions = [0 if t.is_inference() else t._version for t in tensors]
        try:
            return versions, [t.data_ptr() for t in tensors]
        except RuntimeError:  # a wrapper subclass without storage of its own (its identity stands for its address)
            return versions, [_address(t) for t in tensors]

    def _tensor_layouts(self) -> list[tuple[torch.dtype, torch.device]]:
        return [(t.dtype, t.device) for t in self._tensors()]

    def _refuse_moved(self) -> None:
        """`ModelMoved` if a tensor the model had when it was patched has another dtype or device now."""
        for name, layout in zip(self._names, self._tensor_layouts(), strict=True):
            old = self._patched_layouts.get(name)
            if old is not None and old != layout:
                raise ModelMoved(
                    f"the model's {name} is {layout[0]} on {layout[1]} but was {old[0]} on {old[1]} when it was "
                    "patched; hybridkv's KV pages, step buffers and graphs were made for that: call "
                    "hybridkv.unpatch(model), then hybridkv.patch(model) again (or move the model back)"
                )

    def _build_sample_views(self) -> list[list[Any]]:
        """Views of `SAMPLES` elements of every tensor with data, as integers of their element size, grouped by
        device and element size: one concatenation a group reads them all (numpy's on the CPU, faster than
        torch's for many small views: benchmarks/RESULTS.md, 'Choices in the code'). A view holds its tensor's storage
        until the views are built again (at the next check that finds the tensor replaced) or the watch is closed."""
        groups: dict[tuple[torch.device, int], list[Any]] = {}
        for tensor in self._tensors():
            view = _sample_view(tensor)
            if view is not None:
                groups.setdefault((tensor.device, tensor.element_size()), []).append(view)
        return list(groups.values())

    def _read_samples(self) -> list[Any]:
        """Each group's sample: the bytes of the CPU's (compared as `bytes`: benchmarks/RESULTS.md, 'Choices in the
        code'), a device's tensor."""
        return [
            np.concatenate(views).tobytes() if isinstance(views[0], np.ndarray) else torch.cat(views)
            for views in self._sample_views
        ]

    def _merged_adapters(self) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(layer.merged_adapters) for layer in self._tuner_layers)

    def _adapter_state(self) -> tuple[Any, ...]:
        return adapter_state(self._tuner_layers)

    # ---- hooks ---------------------------------------------------------------------------------------------

    def _registered(self, module: torch.nn.Module) -> None:
        if id(module) in self._module_ids:
            self._structure_changed = True

    def _stepped(self, optimizer: torch.optim.Optimizer) -> None:
        ids = self._parameter_ids
        if any(id(p) in ids for group in optimizer.param_groups for p in group["params"]):
            self._optimizer_stepped = True


def adapter_state(tuner_layers: Iterable[torch.nn.Module]) -> tuple[Any, ...]:
    """Per PEFT tuner layer: its active adapters, whether adapters are disabled, and each active adapter's scaling
    (LoRA's `set_scale`)."""
    state = []
    for layer in tuner_layers:
        active = tuple(layer.active_adapters)
        scaling = getattr(layer, "scaling", None)
        scales = tuple(scaling.get(name) for name in active) if isinstance(scaling, dict) else ()
        state.append((active, bool(layer.disable_adapters), scales))
    return tuple(state)


def model_adapter_state(model: torch.nn.Module) -> tuple[Any, ...]:
    """`adapter_state` of every tuner layer of the model, with which adapters each has merged."""
    layers = [module for module in model.modules() if _is_tuner_layer(module)]
    return adapter_state(layers), tuple(tuple(layer.merged_adapters) for layer in layers)


def _is_tuner_layer(module: torch.nn.Module) -> bool:
    """A PEFT tuner layer (LoRA, IA3, ...): its class keeps its adapters' names and which are merged (read off the
    class: an instance's missing attribute costs a raised AttributeError in `Module.__getattr__`)."""
    cls = type(module)
    return hasattr(cls, "merged_adapters") and hasattr(cls, "active_adapters") and hasattr(cls, "disable_adapters")


def _sample_view(tensor: torch.Tensor) -> Any:
    """`_sample_tensor`'s view, as a numpy array on the CPU (which fixes the storage's size: `WeightMemory`)."""
    view = _sample_tensor(tensor)
    return view.numpy() if view is not None and view.device.type == "cpu" else view


def _sample_tensor(tensor: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of up to `SAMPLES` elements spread over the tensor's storage span, as integers of the element's
    size; None where there is no data to read (a meta tensor) or no strided view of it (another layout, a tensor
    subclass without one)."""
    if tensor.device.type == "meta" or tensor.layout != torch.strided or tensor.numel() == 0:
        return None
    if tensor.element_size() not in _INTEGER_OF_SIZE or tensor.is_complex():
        return None
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    step = _sample_step(tuple(tensor.shape), tuple(tensor.stride()), span)
    count = _sample_count(step, span)
    try:
        view = tensor.detach().as_strided((count,), (step,), tensor.storage_offset())
        return view.view(_INTEGER_OF_SIZE[tensor.element_size()])
    except (RuntimeError, NotImplementedError, TypeError):
        return None


@cache
def _sample_step(shape: tuple[int, ...], strides: tuple[int, ...], span: int) -> int:
    """The content sample's stride through a storage span of `span` elements: aligned with no dimension, and spread
    over all of them (issue 61: span // 16 was a multiple of the row length, so it read column 0 of 16 rows).

    The step is coprime with the row length and every stride, so the samples fall in as many distinct columns as
    they are (every column of a row of at most `SAMPLES` elements), and at most span // SAMPLES, so they reach
    across the span. Its candidates: the 2 × `SAMPLES` widest such steps and, where the rows outnumber the samples,
    those congruent to the row length's golden section modulo it (the columns read then spread over the row as a
    Weyl sequence does, a row each). It takes the candidate whose samples leave the smallest gap, as a share of its
    size, along every dimension; the widest among equals. Computed once per layout."""
    if span <= 2 * SAMPLES:
        return 1
    widest = span // SAMPLES
    dims = [(size, stride) for size, stride in zip(shape, strides, strict=True) if size > 1 and stride > 0]
    row = min((stride for _, stride in dims if stride > 1), default=0)
    factors = {row, *(stride for _, stride in dims)} - {0, 1}
    candidates = list(range(widest, max(0, widest - 2 * SAMPLES), -1))
    if widest >= row > 1:
        residue = round(row * _GOLDEN_SECTION)
        while gcd(residue, row) > 1:  # ends by row - 1 at the latest
            residue += 1
        top = widest - (widest - residue) % row
        candidates += range(top, max(0, top - 8 * row), -row)
    steps = np.array([step for step in candidates if all(gcd(step, n) == 1 for n in factors)] or [1])
    gaps = _largest_gaps(dims, steps, span)
    return int(steps[np.lexsort((-steps, gaps))[0]])


def _largest_gaps(dims: list[tuple[int, int]], steps: np.ndarray, span: int) -> np.ndarray:
    """For each step, the largest gap between the coordinates its samples read along any dimension, as a share of
    that dimension's size (the tensor taken as dense: a coordinate is offset // stride % size)."""
    counts = np.array([_sample_count(int(step), span) for step in steps])
    offsets = steps[:, None] * np.arange(counts.max())[None, :]
    offsets = np.where(np.arange(counts.max())[None, :] < counts[:, None], offsets, 0)  # past a step's count: 0 again
    largest = np.zeros(len(steps))
    for size, stride in dims:
        read = np.sort(offsets // stride % size, axis=1)
        gaps = np.diff(read, axis=1, append=read[:, :1] + size)
        largest = np.maximum(largest, gaps.max(axis=1) / size)
    return largest


def _sample_count(step: int, span: int) -> int:
    """How many elements the content sample reads every `step` elements of a span: `SAMPLES`, or all of a span of
    at most 2 × `SAMPLES` elements."""
    return span if span <= 2 * SAMPLES else min(SAMPLES, (span + step - 1) // step)


def _address(tensor: torch.Tensor) -> int:
    try:
        return tensor.data_ptr()
    except RuntimeError:
        return id(tensor)


def _same_samples(now: list[Any], before: list[Any]) -> bool:
    """Bit for bit (the samples are integers or their bytes: a NaN weight equals itself)."""
    if len(now) != len(before):
        return False
    for a, b in zip(now, before, strict=True):
        if type(a) is not type(b):
            return False
        if isinstance(a, bytes):
            if a != b:
                return False
        elif a.shape != b.shape or not torch.equal(a, b):
            return False
    return True


# ---- torch's global hooks, shared by every live watch -----------------------------------------------------------

_WATCHES: weakref.WeakSet[ModelWatch] = weakref.WeakSet()
_HOOKS: list[Any] = []
# The ids of every watched model's modules: a registration elsewhere costs the hook one set lookup. transformers'
# forwards register modules at every step (`self.layers[:n]` builds a new ModuleList), so the hook is hot.
_WATCHED_MODULE_IDS: set[int] = set()


def _index_watched_modules() -> None:
    global _WATCHED_MODULE_IDS
    _WATCHED_MODULE_IDS = set().union(*(watch._module_ids for watch in _WATCHES))


def _on_registration(module: torch.nn.Module, name: str, value: Any) -> None:
    if id(module) in _WATCHED_MODULE_IDS:
        for watch in list(_WATCHES):
            watch._registered(module)


def _on_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for watch in list(_WATCHES):
        watch._stepped(optimizer)


def _watch(watch: ModelWatch) -> None:
    _WATCHES.add(watch)
    _index_watched_modules()
    if not _HOOKS:
        _HOOKS.extend(
            [
                module_hooks.register_module_parameter_registration_hook(_on_registration),
                module_hooks.register_module_buffer_registration_hook(_on_registration),
                module_hooks.register_module_module_registration_hook(_on_registration),
                optimizer_hooks.register_optimizer_step_post_hook(_on_optimizer_step),
            ]
        )


def _unwatch(watch: ModelWatch) -> None:
    """Forget a watch; the last one removes torch's hooks (an unpatched process is as it was)."""
    _WATCHES.discard(watch)
    _index_watched_modules()
    if not _WATCHES:
        _remove(_HOOKS)


def _remove(handles: Iterable[Any]) -> None:
    for handle in handles:
        handle.remove()
    _HOOKS.clear()
