"""Many LoRA adapters in one step (`enable_lora=True`; vLLM's `max_loras`, `max_lora_rank`, `max_cpu_loras`).

Adapters are read from PEFT folders (hybridkv/execution/lora_weights.py) into a host cache of at most `max_cpu_loras`
(least recently used read again from its folder when needed), and copied into one of `max_loras` device slots when a
step runs one of their requests. Every linear or embedding layer of the language model that some adapter targets holds
its slots stacked in two tensors allocated once: `a` `[max_loras * max_lora_rank, in]` and `b` `[out, max_loras *
max_lora_rank]` (slot s in rows / columns `s * rank` to `(s + 1) * rank`, a smaller rank zero-padded, the scaling folded
into `b`). A forward hook adds each row's delta to the layer's output:

- every row of the step on one slot (one adapter): `x @ a_s.T @ b_s.T`, two small matmuls;
- rows on several slots (mixed adapters): `((x @ a.T) * mask) @ b.T` over the slots used, `mask` `[rows, slots *
  rank]` keeping each row's own slot's columns (built once a step per set of rows): two matmuls and a multiply for the
  whole step, whatever its mix (benchmarks/multi_lora.py measures it against a gather per slot);
- no row with an adapter: nothing.

On CUDA (the kernels' backend, hybridkv/kernels/backend.py) rows on several slots go to the Triton kernels instead of
the masked matmuls (or, over many rows, a pair of matmuls per slot: `_Rows.groups`): hybridkv/kernels/triton_lora.py's
`lora_shrink` then `lora_expand`, each row times its own slot's A and B only, the rows grouped by slot once per set of
rows. One slot for all rows stays two cuBLAS matmuls.

Which rows a layer sees: the step's tokens (`[1, tokens, in]`), the logits rows (the `lm_head`), or, inside a state
layer run per request segment (hybridkv/execution/state_layers.py), that segment's rows (`rows`). A layer that sees
another count of rows while adapters run is an error, never a delta guessed. Outside a step (a user's own forward,
the probe) the hooks do nothing. The scheduler never runs more than `max_loras` adapters at once
(hybridkv/scheduling/scheduler.py), so a step's adapters always have slots."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from hybridkv.execution.lora_weights import AdapterWeights, LoRAError, read_adapter
from hybridkv.kernels.backend import resolve_backend
from hybridkv.lora.request import AdapterRef, LoRARequest

if TYPE_CHECKING:
    from hybridkv.kernels.triton_lora import RowTiles  # imports triton: the kernels are imported on first use

logger = logging.getLogger("hybridkv")

NO_ADAPTER = -1


@dataclass
class _Target:
    """One layer that adapters may target: its stacked slots (allocated at its first adapter) and hook."""

    name: str
    module: torch.nn.Module
    embedding: bool
    logits: bool = False  # the output layer: it sees the logits rows
    a: torch.Tensor | None = None  # [slots * rank, in]; an embedding's [vocab, slots * rank]
    b: torch.Tensor | None = None  # [out, slots * rank]
    slots: int = 0  # the device slots whose adapter targets it (a bit each)
    handle: Any = None


# Above this many rows with several adapters, each slot's rows are gathered (`_Rows.groups`) rather than masked: the
# masked matmuls cost every slot's columns for every row (benchmarks/multi_lora.py --ways: at 32 rows masking is 2-3x
# faster than gathering per slot; at 1,024 rows over 4 and 16 adapters, 1.5x and 2.6x slower).
_MASKED_ROWS = 128
# The mask's columns (slots used x rank) beyond which the slots' rows are padded into one batched matmul instead
# (`_Rows.padded`: at 32 rows over 16 adapters of rank 16, 80 us against the mask's 171 us for one 512 -> 512 layer;
# over 4 adapters, 66 us against 58: python benchmarks/multi_lora.py --ways).
_MASKED_WIDTH = 64
# Many rows in at most this many slots, each slot's rows consecutive (a few prompts' prefills), go slot by slot
# (`_Rows.groups`: slices read in place); otherwise through the padded batched matmul. At 1,024 interleaved rows over
# 16 adapters --ways measured it at 0.6-0.95 ms against 1.8-2.8 ms gathering each slot's rows apart, but some runs
# put it at 3.6-4.7 ms (its large temporaries; the machine's memory noise): a choice for decode-sized steps first.
_GROUPED_SLOTS = 4


class _Padded(NamedTuple):
    """A step's rows laid out per slot for batched matmuls: `gather` `[used * per_slot]` picks each position's row
    (padding repeats row 0, whose results are dropped), and the rows with a slot (`rows`) read their results at
    `positions`."""

    per_slot: int
    gather: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor


class _Rows:
    """The adapter slots of a set of rows in a step (`values`): one slot for all (`single`); where the kernels run, the
    rows grouped by slot (`tiles`); else for a few rows over few slots, the mask over the slots used (`mask`); for
    many rows in few slots, each slot's rows (`groups`: a slice where they are consecutive, else an index); otherwise
    every slot's rows padded to one batched matmul (`padded`)."""

    __slots__ = ("groups", "mask", "padded", "single", "tiles", "used", "values")

    def __init__(self, values: list[int], device: torch.device, rank: int, dtype: torch.dtype, kernels: bool) -> None:
        distinct = set(values)
        self.values = values
        self.single: int | None = values[0] if len(distinct) == 1 else None
        self.used = max(distinct) + 1
        self.mask: torch.Tensor | None = None
        self.groups: list[tuple[int, slice | torch.Tensor]] | None = None
        self.padded: _Padded | None = None
        self.tiles: RowTiles | None = None
        if self.single is not None:
            return
        if kernels:
            from hybridkv.kernels.triton_lora import row_tiles

            self.tiles = row_tiles(values, device)
            return
        if len(values) <= _MASKED_ROWS and self.used * rank <= _MASKED_WIDTH:
            self.mask = _slot_mask(values, self.used, device, rank, dtype)
            return
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(values):
            if slot != NO_ADAPTER:
                by_slot.setdefault(slot, []).append(row)
        per_slot = max(map(len, by_slot.values()))
        consecutive = all(rows[-1] - rows[0] + 1 == len(rows) for rows in by_slot.values())
        # Padding costs rows of work: a long prefill beside a few decode rows goes slot by slot.
        few = len(by_slot) <= _GROUPED_SLOTS and consecutive
        if len(values) > _MASKED_ROWS and (few or self.used * per_slot > 4 * len(values)):
            self.groups = []
            for slot, rows in sorted(by_slot.items()):
                if rows[-1] - rows[0] + 1 == len(rows):
                    self.groups.append((slot, slice(rows[0], rows[-1] + 1)))
                else:
                    self.groups.append((slot, torch.tensor(rows, device=device)))
            return
        gather = [0] * (self.used * per_slot)
        rows_with_slot, positions = [], []
        for slot, rows in by_slot.items():
            for offset, row in enumerate(rows):
                gather[slot * per_slot + offset] = row
                rows_with_slot.append(row)
                positions.append(slot * per_slot + offset)
        as_tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
        self.padded = _Padded(per_slot, as_tensor(gather), as_tensor(rows_with_slot), as_tensor(positions))


def _slot_mask(values: list[int], used: int, device: torch.device, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """`[rows, used * rank]`: 1 in each row's own slot's columns, 0 elsewhere (everywhere for a row without one)."""
    slots = torch.tensor(values, device=device)
    columns = torch.arange(used, device=device)
    return (slots[:, None] == columns[None]).to(dtype).repeat_interleave(rank, dim=1)


class _Step:
    """The running step's adapter slots: per token, and per logits row; whether rows on several run the kernels."""

    __slots__ = (
        "called", "device", "kernels", "logits_rows", "num_logits", "num_tokens", "request_slots", "rows", "sets",
        "values",
    )  # fmt: skip

    def __init__(
        self,
        request_slots: list[int],
        values: list[int],
        device: torch.device,
        logits_rows: Sequence[int],
        kernels: bool,
    ) -> None:
        self.request_slots = request_slots
        self.values = values
        self.device = device
        self.kernels = kernels
        self.num_tokens = len(values)
        self.logits_rows = logits_rows
        self.num_logits = len(logits_rows)
        self.sets: dict[Any, _Rows | None] = {}
        # A state layer's segment (a slice or index of the step's rows), or ("sequence", i): a latent layer's
        # up-projection over the context of the step's sequence i.
        self.rows: slice | torch.Tensor | tuple[str, int] | None = None
        self.called: set[str] = set()  # the targets whose hook ran


class LoRASlots:
    """The adapters of one engine: host cache, device slots, hooks and the running step's rows (module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
    ) -> None:
        self.max_loras, self.rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype = next(model.parameters()).dtype
        self.targets = _targets(model)
        self._by_module = {id(t.module): t for t in self.targets.values()}
        self.embed_scales = {
            name: float(t.module.embed_scale)
            for name, t in self.targets.items()
            if t.embedding and isinstance(getattr(t.module, "embed_scale", None), (int, float, torch.Tensor))
        }
        self.cache: OrderedDict[str, AdapterWeights] = OrderedDict()  # by name, least recently used first
        self.slot_names: list[str | None] = [None] * max_loras
        self.slot_keys: list[bytes] = [b""] * max_loras
        self.slot_used: list[int] = [0] * max_loras  # the step count at its last use (LRU among slots)
        self.num_steps = 0
        self.loads = 0  # adapters copied into a device slot
        self.reads = 0  # adapters read from their folders
        self.step: _Step | None = None
        # The backend of rows on several slots, resolved per step (hybridkv/kernels/backend.py): None picks the Triton
        # kernels for CUDA tensors; "triton" forces them (tests: the CPU's tensors under TRITON_INTERPRET=1).
        self.backend: str | None = None
        # Per slot, the layers its adapter targets that no step has called yet with its rows: a layer the forward
        # does not call as a module (a fused kernel reading its weight) would leave the delta out, so the first step
        # of each adapter checks that every one of them ran (`verify`); an adapter that fails is refused from then on.
        self.unverified: dict[int, set[str]] = {}
        self.refused: dict[str, str] = {}
        self._lock = threading.Lock()  # the async engine reads adapters in its callers' threads

    # ---- adapters -------------------------------------------------------------------------------------------------

    def adapter(self, request: LoRARequest) -> AdapterWeights:
        """`request`'s adapter, read from its folder unless cached under its name and path (a LoRAError names what is
        wrong with it)."""
        if request.lora_name in self.refused:
            raise LoRAError(self.refused[request.lora_name])
        with self._lock:
            found = self.cache.get(request.lora_name)
            if found is not None and found.request.lora_path == request.lora_path:
                self.cache.move_to_end(request.lora_name)
                return found
        modules = {name: target.module for name, target in self.targets.items()}
        adapter = read_adapter(request, modules, self.rank, self.dtype, self.embed_scales)
        with self._lock:
            self.reads += 1
            self.cache[request.lora_name] = adapter
            self.cache.move_to_end(request.lora_name)
            while len(self.cache) > self.max_cpu_loras:
                self.cache.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget the adapter of that id from the host cache (vLLM's `remove_lora`; a request that still runs it keeps
        its device slot, and one added later reads its folder again); whether it was cached."""
        with self._lock:
            names = [name for name, adapter in self.cache.items() if adapter.request.lora_int_id == lora_int_id]
            for name in names:
                del self.cache[name]
        return bool(names)

    def cached_ids(self) -> set[int]:
        """The ids of the adapters in the host cache (vLLM's `list_loras`)."""
        with self._lock:
            return {adapter.request.lora_int_id for adapter in self.cache.values()}

    # ---- the step's slots ----------------------------------------------------------------------------------------

    def slots_for(self, adapters: Sequence[AdapterRef | None]) -> list[int]:
        """Each request's device slot (NO_ADAPTER for none), loading the adapters not in a slot into the slots no
        request of this step uses (least recently used first). A LoRAError if the step has more adapters than slots
        (the scheduler prevents it) or an adapter's folder changed since its request was added (its key then)."""
        self.num_steps += 1
        # By name and key: a name loaded again from another folder is another adapter.
        slot_of: dict[tuple[str, bytes], int] = {}
        slots = []
        for adapter in adapters:
            if adapter is None:
                slots.append(NO_ADAPTER)
                continue
            request, key = adapter
            slot = slot_of.get((request.lora_name, key))
            if slot is None:
                slot = self._slot_holding(request.lora_name, key)
                if slot is None:
                    slot = self._load(request, key, set(slot_of.values()))
                slot_of[request.lora_name, key] = slot
            self.slot_used[slot] = self.num_steps
            slots.append(slot)
        return slots

    def _slot_holding(self, name: str, key: bytes) -> int | None:
        for slot, held in enumerate(self.slot_names):
            if held == name and self.slot_keys[slot] == key:
                return slot
        return None

    def _load(self, request: LoRARequest, key: bytes, taken: set[int]) -> int:
        adapter = self.adapter(request)
        if adapter.key != key:
            raise LoRAError(
                f"adapter {request.lora_name!r} changed in {request.lora_path!r} since the request was added; "
                "load it under a new lora_name"
            )
        free = [s for s in range(self.max_loras) if s not in taken]
        if not free:
            raise LoRAError(f"a step runs more than max_loras={self.max_loras} adapters")
        slot = min(free, key=lambda s: (self.slot_names[s] is not None, self.slot_used[s]))
        self._clear(slot)
        rank = self.rank
        for module_name, delta in adapter.deltas.items():
            target = self.targets[module_name]
            self._allocate(target)
            r = delta.rank
            columns = slice(slot * rank, slot * rank + r)
            if target.embedding:
                target.a[:, columns] = delta.a.to(target.a.device)
            else:
                target.a[columns] = delta.a.to(target.a.device)
            target.b[:, columns] = delta.b.to(target.b.device)
            target.slots |= 1 << slot
        self.slot_names[slot], self.slot_keys[slot] = request.lora_name, adapter.key
        self.unverified[slot] = set(adapter.deltas)
        self.loads += 1
        return slot

    def _clear(self, slot: int) -> None:
        rank = self.rank
        columns = slice(slot * rank, (slot + 1) * rank)
        for target in self.targets.values():
            if target.slots >> slot & 1:
                if target.embedding:
                    target.a[:, columns] = 0
                else:
                    target.a[columns] = 0
                target.b[:, columns] = 0
                target.slots &= ~(1 << slot)
        self.slot_names[slot], self.slot_keys[slot] = None, b""
        self.unverified.pop(slot, None)

    def _allocate(self, target: _Target) -> None:
        if target.a is not None:
            return
        module, width = target.module, self.max_loras * self.rank
        weight = module.weight
        if target.embedding:
            target.a = weight.new_zeros(module.num_embeddings, width)
            target.b = weight.new_zeros(module.embedding_dim, width)
        else:
            target.a = weight.new_zeros(width, module.in_features)
            target.b = weight.new_zeros(module.out_features, width)
        target.handle = module.register_forward_hook(self._embedding_hook if target.embedding else self._linear_hook)

    # ---- the running step ------------------------------------------------------------------------------------------

    def begin(self, slots: list[int], query_lens: Sequence[int], logits_rows: Sequence[int]) -> None:
        """The step about to run: each request's slot and rows (`query_lens`), and the rows whose logits it computes
        (what the output layer sees, in order)."""
        values = [slot for slot, count in zip(slots, query_lens, strict=True) for _ in range(count)]
        if all(v == NO_ADAPTER for v in values):
            self.step = None
            return
        device = next(iter(self.targets.values())).module.weight.device
        self.step = _Step(slots, values, device, logits_rows, resolve_backend(self.backend, device) == "triton")

    def verify(self) -> None:
        """After a step's forward: every layer an adapter of the step targets ran its hook, the first time that adapter
        runs (module docstring). A RuntimeError names the layers otherwise, and the adapter is refused from then on."""
        step = self.step
        if step is None or not self.unverified:
            return
        for slot in {v for v in step.values if v != NO_ADAPTER}:
            missing = self.unverified.get(slot)
            if missing is None:
                continue
            missing -= step.called
            if missing:
                name = self.slot_names[slot]
                message = (
                    f"adapter {name!r} targets {', '.join(sorted(missing))}, which this model's forward does not call "
                    "as a module (a fused kernel reads its weight), so its delta cannot be applied; train the adapter "
                    "without those modules"
                )
                self.refused[name] = message
                with self._lock:
                    self.cache.pop(name, None)
                self._clear(slot)
                raise RuntimeError(message)
            del self.unverified[slot]

    def end(self) -> None:
        self.step = None

    def enter_rows(self, rows: slice | torch.Tensor) -> None:
        """A state layer's segment runs: its layers see these rows of the step."""
        if self.step is not None:
            self.step.rows = rows

    def exit_rows(self) -> None:
        if self.step is not None:
            self.step.rows = None

    @contextlib.contextmanager
    def sequence(self, index: int) -> Iterator[None]:
        """A latent attention layer's up-projection expands the context of the step's sequence `index`: its rows are
        all that request's (`StepContext.sequence_scope`)."""
        step = self.step
        if step is None:
            yield
            return
        step.rows = ("sequence", index)
        try:
            yield
        finally:
            step.rows = None

    def _rows(self, step: _Step, count: int, logits: bool) -> _Rows | None:
        rows = step.rows
        if isinstance(rows, tuple):  # one sequence's context: every row its request's
            key = (*rows, count)
            if key not in step.sets:
                slot = step.request_slots[rows[1]]
                found = None
                if slot != NO_ADAPTER and count:
                    found = _Rows([slot] * count, step.device, self.rank, self.dtype, step.kernels)
                step.sets[key] = found
            return step.sets[key]
        if rows is not None:
            key = (rows.start, rows.stop) if isinstance(rows, slice) else ("rows", id(rows))
        elif logits and count == step.num_logits:
            key = "logits"
        elif not logits and count == step.num_tokens:
            key = "tokens"
        else:
            raise RuntimeError(
                f"a layer with LoRA adapters saw {count} rows in a step of {step.num_tokens} tokens and "
                f"{step.num_logits} logits rows; hybridkv cannot tell whose rows they are"
            )
        if key in step.sets:
            return step.sets[key]
        if rows is not None:
            index = torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows.cpu()
            values = [step.values[i] for i in index.tolist()]
        elif key == "logits":
            values = [step.values[i] for i in step.logits_rows]
        else:
            values = step.values
        if len(values) != count:
            raise RuntimeError(f"a layer with LoRA adapters saw {count} rows where its segment has {len(values)}")
        found = None
        if any(v != NO_ADAPTER for v in values):
            found = _Rows(values, step.device, self.rank, self.dtype, step.kernels)
        step.sets[key] = found
        return found

    def _hooked(self, module: torch.nn.Module, count: int) -> tuple[_Target, _Rows] | None:
        """A hook's start: the layer's target and the slots of the `count` rows it sees, None where no row of the
        running step (if any) has an adapter on it; the layer is marked as run (`verify`)."""
        step = self.step
        if step is None:
            return None
        target = self._by_module[id(module)]
        if not target.slots:
            return None
        step.called.add(target.name)
        rows = self._rows(step, count, target.logits)
        return None if rows is None else (target, rows)

    def _linear_hook(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        x = args[0]
        hooked = self._hooked(module, x.numel() // x.shape[-1])
        if hooked is None:
            return None
        target, rows = hooked
        flat = x.reshape(-1, x.shape[-1])
        # The layer's own output, a fresh tensor, takes the deltas in place (steps run under inference_mode).
        result = output if output.is_contiguous() else output.contiguous()
        out = result.view(-1, result.shape[-1])
        rank = self.rank
        if rows.single is not None:
            if target.slots >> rows.single & 1:
                columns = slice(rows.single * rank, (rows.single + 1) * rank)
                out.addmm_(flat @ target.a[columns].t(), target.b[:, columns].t())
        elif rows.tiles is not None:
            from hybridkv.kernels.triton_lora import lora_expand, lora_shrink

            lora_expand(lora_shrink(flat, target.a, rows.tiles, rank), target.b, rows.tiles, rank, out)
        elif rows.mask is not None:
            width = rows.used * rank
            out.addmm_((flat @ target.a[:width].t()).mul_(rows.mask), target.b[:, :width].t())
        elif rows.padded is not None:
            padded, used, slots = rows.padded, rows.used, self.max_loras
            batch = flat.index_select(0, padded.gather).view(used, padded.per_slot, -1)
            shrunk = torch.bmm(batch, target.a.view(slots, rank, -1)[:used].transpose(1, 2))
            deltas = torch.bmm(shrunk, target.b.t().view(slots, rank, -1)[:used]).view(used * padded.per_slot, -1)
            out.index_add_(0, padded.rows, deltas.index_select(0, padded.positions))
        else:
            for slot, index in rows.groups:
                if target.slots >> slot & 1:
                    columns = slice(slot * rank, (slot + 1) * rank)
                    if isinstance(index, slice):
                        out[index].addmm_(flat[index] @ target.a[columns].t(), target.b[:, columns].t())
                    else:
                        part = flat.index_select(0, index)
                        out.index_add_(0, index, (part @ target.a[columns].t()) @ target.b[:, columns].t())
        return None if result is output else result

    def _embedding_hook(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        ids = args[0]
        hooked = self._hooked(module, ids.numel())
        if hooked is None:
            return None
        target, rows = hooked
        flat = ids.reshape(-1)
        rank = self.rank
        if rows.single is not None:
            if not target.slots >> rows.single & 1:
                return None
            columns = slice(rows.single * rank, (rows.single + 1) * rank)
            delta = target.a[:, columns].index_select(0, flat) @ target.b[:, columns].t()
        else:
            width = rows.used * rank
            mask = self._mask(rows, flat.device)
            delta = (target.a[:, :width].index_select(0, flat) * mask) @ target.b[:, :width].t()
        return output + delta.view(output.shape)

    def _mask(self, rows: _Rows, device: torch.device) -> torch.Tensor:
        """The mask of a row set kept otherwise (an embedding over many rows: one gather, then the mask)."""
        if rows.mask is None:
            rows.mask = _slot_mask(rows.values, rows.used, device, self.rank, self.dtype)
        return rows.mask

    def stats(self) -> dict[str, Any]:
        return {
            "max_loras": self.max_loras,
            "slots": [name for name in self.slot_names],
            "cached": list(self.cache),
            "loads": self.loads,
            "reads": self.reads,
        }

    def close(self) -> None:
        """Remove the hooks and free the stacks (unpatch)."""
        for target in self.targets.values():
            if target.handle is not None:
                target.handle.remove()
            target.handle = target.a = target.b = None
            target.slots = 0
        self.cache.clear()
        self.step = None


def _targets(model: torch.nn.Module) -> dict[str, _Target]:
    """The linear and embedding layers of the language model (its decoder, its input embeddings and its output
    layer) by qualified name: what adapters may target. A vision tower's layers run outside the steps and are not
    among them."""
    named = {id(module): name for name, module in model.named_modules()}
    roots = []
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for root in (decoder, model.get_input_embeddings(), model.get_output_embeddings()):
        if isinstance(root, torch.nn.Module) and id(root) in named:
            roots.append(root)
    if not roots:
        roots.append(model)
    output = model.get_output_embeddings()
    targets: dict[str, _Target] = {}
    for root in roots:
        prefix = named[id(root)]
        for name, module in root.named_modules(prefix=prefix):
            embedding = isinstance(module, torch.nn.Embedding)
            if (embedding or isinstance(module, torch.nn.Linear)) and name not in targets:
                targets[name] = _Target(name, module, embedding, logits=module is output)
    return targets
