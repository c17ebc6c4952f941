"""State layers on hybridkv's flattened batch: linear attention, SSM and short-convolution layers, each request
from its own state slot.

transformers' state layers (Gated DeltaNet, Mamba2, LFM2's conv, ...) read and write their state through the
cache interface (`get/update_conv_state`, `get/update_recurrent_state`) and compute a padded `[batch, seq]`
input as one batch of sequences; none of them keeps packed sequences apart (their scans and convolutions run
along the row), and padding the step into a batch would compute every pad position in every state layer. A
step is one flattened row of many requests, so each state
layer's module is run per request segment (`segmented_forward`, put in the module's place while the runner
lives): the step's decode rows together, as a batch of one-token sequences, and every other sequence (a
prompt's chunk) alone. Its cache calls go to `StepStateCache`, which gathers the segment's slots from the
`StatePool` and scatters what the layer leaves back after the call, so the layers' own code, and numerics,
compute every state. Attention layers' cache updates pass K/V through: the paged attention op keeps them.

A prompt's chunk that crosses a boundary where a state checkpoint is planned (hybridkv/state_slots.py) runs
in pieces split there, and after each piece the layer copies its state into the checkpoint's slot; the
boundaries are multiples of the layers' scan chunk (`scan_chunk`), where a split computation continues bit for
bit. A decode row's checkpoint is copied after the step (every layer at once).

    StatePool     per state layer and state index: conv states [slots, channels, kernel] and recurrent
                  states [slots, ...], slot 0 scratch, then the requests' slots and the checkpoints
    StatePlan     a step's segments: the decode rows and their slots; (first row, end row, slot, has a state,
                  checkpoints) of every other sequence; the checkpoint copies after the step
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.kv_spec import StateSpec
from hybridkv.patches.probe import PassThroughCache


class StatePool:
    """Every slot's state in every state layer (module docstring), on each layer's device."""

    def __init__(
        self, states: list[StateSpec], num_slots: int, devices: dict[int, torch.device], pin_memory: bool = False
    ) -> None:
        self.conv: dict[int, list[torch.Tensor]] = {}
        self.recurrent: dict[int, list[torch.Tensor]] = {}
        for spec in states:
            device = devices[spec.layer_idx]
            for held, parts in ((self.conv, spec.conv), (self.recurrent, spec.recurrent)):
                held[spec.layer_idx] = [
                    torch.zeros((num_slots, *shape), dtype=dtype, device=device, pin_memory=pin_memory)
                    for shape, dtype in parts
                ]
        self.nbytes = sum(t.numel() * t.element_size() for layer_idx in self.conv for t in self.tensors(layer_idx))

    def tensors(self, layer_idx: int) -> tuple[torch.Tensor, ...]:
        """One layer's state tensors, conv states then recurrent states."""
        return (*self.conv[layer_idx], *self.recurrent[layer_idx])

    def copy_layer(self, layer_idx: int, source: int, destination: int) -> None:
        """Copy one layer's state from slot `source` to slot `destination` (a checkpoint, as the layer passes it)."""
        for tensor in self.tensors(layer_idx):
            tensor[destination].copy_(tensor[source])

    def swap(self, cpu: StatePool | None, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy swapped requests' states: (slot, CPU slot) pairs out to `cpu` (a pool of the same layers on the CPU),
        then (CPU slot, slot) pairs back in."""
        for pairs, outbound in ((swap_out, True), (swap_in, False)):
            if not pairs:
                continue
            firsts, seconds = [p[0] for p in pairs], [p[1] for p in pairs]
            ours, theirs = (firsts, seconds) if outbound else (seconds, firsts)
            cpu_slots = torch.tensor(theirs)
            slots = _on_devices(ours)
            for layer_idx in self.conv:
                for here, there in zip(self.tensors(layer_idx), cpu.tensors(layer_idx), strict=True):
                    if outbound:
                        there[cpu_slots] = here[slots(here.device)].to("cpu")
                    else:
                        here[slots(here.device)] = there[cpu_slots].to(here.device)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) slot's state, every layer (forks, restored checkpoints)."""
        if not pairs:
            return
        sources, destinations = _on_devices([p[0] for p in pairs]), _on_devices([p[1] for p in pairs])
        for layer_idx in self.conv:
            for tensor in self.tensors(layer_idx):
                tensor[destinations(tensor.device)] = tensor[sources(tensor.device)]


def _on_devices(slots: list[int]) -> Callable[[torch.device], torch.Tensor]:
    """`slots` as an index tensor on a device, made once per device however many layers sit there."""
    made: dict[torch.device, torch.Tensor] = {}

    def on(device: torch.device) -> torch.Tensor:
        if device not in made:
            made[device] = torch.tensor(slots, device=device)
        return made[device]

    return on


# The chunk of a Gated DeltaNet layer's chunked rule (transformers' fallback and flash-linear-attention's).
GATED_DELTA_CHUNK = 64


def scan_chunk(modules: Iterable[torch.nn.Module]) -> int:
    """The length along the sequence whose multiples a state layer's computation can be split at and continue
    bit for bit: the least common multiple of every layer's scan chunk (a Mamba2 mixer's `chunk_size`;
    `GATED_DELTA_CHUNK` for the others, which also suits a short convolution, exact at any split)."""
    chunk = 1
    for module in modules:
        size = getattr(module, "chunk_size", None)
        chunk = math.lcm(chunk, size if isinstance(size, int) and size > 0 else GATED_DELTA_CHUNK)
    return chunk


@dataclass(slots=True)
class StatePlan:
    """A step's request segments for the state layers: `decode_rows` (rows of the flattened batch that are a
    sequence's one new token after earlier ones) and their `decode_slots`, then `segments`, (first row, end
    row, slot, whether the slot holds the sequence's state so far, (rows into the segment, checkpoint slot) of
    the checkpoints it writes) of every other sequence, and `after` (slot, checkpoint slot), the decode rows'
    checkpoints, copied after the step."""

    decode_rows: torch.Tensor | None
    decode_slots: torch.Tensor | None
    segments: list[tuple[int, int, int, bool, tuple[tuple[int, int], ...]]] = field(default_factory=list)
    after: list[tuple[int, int]] = field(default_factory=list)


class _SegmentView:
    """The state of one segment's slots in one layer, gathered on first read; what the layer leaves is written
    back to the pool after its call (`write_back`), in place changes of the gathered tensors included."""

    def __init__(self, pool: StatePool, layer_idx: int, slots: torch.Tensor, has_state: bool) -> None:
        self.pool, self.layer_idx, self.slots, self.has_state = pool, layer_idx, slots, has_state
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}

    def _gather(self, kind: str, state_idx: int) -> torch.Tensor | None:
        if not self.has_state:
            return None
        held = self.conv if kind == "conv" else self.recurrent
        if state_idx not in held:
            pool = (self.pool.conv if kind == "conv" else self.pool.recurrent)[self.layer_idx][state_idx]
            held[state_idx] = pool.index_select(0, self.slots)
        return held[state_idx]

    def conv_state(self, state_idx: int) -> torch.Tensor | None:
        return self._gather("conv", state_idx)

    def recurrent_state(self, state_idx: int) -> torch.Tensor | None:
        return self._gather("recurrent", state_idx)

    def update_conv(self, new: torch.Tensor, state_idx: int, kernel: int | None) -> torch.Tensor:
        """transformers' `update_conv_state`: the conv input with the state's columns before it (a fresh state:
        the input left-padded to the kernel when shorter); the last `kernel` columns are the new state."""
        pool = self.pool.conv[self.layer_idx][state_idx]
        kernel = pool.shape[-1] if kernel is None else kernel
        previous = self.conv_state(state_idx)
        if previous is not None:
            full = torch.cat([previous.to(new.dtype), new], dim=-1)
        elif new.shape[-1] < kernel:
            full = F.pad(new, (kernel - new.shape[-1], 0))
        else:
            full = new
        self.conv[state_idx] = full[..., -kernel:]
        return full

    def update_recurrent(self, state: torch.Tensor, state_idx: int) -> torch.Tensor:
        self.recurrent[state_idx] = state
        return state

    def write_back(self) -> None:
        for held, pools in ((self.conv, self.pool.conv), (self.recurrent, self.pool.recurrent)):
            for state_idx, state in held.items():
                pool = pools[self.layer_idx][state_idx]
                pool.index_copy_(0, self.slots, state.to(pool.dtype))


class StepStateCache(PassThroughCache):
    """The cache a step passes the model: attention updates return K/V as given (the paged attention op keeps
    them); a state call goes to the segment whose layer is running (`view`, set by `segmented_forward`)."""

    def __init__(self, config: Any, pool: StatePool) -> None:
        super().__init__(config=config)
        self.pool = pool
        self.plan: StatePlan | None = None
        self.view: _SegmentView | None = None

    def _view(self, layer_idx: int) -> _SegmentView:
        view = self.view
        if view is None or view.layer_idx != layer_idx:
            raise RuntimeError(f"layer {layer_idx} reached its state outside the segment hybridkv runs")
        return view

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self._view(layer_idx).conv_state(state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self._view(layer_idx).recurrent_state(state_idx)

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        return self._view(layer_idx).update_conv(conv_states, state_idx, conv_kernel_size)

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        return self._view(layer_idx).update_recurrent(recurrent_states, state_idx)


def segmented_forward(original: Callable[..., Any], layer_idx: int) -> Callable[..., Any]:
    """`original` (a state layer module's forward), run per request segment of a step (module docstring);
    outside a step, as it is."""

    def forward(hidden_states: torch.Tensor, *args: Any, cache: Any = None, **kwargs: Any) -> Any:
        plan = getattr(cache, "plan", None)
        if plan is None:
            return original(hidden_states, *args, cache=cache, **kwargs)
        num_rows = hidden_states.shape[1]
        out = None

        def run(rows: Any, segment: torch.Tensor, view: _SegmentView) -> torch.Tensor:
            cache.view = view
            try:
                result = original(segment, *args, cache=cache, **_rows_of(kwargs, rows, num_rows))
            finally:
                cache.view = None
            view.write_back()
            if not isinstance(result, torch.Tensor):
                raise TypeError(f"state layer {layer_idx} returned {type(result).__name__}, not a tensor")
            return result

        if plan.decode_rows is not None:
            rows = plan.decode_rows
            result = run(rows, hidden_states[0].index_select(0, rows).unsqueeze(1), _decode_view(cache, layer_idx))
            out = result.new_empty((1, num_rows, result.shape[-1]))
            out[0].index_copy_(0, rows, result[:, 0])
        for start, end, slot, has_state, checkpoints in plan.segments:
            slots = torch.tensor([slot], device=hidden_states.device)
            first = start
            # Pieces that end at each checkpoint (the layer copies its state there), then the rest.
            for offset, checkpoint in (*checkpoints, (end - start, None)):
                stop = start + offset
                if stop > first:
                    view = _SegmentView(cache.pool, layer_idx, slots, has_state or first > start)
                    result = run(slice(first, stop), hidden_states[:, first:stop], view)
                    if out is None:
                        out = result.new_empty((1, num_rows, result.shape[-1]))
                    out[:, first:stop] = result
                    first = stop
                if checkpoint is not None:
                    cache.pool.copy_layer(layer_idx, slot, checkpoint)
        return out

    return forward


def _decode_view(cache: Any, layer_idx: int) -> _SegmentView:
    return _SegmentView(cache.pool, layer_idx, cache.plan.decode_slots, True)


def _rows_of(kwargs: dict[str, Any], rows: Any, num_rows: int) -> dict[str, Any]:
    """The keyword arguments of a segment: a `[1, num_rows, ...]` tensor is cut to the segment's rows (a decode
    batch's rows become its batch), anything else passes as it is."""
    cut = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == num_rows:
            value = value[:, rows] if isinstance(rows, slice) else value[0].index_select(0, rows).unsqueeze(1)
        cut[name] = value
    return cut
