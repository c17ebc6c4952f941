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

A prompt's chunk that crosses a boundary where a state checkpoint is planned (hybridkv/memory/state_slots.py) runs
in pieces split there, and after each piece the layer copies its state into the checkpoint's slot; the
boundaries are multiples of the layers' scan chunk (`scan_chunk`), where a split computation continues bit for
bit. A decode row's checkpoint is copied after the step (every layer at once).

    StatePool     per state layer and state index: conv states [slots, channels, kernel] and recurrent
                  states [slots, ...], slot 0 scratch, then the requests' slots and the checkpoints
    StatePlan     a step's segments: the decode rows and their slots; (first row, end row, slot, has a state,
                  checkpoints) of every other sequence; the checkpoint copies after the step
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.execution.latent_layers import StepKVCache
from hybridkv.memory.kv_spec import StateSpec


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
    bit for bit: the least common multiple of every layer's scan chunk (a Mamba2 mixer's `chunk_size`, MiniMax's
    lightning attention's `block_size`; `GATED_DELTA_CHUNK` for the others, which also suits a short convolution or
    a Mamba-1 scan, exact at any split)."""
    chunk = 1
    for module in modules:
        size = getattr(module, "chunk_size", None) or getattr(module, "block_size", None)
        chunk = math.lcm(chunk, size if isinstance(size, int) and size > 0 else GATED_DELTA_CHUNK)
    return chunk


@dataclass(slots=True)
class StatePlan:
    """A step's request segments for the state layers: `decode_rows` (rows of the flattened batch that are a
    sequence's one new token after earlier ones) and their `decode_slots`, then `segments`, (first row, end
    row, slot, whether the slot holds the sequence's state so far, (rows into the segment, checkpoint slot) of
    the checkpoints it writes, how many of its last rows are speculative proposals, rows into the segment where its
    generated tokens begin: a recomputed sequence's, else its row count) of every other sequence, and
    `after` (slot, checkpoint slot), the decode rows' checkpoints, copied after the step. A segment's proposals run
    after its other rows, from a copy of the state they left, in the scratch slot: the request's own slot holds
    only the state of tokens it keeps."""

    decode_rows: torch.Tensor | None
    decode_slots: torch.Tensor | None
    segments: list[tuple[int, int, int, bool, tuple[tuple[int, int], ...], int, int]] = field(default_factory=list)
    after: list[tuple[int, int]] = field(default_factory=list)


class _SegmentView:
    """The state of one segment's slots in one layer, gathered on first read; what the layer leaves is written
    back to the pool after its call (`write_back`), in place changes of the gathered tensors included."""

    def __init__(
        self, pool: StatePool, layer_idx: int, slots: torch.Tensor, has_state: bool, decodes: bool = False
    ) -> None:
        self.pool, self.layer_idx, self.slots, self.has_state = pool, layer_idx, slots, has_state
        # The step's decode rows (tokens generate computes one at a time), not a sequence's piece.
        self.decodes = decodes
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


class StepStateCache(StepKVCache):
    """The cache a step passes the model: attention updates return K/V as given (the paged attention op keeps
    them; a latent attention layer's rows are stored first, hybridkv/execution/latent_layers.py); a state call goes
    to the segment whose layer is running (`view`, set by `segmented_forward`)."""

    def __init__(self, config: Any, pool: StatePool, latent_layers: frozenset[int] = frozenset()) -> None:
        super().__init__(config, latent_layers)
        self.pool = pool
        self.plan: StatePlan | None = None
        self.view: _SegmentView | None = None
        # LoRA's slots (hybridkv/execution/lora.py), told which of the step's rows a segment's layers see.
        self.lora: Any = None

    def decodes(self, layer_idx: int) -> bool:
        """Whether the running segment of layer `layer_idx` holds tokens generate decodes one at a time (the step's
        decode rows, a speculating sequence's rows)."""
        return self._view(layer_idx).decodes

    def continues_prompt(self, layer_idx: int) -> bool:
        """Whether the running segment of layer `layer_idx` continues a sequence's state over tokens that generate
        computes in one forward (a prompt's later piece; hybridkv/execution/state_continuations.py), rather than
        the step's decode rows."""
        view = self._view(layer_idx)
        return view.has_state and not view.decodes

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
    outside a step, as it is. Its arguments are bound by its own signature, so the hidden states and the cache may
    come by position or by name (Zaya's projection takes the cache second, by position); every other `[1, rows,
    ...]` tensor is cut to the segment's rows. It returns a tensor or a tuple of them (Zaya's q, k and v), each
    `[1, rows, ...]` put back together from the segments' (an output that is not one row per row: None)."""
    signature = inspect.signature(original)
    first = next(iter(signature.parameters))

    def forward(*args: Any, **kwargs: Any) -> Any:
        # transformers' layers pass the hidden states by position and the rest by name: no binding then (a bind
        # costs microseconds a layer and step: benchmarks/RESULTS.md, choices in the code).
        bound = None if len(args) == 1 else signature.bind(*args, **kwargs)
        cache = kwargs.get("cache") if bound is None else bound.arguments.get("cache")
        plan = getattr(cache, "plan", None)
        if plan is None:
            return original(*args, **kwargs)
        hidden_states = args[0] if bound is None else bound.arguments[first]
        num_rows = hidden_states.shape[1]
        outputs = _SegmentOutputs(num_rows)

        def run(rows: Any, segment: torch.Tensor, view: _SegmentView) -> tuple[torch.Tensor, ...]:
            cache.view = view
            lora = cache.lora
            if lora is not None:
                lora.enter_rows(rows)
            try:
                if bound is None:
                    result = original(segment, **{k: _row_cut(v, rows, num_rows) for k, v in kwargs.items()})
                else:
                    call = _rows_of(signature, bound, rows, num_rows)
                    call.arguments[first] = segment
                    result = original(*call.args, **call.kwargs)
            finally:
                cache.view = None
                if lora is not None:
                    lora.exit_rows()
            view.write_back()
            results = result if isinstance(result, tuple) else (result,)
            if not results or not isinstance(results[0], torch.Tensor):
                raise TypeError(f"state layer {layer_idx} returned {type(result).__name__}, not tensors")
            outputs.single = not isinstance(result, tuple)
            return results

        if plan.decode_rows is not None:
            rows = plan.decode_rows
            segment = hidden_states[0].index_select(0, rows).unsqueeze(1)
            results = run(rows, segment, _decode_view(cache, layer_idx))
            for out, result in outputs.rows(results, segment):
                out[0].index_copy_(0, rows, result[:, 0])
        for start, end, slot, has_state, checkpoints, proposed, decode_from in plan.segments:
            slots = torch.tensor([slot], device=hidden_states.device)
            first_row = start
            kept = end - proposed - start
            # Pieces that end at each checkpoint (the layer copies its state there) and where the generated tokens
            # of a recomputed sequence begin, then the rest.
            extra = [(decode_from, None)] if 0 < decode_from < kept else []
            cuts = sorted([*checkpoints, *extra, (kept, None)], key=lambda cut: cut[0])
            for offset, checkpoint in cuts:
                stop = start + offset
                if stop > first_row:
                    # Generated tokens (a speculating sequence's rows, a recomputed sequence's after its prompt) are
                    # tokens generate decodes one at a time.
                    decodes = proposed > 0 or first_row - start >= decode_from
                    view = _SegmentView(cache.pool, layer_idx, slots, has_state or first_row > start, decodes)
                    segment = hidden_states[:, first_row:stop]
                    for out, result in outputs.rows(run(slice(first_row, stop), segment, view), segment):
                        out[:, first_row:stop] = result
                    first_row = stop
                if checkpoint is not None:
                    cache.pool.copy_layer(layer_idx, slot, checkpoint)
            if proposed:  # speculative rows: from a copy of the state in the scratch slot, which they leave there
                cache.pool.copy_layer(layer_idx, slot, SCRATCH_SLOT)
                view = _SegmentView(cache.pool, layer_idx, _scratch(hidden_states.device), True, decodes=True)
                segment = hidden_states[:, first_row:end]
                for out, result in outputs.rows(run(slice(first_row, end), segment, view), segment):
                    out[:, first_row:end] = result
        return outputs.result()

    return forward


class _SegmentOutputs:
    """A step's outputs of one state layer, `[1, rows, ...]` each, made on the first segment's results. An output
    that is not one row per input row (MiniMax's lightning attention returns its state beside its rows, which its
    decoder layer drops) comes back as None."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.tensors: list[torch.Tensor | None] | None = None
        self.single = True

    def rows(self, results: tuple[Any, ...], segment: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(step output, segment result) of each output that holds the segment's rows, to be copied in."""
        if self.tensors is None:
            self.tensors = [
                r.new_empty((1, self.num_rows, *r.shape[2:])) if _holds_rows(r, segment) else None for r in results
            ]
        pairs = []
        for index, (out, result) in enumerate(zip(self.tensors, results, strict=True)):
            if out is not None and _holds_rows(result, segment):
                pairs.append((out, result))
            else:
                self.tensors[index] = None
        return pairs

    def result(self) -> Any:
        assert self.tensors is not None and self.tensors[0] is not None, "a step with state rows ran no segment"
        return self.tensors[0] if self.single else tuple(self.tensors)


def _holds_rows(result: Any, segment: torch.Tensor) -> bool:
    return isinstance(result, torch.Tensor) and result.dim() >= 2 and result.shape[:2] == segment.shape[:2]


# The pool's slot 0: no request's, written by whatever needs a state thrown away after the step.
SCRATCH_SLOT = 0


def _scratch(device: torch.device) -> torch.Tensor:
    return torch.tensor([SCRATCH_SLOT], device=device)


def _decode_view(cache: Any, layer_idx: int) -> _SegmentView:
    return _SegmentView(cache.pool, layer_idx, cache.plan.decode_slots, True, decodes=True)


def _rows_of(signature: inspect.Signature, bound: inspect.BoundArguments, rows: Any, num_rows: int) -> Any:
    """The arguments of a segment: every `[1, num_rows, ...]` tensor cut to the segment's rows (a decode batch's
    rows become its batch), inside `*args` and `**kwargs` too; anything else passes as it is."""
    parameters = signature.parameters
    cut = {}
    for name, value in bound.arguments.items():
        kind = parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            cut[name] = tuple(_row_cut(item, rows, num_rows) for item in value)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            cut[name] = {key: _row_cut(item, rows, num_rows) for key, item in value.items()}
        else:
            cut[name] = _row_cut(value, rows, num_rows)
    return inspect.BoundArguments(signature, cut)


def _row_cut(value: Any, rows: Any, num_rows: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == num_rows:
        return value[:, rows] if isinstance(rows, slice) else value[0].index_select(0, rows).unsqueeze(1)
    return value
