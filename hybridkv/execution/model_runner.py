"""The model runner: KV tensors, the persistent batch and step buffers, one forward of the flattened batch."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridkv.execution.compilation import CannotCompile, step_forward
from hybridkv.execution.compiled_forward import CompiledForward
from hybridkv.execution.graphs import DecodeGraphs, padding_arrays
from hybridkv.execution.input_batch import InputBatch
from hybridkv.execution.kv_dtypes import LayerDtypes
from hybridkv.execution.latent_layers import StepKVCache, cache_argument, latent_ups
from hybridkv.execution.lora import LoRASlots
from hybridkv.execution.multimodal import MultiModalInputs, image_embeddings_placed
from hybridkv.execution.state_continuations import continue_states, continued_forward
from hybridkv.execution.state_layers import StatePlan, StatePool, StepStateCache, segmented_forward
from hybridkv.kernels import (
    PagedAttentionMetadata,
    allocate_kv_pages,
    check_layer_cache,
    kv_page_views,
    resolve_backend,
)
from hybridkv.kernels.metadata import KeyLimits
from hybridkv.kernels.step_buffers import StepBuffers
from hybridkv.memory.block_pool import cdiv
from hybridkv.memory.coordinator import TableUpdates
from hybridkv.memory.grouping import KVCacheConfig
from hybridkv.memory.kv_spec import StateSpec
from hybridkv.memory.prompt_images import PromptImages
from hybridkv.patches.attention import LayerKV, StepContext, running_step
from hybridkv.patches.devices import execution_device, input_device
from hybridkv.patches.latent import LatentLayer
from hybridkv.patches.layer_kinds import text_config
from hybridkv.patches.own_state import cache_state_forward, keeps_own_state
from hybridkv.scheduling.output import SchedulerOutput

# A module attribute the runner set that the module did not have.
_MISSING = object()


class _Zeros:
    """A pending row's input ids until the forward writes the sampled one (`ModelRunner._place_pending_tokens`)."""

    def __getitem__(self, index: int) -> int:
        return 0


_PLACEHOLDER = _Zeros()


@dataclass(frozen=True)
class RunnerLimits:
    """The largest step a runner serves (its step buffers' sizes), and how it runs decode steps: padded to
    `decode_buckets` sizes (graph mode: captured as CUDA graphs on a GPU, run eagerly over the same padded
    buffers elsewhere; empty: eager, unpadded), and whether the forward is compiled (`torch.compile`)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    decode_buckets: tuple[int, ...] = ()
    compile: bool = False
    # compile=True was asked for (a model that cannot be compiled is then an error, not a warning)
    compile_required: bool = False
    use_tqdm: bool = False


class ModelRunner:
    """Runs one scheduled step as a single forward over all of its tokens.

    One page tensor per device that holds a layer (`[num_blocks, page bytes]`, see
    hybridkv/memory/grouping.py); each layer that holds pages gets K and V views of its slot in its own dtype
    (hybridkv/execution/kv_dtypes.py), and a KV-sharing layer reads its source layer's views. A step's tokens,
    positions, lengths, block tables and slots are written into `StepBuffers` (one per device, allocated
    once: hybridkv/kernels/step_buffers.py) from the persistent batch (`InputBatch`: each request's block
    table row kept between steps, hybridkv/execution/input_batch.py).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_config: KVCacheConfig,
        module_names: dict[int, str],
        num_blocks: int,
        layer_dtypes: LayerDtypes,
        limits: RunnerLimits,
        backend: str | None = None,
        states: list[StateSpec] | None = None,
        num_state_slots: int = 0,
        latent: dict[int, LatentLayer] | None = None,
    ) -> None:
        self.model = model
        self.kv_config = kv_config
        self.limits = limits
        named = dict(model.named_modules())
        self.input_device = input_device(model)
        devices = {idx: execution_device(named, name) for idx, name in module_names.items()}
        # One page tensor per device that computes a layer, whatever its group.
        self._pages = {
            device: allocate_kv_pages(num_blocks, kv_config.block_bytes, torch.uint8, device)
            for device in dict.fromkeys(devices.values())
        }
        # Metadata is written once per (device, group) each step; a layer reads the copy on its device.
        self.devices = list(self._pages)
        self.layers = layer_views(kv_config, layer_dtypes, self._pages, devices)
        for layer_idx, up in latent_ups(model, latent or {}).items():
            self.layers[layer_idx].latent = up
        # Passed to every forward: one object for the runner's life, its metadata replaced each step.
        self.context = StepContext(self.layers)
        self.batch = InputBatch(kv_config, limits.max_model_len, limits.max_num_seqs)
        max_num_tokens = max(limits.max_num_batched_tokens, max(limits.decode_buckets, default=1))
        self.buffers = self._step_buffers(backend, max_num_tokens)
        self.buffers_max_tokens = max_num_tokens  # every device's buffers hold this many rows
        self._groups_in_order = [self.batch.group_slots[group.group_id] for group in kv_config.groups]
        self._all_rows = np.arange(max_num_tokens, dtype=np.int64)
        self._ones = np.ones(max(max_num_tokens, limits.max_num_seqs), dtype=np.int64)
        self._forward_fn = self._forward
        # The compiled forward (hybridkv/execution/compiled_forward.py), found at warm-up; why not, if it cannot be.
        self.compiled = CompiledForward(model, self.input_device, limits.use_tqdm) if limits.compile else None
        self.compile_error: str | None = None
        self.graphs: DecodeGraphs | None = None
        self.graph_error: str | None = None
        self.states = list(states or ())
        self.state_pool = self.state_cache = None
        # LoRA adapters' slots and hooks (hybridkv/execution/lora.py; the engine sets them with enable_lora).
        self.lora: LoRASlots | None = None
        self._wrapped: list[torch.nn.Module] = []
        # Puts back the transformers functions whose states hybridkv continues (execution/state_continuations.py).
        self._restore_continuations: Callable[[], None] = lambda: None
        # Attention modules that serve a layer without its index of their own (Zamba2's shared block, which takes it
        # as an argument): given it while the runner lives, for the attention function to find the layer's pages.
        self._adopted: list[tuple[torch.nn.Module, Any]] = []
        for layer_idx, name in module_names.items():
            self._give_layer_idx(named[name], layer_idx)
        # What a step passes the model as its cache (`_forward`): one for state layers or latent attention layers.
        self.latent_layers = frozenset(latent or ())
        self.step_cache: dict[str, StepKVCache] = {}
        if self.states:
            self._wire_state_layers(named, num_state_slots)
        elif self.latent_layers:
            cache = StepKVCache(text_config(model.config), self.latent_layers)
            self.step_cache = {cache_argument(model): cache}
            if self.compiled is not None:  # its updates trace into store ops
                self.compiled.trace_kwargs = self.step_cache
        # A decode step's buffers are written from its lists (StepBuffers.decode_step) with one device, no decode
        # buckets (graph mode pads the step) and no state layers (their plan reads numpy arrays).
        self._plain_decode = len(self.devices) == 1 and not self.limits.decode_buckets and not self.states
        # Tests set it to the coordinator's `block_tables`: every step then checks the persistent rows.
        self.verify_tables = None
        # Async scheduling: the tokens the step in flight sampled, on the device (hybridkv/engine/async_steps.py).
        self.pending_tokens = None
        # On a GPU: recorded once a step's copies from the host's step buffers are queued. The next step writes
        # those buffers only after it (a step may be prepared while the one before still runs: async scheduling).
        self._inputs_sent: torch.cuda.Event | None = None
        self.prepare_seconds = 0.0  # building inputs and metadata (host work per step)
        self.forward_seconds = 0.0
        self._swap_pages: dict[torch.device, torch.Tensor] = {}
        # The host tier's slots (hybridkv/memory/tiers.py): per device, a CPU page per slot.
        self.host_pages: dict[torch.device, torch.Tensor] = {}
        self.host_states: StatePool | None = None
        self._swap_states: StatePool | None = None
        self.kv_cache_bytes = sum(pages.numel() * pages.element_size() for pages in self._pages.values())
        # While the engine sleeps: the tensors whose storages `sleep` emptied, with their sizes; and whether it had
        # captured decode graphs (`wake_up` captures them again).
        self._asleep: list[tuple[torch.Tensor, int]] = []
        self._capture_on_wake = False

    def _step_buffers(self, backend: str | None, max_num_tokens: int) -> dict[torch.device, StepBuffers]:
        """The step's tensors on every device that computes a layer or takes the inputs, each holding the largest
        step: its rows, sequences and block tables (per block size: its groups, the most blocks a sequence holds)."""
        limits = self.limits
        table_shapes = {
            block_size: (len(table), cdiv(limits.max_model_len, block_size))
            for block_size, table in self.batch.tables.items()
        }
        return {
            device: StepBuffers(
                device, resolve_backend(backend, device), limits.max_num_seqs, max_num_tokens, table_shapes
            )
            for device in {*self.devices, self.input_device}
        }

    def _give_layer_idx(self, module: torch.nn.Module, layer_idx: int) -> None:
        """`module` answers to layer `layer_idx` until `close` (the attention function and a state layer's cache calls
        find the layer by it)."""
        if getattr(module, "layer_idx", None) != layer_idx:
            self._adopted.append((module, module.__dict__.get("layer_idx", _MISSING)))
            module.layer_idx = layer_idx

    def _wire_state_layers(self, named: dict[str, torch.nn.Module], num_state_slots: int) -> None:
        """State layers: their states' pool, the cache a step gives the model, and each layer's module run per
        request segment (hybridkv/execution/state_layers.py) until `close`."""
        state_devices = {spec.layer_idx: execution_device(named, spec.module_name) for spec in self.states}
        self.state_pool = StatePool(self.states, num_state_slots, state_devices)
        self.state_cache = StepStateCache(
            text_config(self.model.config), self.state_pool, latent_layers=self.latent_layers
        )
        self.step_cache = {cache_argument(self.model): self.state_cache}
        for spec in self.states:
            module = named[spec.module_name]
            if keeps_own_state(module):  # RecurrentGemma's blocks: their state through the cache (patches/own_state.py)
                self._give_layer_idx(module, spec.layer_idx)
                forward = cache_state_forward(module)
            else:
                forward = continued_forward(module)
            module.forward = segmented_forward(forward, spec.layer_idx)
            self._wrapped.append(module)
        self._restore_continuations = continue_states(self._wrapped)

    def warm_up(self, capture: bool) -> None:
        """At patch time, not in a user's first step: find the compiled forward (`compile`: loaded from the
        disk cache, else traced and compiled), then capture a CUDA graph of a decode step at every decode bucket
        (`capture`: graph mode on one GPU). A model that cannot be compiled runs eagerly with a warning naming
        the cause (a ValueError when compile=True was asked for). A graph that cannot be captured (a model
        whose own code syncs with the host, e.g. to loop over the experts a router picked) leaves every decode
        step eager, with a warning; `graph_error` says why."""
        if self.compiled is not None:
            self._take_program(self.compiled.prepare, at_patch=True)
        if capture:
            self.capture_graphs()

    def follow_model(self) -> bool:
        """After the engine saw the model change: the compiled forward for the model as it is now. Whether what
        a captured graph replays changed (the program, or compiling stopped)."""
        if self.compiled is None:
            return False
        before = self._forward_fn
        self._take_program(self.compiled.prepare, at_patch=False)
        return self._forward_fn is not before

    def _take_program(self, prepare, at_patch: bool) -> None:
        try:
            with torch.inference_mode(), running_step(self.context):
                self._forward_fn = prepare(self._padding_example)
                self.context.store_deferred(list(self.context.deferred))
        except CannotCompile as exc:
            self._forward_fn, self.compiled = self._forward, None
            self.compile_error = str(exc)
            message = f"{type(self.model).__name__}'s forward cannot be compiled: {exc}"
            if self.limits.compile_required and at_patch:
                raise ValueError(f"compile=True: {message}; patch it with compile=False") from exc
            warnings.warn(f"hybridkv: {message}; it runs eagerly", stacklevel=4)

    def _padding_example(self) -> tuple[StepContext, tuple[torch.Tensor, ...]]:
        """A step of 3 padding rows keeping 2 logits rows (both sizes > 1 and unequal: a trace over it is
        general in both) to trace and check a compiled forward over; the deferred stores of the last one run
        first."""
        self.context.store_deferred(list(self.context.deferred))
        return self._padded_step(3, num_logits_rows=2)

    def _padded_step(
        self, bucket: int, num_logits_rows: int | None = None
    ) -> tuple[StepContext, tuple[torch.Tensor, ...]]:
        """A step of `bucket` padding rows written into the step buffers: the context (its metadata set) and the
        forward's inputs, every row's logits kept unless `num_logits_rows` says otherwise."""
        prepared = self.padding_step(bucket)
        self.context.metadata = prepared.metadata
        rows = bucket if num_logits_rows is None else num_logits_rows
        return self.context, self.buffers[self.input_device].model_inputs(bucket, rows)

    def capture_graphs(self) -> None:
        """Capture a decode step's CUDA graph at every decode bucket, dropping any captured before (a weight moved
        to another address since: hybridkv/execution/model_watch.py); a capture that fails leaves decode steps eager,
        with a warning."""
        self.graphs = None  # the old graphs' memory goes back before the new ones take theirs
        graphs = DecodeGraphs(
            self.limits.decode_buckets, self._padded_step, self._forward_fn, self.input_device, self.limits.use_tqdm
        )
        try:
            graphs.capture()
        except Exception as exc:
            self.graph_error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
            warnings.warn(
                f"hybridkv could not capture {type(self.model).__name__}'s decode step as a CUDA graph "
                f"({self.graph_error}); its decode steps run eagerly",
                stacklevel=4,
            )
        else:
            self.graphs, self.graph_error = graphs, None

    def sleep(self) -> None:
        """Give back the device memory of the pages, the state slots and the captured graphs (`LLMEngine.sleep`):
        each storage is emptied in place, so the tensors, and the views of them every layer and the step caches hold,
        stay, and `wake_up` fills them again."""
        self._capture_on_wake = self.graphs is not None
        self.graphs = None
        held = list(self._pages.values())
        if self.state_pool is not None:
            held += [t for layer_idx in self.state_pool.conv for t in self.state_pool.tensors(layer_idx)]
        for tensor in held:
            storage = tensor.untyped_storage()
            self._asleep.append((tensor, storage.nbytes()))
            storage.resize_(0)
        if any(device.type == "cuda" for device in self.devices):
            torch.cuda.empty_cache()  # to the device, for another process too (vLLM's sleep frees it so)

    @property
    def asleep(self) -> bool:
        return bool(self._asleep)

    def wake_up(self, capture: bool = True) -> None:
        """Allocate again what `sleep` gave back, zeroed as at patch time, and capture the decode graphs again where
        there were some (the storages have new addresses). `capture=False` (the weights are still asleep) leaves the
        capture to `capture_pending_graphs`."""
        for tensor, nbytes in self._asleep:
            tensor.untyped_storage().resize_(nbytes)
            tensor.zero_()
        self._asleep = []
        if capture:
            self.capture_pending_graphs()

    def capture_pending_graphs(self) -> None:
        """Capture the decode graphs `sleep` dropped, if `wake_up` has not yet."""
        if self._capture_on_wake:
            self._capture_on_wake = False
            self.capture_graphs()

    def close(self) -> None:
        """Give the state layers' modules their own forward back (the model as it was) and drop the device memory
        the runner holds (pages, swap pages, captured graphs, states, step metadata), so that an engine patched
        next sizes its pool from what the device then has free; the runner is unusable after."""
        for module in self._wrapped:
            module.__dict__.pop("forward", None)
        self._wrapped = []
        self._restore_continuations()
        for module, layer_idx in self._adopted:
            if layer_idx is _MISSING:
                del module.layer_idx
            else:
                module.layer_idx = layer_idx
        self._adopted = []
        self.layers.clear()
        self.context.metadata = []
        self.context.deferred.clear()
        self._pages = {}
        self._asleep = []
        self._swap_pages = {}
        self.host_pages = {}
        self.host_states = None
        self._swap_states = None
        self.graphs = None
        self.state_pool = self.state_cache = None

    def allocate_swap_space(self, num_cpu_blocks: int) -> None:
        """CPU pages for num_cpu_blocks blocks per device (pinned when the cache is on CUDA)."""
        if num_cpu_blocks == 0:
            return
        for device, pages in self._pages.items():
            self._swap_pages[device] = torch.empty(
                (num_cpu_blocks, pages.shape[1]), dtype=pages.dtype, pin_memory=device.type == "cuda"
            )

    def allocate_state_swap_space(self, num_slots: int) -> None:
        """CPU state slots for swapped requests' states (pinned when a state layer runs on CUDA); slot 0 unused."""
        if num_slots and self.state_pool is not None:
            pinned = any(t.is_cuda for ts in self.state_pool.conv.values() for t in ts) or any(
                t.is_cuda for ts in self.state_pool.recurrent.values() for t in ts
            )
            cpu = {spec.layer_idx: torch.device("cpu") for spec in self.states}
            self._swap_states = StatePool(self.states, num_slots + 1, cpu, pin_memory=pinned)

    def swap(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        """Copy blocks device -> CPU (device id, CPU id), then CPU -> device (CPU id, device id): a block
        id is one page, every layer's K and V of its group."""
        for pairs, outbound in ((swap_out, True), (swap_in, False)):
            if not pairs:
                continue
            for device, pages in self._pages.items():
                device_ids = torch.tensor([p[0] if outbound else p[1] for p in pairs], device=device)
                cpu_ids = torch.tensor([p[1] if outbound else p[0] for p in pairs])
                cpu_pages = self._swap_pages[device]
                if outbound:
                    cpu_pages[cpu_ids] = pages[device_ids].to("cpu")
                else:
                    pages[device_ids] = cpu_pages[cpu_ids].to(device)

    def allocate_host_tier(self, num_slots: int) -> None:
        """CPU pages for the host tier's slots, per device (pinned when the cache is on CUDA)."""
        for device, pages in self._pages.items():
            self.host_pages[device] = torch.zeros(
                (num_slots, pages.shape[1]), dtype=pages.dtype, pin_memory=device.type == "cuda"
            )

    def offload(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy blocks to host slots, (device block, host slot) pairs, on every device: one indexed copy each."""
        for device, pages in self._pages.items():
            blocks = torch.tensor([block for block, _ in pairs], device=device)
            slots = torch.tensor([slot for _, slot in pairs])
            self.host_pages[device][slots] = pages[blocks].to("cpu", non_blocking=device.type == "cuda")

    def restore(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host slots back into blocks, (host slot, device block) pairs, on every device."""
        for device, pages in self._pages.items():
            slots = torch.tensor([slot for slot, _ in pairs])
            blocks = torch.tensor([block for _, block in pairs], device=device)
            pages[blocks] = self.host_pages[device][slots].to(device, non_blocking=device.type == "cuda")

    def read_pages(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """The blocks' pages on the CPU, per device in the runner's order: a [len(block_ids), page bytes] uint8
        tensor each (what the disk store writes)."""
        return [pages[torch.tensor(block_ids, device=device)].cpu() for device, pages in self._pages.items()]

    def write_host_slot(self, slot: int, payload: bytearray | memoryview) -> bool:
        """Fill a host slot from a block's bytes, every device's page in the runner's order (what `read_pages`
        gives, concatenated); False, writing nothing, when the length differs. On CUDA, copies that read the host
        slots are finished first (a slot freed by the last step may still be read by its restore)."""
        if len(payload) != self.page_bytes_all_devices:
            return False
        if any(device.type == "cuda" for device in self._pages):
            torch.cuda.synchronize()
        data = torch.frombuffer(payload, dtype=torch.uint8)
        start = 0
        for device in self._pages:
            row = self.host_pages[device][slot]
            row.copy_(data[start : start + row.numel()])
            start += row.numel()
        return True

    def allocate_host_state_tier(self, num_slots: int) -> None:
        """CPU state slots for the host tier's state checkpoints (pinned when a state layer runs on CUDA)."""
        pinned = any(t.is_cuda for ts in self.state_pool.conv.values() for t in ts) or any(
            t.is_cuda for ts in self.state_pool.recurrent.values() for t in ts
        )
        cpu = {spec.layer_idx: torch.device("cpu") for spec in self.states}
        self.host_states = StatePool(self.states, num_slots, cpu, pin_memory=pinned)

    def read_states(self, slots: Sequence[int]) -> list[torch.Tensor]:
        """The slots' states on the CPU, one uint8 tensor [len(slots), bytes] per state tensor (what the disk store
        writes of a checkpoint)."""
        index = torch.tensor(slots)
        return [
            tensor[index.to(tensor.device)].cpu().contiguous().view(torch.uint8).reshape(len(slots), -1)
            for layer_idx in self.state_pool.conv
            for tensor in self.state_pool.tensors(layer_idx)
        ]

    def write_host_state(self, slot: int, payload: bytearray | memoryview) -> bool:
        """Fill a host state slot from a checkpoint's bytes (what `read_states` gives, concatenated); False, writing
        nothing, when the length differs."""
        tensors = [t for layer_idx in self.host_states.conv for t in self.host_states.tensors(layer_idx)]
        sizes = [t[slot].numel() * t.element_size() for t in tensors]
        if len(payload) != sum(sizes):
            return False
        if any(device.type == "cuda" for device in self._pages):
            torch.cuda.synchronize()
        data = torch.frombuffer(payload, dtype=torch.uint8)
        start = 0
        for tensor, size in zip(tensors, sizes, strict=True):
            tensor[slot].view(torch.uint8).reshape(-1).copy_(data[start : start + size])
            start += size
        return True

    @property
    def page_bytes_all_devices(self) -> int:
        """The bytes of one block on every device together (a host slot's, a disk file's payload)."""
        return sum(pages.shape[1] * pages.element_size() for pages in self._pages.values())

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: each (source, destination) block's page, every layer's K and V of its group,
        on every device. All sources are read before any destination is written."""
        if not pairs:
            return
        for device, pages in self._pages.items():
            sources = torch.tensor([p[0] for p in pairs], device=device)
            destinations = torch.tensor([p[1] for p in pairs], device=device)
            pages[destinations] = pages[sources]

    def execute(
        self, plan: SchedulerOutput, logits_rows: Sequence[int] | None = None, extra_rows: Sequence[int] = ()
    ) -> torch.Tensor:
        """Compute the plan's tokens in one forward and return float32 logits of `logits_rows` of the
        flattened batch (by default the last row of each request that samples, once per sample drawn
        from it: the rows of `plan.sampling`), then those of `extra_rows` (prompt logprobs)."""
        return self.forward(self.prepare(self.step_inputs(plan, logits_rows, extra_rows)))

    def step_inputs(
        self, plan: SchedulerOutput, logits_rows: Sequence[int] | None = None, extra_rows: Sequence[int] = ()
    ) -> StepInputs:
        """The plan as plain lists (what another rank needs to run the same step)."""
        start_time = time.perf_counter()
        inputs = StepInputs(
            [],
            [],
            [],
            [],
            [],
            plan.table_updates,
            plan.swap_out,
            plan.swap_in,
            plan.blocks_to_copy,
            logits_rows,
            state_copies=plan.state_copies,
            state_checkpoints=plan.state_checkpoints,
            state_fork_copies=plan.state_fork_copies,
            state_swap_out=plan.state_swap_out,
            state_swap_in=plan.state_swap_in,
            offload=plan.tier_copies.offload,
            restore=plan.tier_copies.restore,
            state_offload=plan.state_tier_copies.offload,
            state_restore=plan.state_tier_copies.restore,
        )
        request_ids, input_ids, query_lens, seq_lens = (
            inputs.request_ids,
            inputs.input_ids,
            inputs.query_lens,
            inputs.seq_lens,
        )
        sample_rows = inputs.logits_rows
        # The lists' appends bound once, and the rows counted here: this loop runs per request and step.
        add_id, add_token, add_query, add_seq, add_row = (
            request_ids.append, input_ids.append, query_lens.append, seq_lens.append, sample_rows.append
        )  # fmt: skip
        num_rows = 0
        has_states = bool(self.states)  # a prompt's one-token chunk is told apart for state layers alone
        proposals, stored = plan.spec_tokens, plan.spec_stored
        for request, num_new, samples in plan.scheduled:
            start = request.num_computed_tokens
            end = start + num_new
            token_ids = request.token_ids
            if num_new < 1 or end > len(token_ids):
                if not (num_new == 1 and end == len(token_ids) + request.num_pending_tokens):
                    raise ValueError(
                        f"request {request.request_id!r}: a step must compute 1 to {request.num_tokens - start} of "
                        f"its tokens, not {num_new}"
                    )
                # Its token is still on the device (async scheduling): the forward reads it there.
                inputs.pending_rows.append((num_rows, request.request_id))
                token_ids = _PLACEHOLDER
            add_id(request.request_id)
            if request.multimodal is not None and start < request.num_prompt_tokens:
                _image_rows(inputs, request.multimodal, start, end, num_rows)
            if num_new == 1:
                add_token(token_ids[start])
                if has_states and 0 < start < request.num_prompt_tokens:
                    inputs.prompt_singles.add(request.request_id)
            else:
                input_ids.extend(token_ids[start:end])
                if has_states and end > request.num_prompt_tokens:  # a recomputed sequence's generated tokens
                    inputs.generated_from[request.request_id] = max(0, request.num_prompt_tokens - start)
            num_rows += num_new
            proposed = proposals.get(request.request_id) if proposals else None
            if proposed:  # its last row and each proposal's give logits; the proposals' rows store nothing unless
                # their blocks are allocated (`SchedulerOutput.spec_stored`)
                input_ids.extend(proposed)
                count = len(proposed)
                sample_rows.extend(range(num_rows - 1, num_rows + count))
                if not stored:
                    inputs.unstored_rows.extend(range(num_rows, num_rows + count))
                    inputs.spec_counts[request.request_id] = count
                num_rows += count
                add_query(num_new + count)
                add_seq(end + count)
                continue
            add_query(num_new)
            add_seq(end)
            if len(samples) == 1:
                add_row(num_rows - 1)
            elif samples:  # one row of logits per sample that draws from it (forks share their leader's)
                sample_rows.extend([num_rows - 1] * len(samples))
        if extra_rows:
            inputs.requested_rows = [*(sample_rows if logits_rows is None else logits_rows), *extra_rows]
        if self.lora is not None:
            inputs.lora_slots = self.lora.slots_for([s.request.lora for s in plan.scheduled])
        self.prepare_seconds += time.perf_counter() - start_time
        if self.verify_tables is not None:
            inputs.checked_tables = self.verify_tables(request_ids)
        return inputs

    def prepare(self, inputs: StepInputs) -> PreparedStep:
        """Apply the step's table updates to the persistent batch, then write the step into the step buffers
        and return its metadata (None when it computes no token): everything that can fail before the step
        changes any KV page."""
        start_time = time.perf_counter()
        if self._inputs_sent is not None:
            self._inputs_sent.synchronize()
        self.batch.apply(inputs.table_updates)
        if not inputs.query_lens:
            self.prepare_seconds += time.perf_counter() - start_time
            return PreparedStep(inputs, None, 0, 0, None)
        if inputs.checked_tables is not None:
            self.batch.check(inputs.request_ids, inputs.checked_tables)
        num_seqs = len(inputs.query_lens)
        input_ids: list[int] | np.ndarray = inputs.input_ids
        decode_only = len(input_ids) == num_seqs
        # Python's max of the list: a numpy call costs tens of microseconds after a forward has evicted its code.
        longest = max(inputs.seq_lens)
        if longest > self.limits.max_model_len or len(input_ids) > self.buffers_max_tokens:
            raise ValueError(
                f"the step ({len(input_ids)} rows, sequences up to {longest} tokens) is larger "
                f"than the runner's buffers ({self.buffers_max_tokens} rows, max_model_len "
                f"{self.limits.max_model_len})"
            )
        if decode_only and self._plain_decode and not inputs.image_rows and inputs.requested_rows is None:
            # Written from the lists without a numpy call (StepBuffers.decode_step), where the C fill is built.
            by_size = self.buffers[self.input_device].decode_step(
                input_ids, inputs.seq_lens, inputs.request_ids, self.batch.rows, inputs.logits_rows, self.batch.tables
            )
            if by_size is not None:
                metadata = [by_size[block_size][index] for block_size, index in self._groups_in_order]
                self.prepare_seconds += time.perf_counter() - start_time
                return PreparedStep(inputs, metadata, num_seqs, len(inputs.logits_rows), None, None)
        seq_lens = np.array(inputs.seq_lens, dtype=np.int64)
        query_lens = self._ones[:num_seqs] if decode_only else np.array(inputs.query_lens, dtype=np.int64)
        rows = np.fromiter(map(self.batch.rows.__getitem__, inputs.request_ids), dtype=np.int64, count=num_seqs)
        bucket = self._bucket(num_seqs) if decode_only and not inputs.image_rows else None
        if bucket is not None and bucket > num_seqs:
            padding = bucket - num_seqs
            query_lens = self._ones[:bucket]
            seq_lens = np.concatenate([seq_lens, self._ones[:padding]])
            rows = np.concatenate([rows, np.full(padding, self.batch.padding_row, dtype=np.int64)])
            input_ids = [*input_ids, *([0] * padding)]
        if decode_only:
            positions = seq_lens - 1
        else:
            first_rows = np.cumsum(query_lens) - query_lens
            positions = np.repeat(seq_lens - query_lens - first_rows, query_lens) + self._all_rows[: len(input_ids)]
        metadata: list[PagedAttentionMetadata] = []
        unstored = np.array(inputs.unstored_rows, dtype=np.int64) if inputs.unstored_rows else None
        for device in self.devices:
            by_size = self.buffers[device].step(query_lens, seq_lens, positions, self.batch.tables, rows, unstored)
            metadata.extend(by_size[block_size][index] for block_size, index in self._groups_in_order)
        state_plan = self._state_plan(inputs, query_lens, seq_lens, rows) if self.states else None
        num_rows = len(input_ids)
        wanted = inputs.logits_rows if inputs.requested_rows is None else list(inputs.requested_rows)
        picked = None
        if bucket is not None:  # graph mode keeps every row's logits (a graph's output), picks the wanted after
            picked = self.buffers[self.input_device].pick(wanted)
            wanted = self._all_rows[:num_rows]
        self.buffers[self.input_device].fill_inputs(input_ids, positions, wanted)
        key_limits = None
        if inputs.key_limit_rows:  # image rows that see past themselves: their last visible positions
            last = np.asarray(positions, dtype=np.int64).copy()
            for row, extra in inputs.key_limit_rows:
                last[row] += extra
            last_positions = torch.from_numpy(last.astype(np.int32)).to(self.input_device)
            key_limits = KeyLimits(inputs.key_limit_rows, last_positions)
        self.prepare_seconds += time.perf_counter() - start_time
        return PreparedStep(inputs, metadata, num_rows, len(wanted), picked, bucket, state_plan, key_limits)

    def _state_plan(
        self, inputs: StepInputs, query_lens: np.ndarray, seq_lens: np.ndarray, rows: np.ndarray
    ) -> StatePlan:
        """The step's request segments for the state layers: its decode rows (one new token after earlier ones)
        run together, every other sequence alone, with the state checkpoints each writes."""
        slots = self.batch.state_slots[rows]
        decode = (query_lens == 1) & (seq_lens > 1)
        if inputs.prompt_singles:  # a prompt's one token after earlier ones: computed as the prompt's forward does
            decode &= np.array([request_id not in inputs.prompt_singles for request_id in inputs.request_ids])
        first_rows = np.cumsum(query_lens) - query_lens
        device = self.input_device
        decode_rows = decode_slots = None
        if decode.any():
            decode_rows = torch.from_numpy(first_rows[decode]).to(device)
            decode_slots = torch.from_numpy(slots[decode]).to(device)
        planned = inputs.state_checkpoints
        segments, after = [], []
        proposed = inputs.spec_counts
        for request_id, first, length, total, slot, is_decode in zip(
            inputs.request_ids, first_rows, query_lens, seq_lens, slots, decode, strict=True
        ):
            checkpoints = tuple(planned.get(request_id, ()))
            if is_decode:
                after.extend((int(slot), checkpoint) for _, checkpoint in checkpoints)
            else:
                spec = proposed.get(request_id, 0) if proposed else 0
                decode_from = inputs.generated_from.get(request_id, int(length))
                segment = (
                    int(first),
                    int(first + length),
                    int(slot),
                    bool(total > length),
                    checkpoints,
                    spec,
                    decode_from,
                )
                segments.append(segment)
        return StatePlan(decode_rows, decode_slots, segments, after)

    def padding_step(self, bucket: int) -> PreparedStep:
        """A decode step of `bucket` padding rows (what a graph is captured over): every row one token at
        position 0 over the all-null padding row of the tables, storing nothing."""
        query_lens, seq_lens, positions = padding_arrays(bucket)
        rows = np.full(bucket, self.batch.padding_row, dtype=np.int64)
        metadata: list[PagedAttentionMetadata] = []
        for device in self.devices:
            by_size = self.buffers[device].step(query_lens, seq_lens, positions, self.batch.tables, rows)
            metadata.extend(by_size[block_size][index] for block_size, index in self._groups_in_order)
        self.buffers[self.input_device].fill_inputs(
            np.zeros(bucket, dtype=np.int64), positions, self._all_rows[:bucket]
        )
        inputs = StepInputs([], [], [], [], [], TableUpdates(), [], [], [])
        return PreparedStep(inputs, metadata, bucket, bucket, None, bucket)

    def _bucket(self, num_seqs: int) -> int | None:
        """The decode bucket a decode step of `num_seqs` sequences is padded to (None: not graph mode, or more
        sequences than the largest bucket)."""
        for bucket in self.limits.decode_buckets:
            if bucket >= num_seqs:
                return bucket
        return None

    def forward(self, prepared: PreparedStep) -> torch.Tensor | None:
        """Run a prepared step: its swap copies, its copy-on-write copies, then one forward over all of its
        tokens (a captured graph's replay for a decode bucket that has one); float32 logits of its logits rows
        (None when it computes no token)."""
        inputs = prepared.inputs
        if inputs.offload:  # blocks the pool evicted in this plan, read before anything writes them
            self.offload(inputs.offload)
        if inputs.swap_out or inputs.swap_in:  # tested here: most steps have none, and a call costs more
            self.swap(inputs.swap_out, inputs.swap_in)
        if inputs.restore:  # blocks copied back from the host tier, into fresh blocks held over the plan
            self.restore(inputs.restore)
        if inputs.blocks_to_copy:
            self.copy_blocks(inputs.blocks_to_copy)
        if self.state_pool is not None:
            self.state_pool.copy(inputs.state_fork_copies)
            self.state_pool.swap(self._swap_states, inputs.state_swap_out, inputs.state_swap_in)
            if inputs.state_offload or inputs.state_restore:  # checkpoints to and from the host tier, before hits read
                self.state_pool.swap(self.host_states, inputs.state_offload, inputs.state_restore)
            self.state_pool.copy(inputs.state_copies)
        if prepared.metadata is None:
            return None
        if inputs.pending_rows:
            self._place_pending_tokens(inputs.pending_rows)
        forward_time = time.perf_counter()
        step = self.context
        step.metadata = prepared.metadata
        graph = None if self.graphs is None or prepared.bucket is None else self.graphs.get(prepared.bucket)
        if inputs.lora_slots is not None:
            wanted = inputs.logits_rows if inputs.requested_rows is None else inputs.requested_rows
            self.lora.begin(inputs.lora_slots, inputs.query_lens, wanted)
            try:
                logits = self._forward_step(prepared, graph)
                self.lora.verify()
            finally:
                self.lora.end()
        else:
            logits = self._forward_step(prepared, graph)
        if prepared.picked_rows is not None:
            logits = logits.index_select(0, prepared.picked_rows)
        logits = logits.float()
        self.forward_seconds += time.perf_counter() - forward_time
        return logits

    def _forward_step(self, prepared: PreparedStep, graph: Any) -> torch.Tensor:
        """The step's forward: with images, a graph's replay, or the (compiled) forward over the step buffers."""
        inputs, step = prepared.inputs, self.context
        if inputs.image_rows:
            logits = self._forward_with_images(prepared)
        elif graph is not None:
            self.buffers[self.input_device].write_all_tiles(prepared.metadata[0].step)
            self._mark_inputs_sent()
            logits = graph.replay()
        else:
            self._mark_inputs_sent()
            buffers = self.buffers[self.input_device]
            if self.state_cache is not None:
                self.state_cache.plan = prepared.state_plan
            try:
                with torch.inference_mode(), running_step(step):
                    logits = self._forward_fn(*buffers.model_inputs(prepared.num_tokens, prepared.num_logits_rows))
                    # A store waits for its layer's KV-sharing readers; one the forward did not reach is made now.
                    step.store_deferred(list(step.deferred))
            finally:
                if self.state_cache is not None:
                    self.state_cache.plan = None
            if prepared.state_plan is not None:
                self.state_pool.copy(prepared.state_plan.after)  # the decode rows' checkpoints
        return logits

    def _mark_inputs_sent(self) -> None:
        """On a GPU, mark the end of the step's copies from the host's step buffers (`prepare` waits for it)."""
        if self.input_device.type == "cuda":
            self._inputs_sent = torch.cuda.Event()
            self._inputs_sent.record()

    def _place_pending_tokens(self, pending_rows: list[tuple[int, str]]) -> None:
        """Write the tokens the step before sampled on the device into their rows of the step's input ids, on the
        device (async scheduling: the host never waited for them). A steady decode batch (the same requests in the
        same order, from row 0) takes one copy; any other, a gather and a scatter."""
        source = self.pending_tokens
        if source is None:
            raise RuntimeError("a step reads tokens sampled on the device, but no earlier step left any")
        input_ids = self.buffers[self.input_device].input_ids.device
        count = len(pending_rows)
        # Rows are increasing: rows 0..count-1 when the last is count - 1.
        if pending_rows[-1][0] == count - 1 and [request_id for _, request_id in pending_rows] == source.request_ids:
            input_ids[:count].copy_(source.tokens, non_blocking=True)
            return
        device = self.input_device
        index = source.index
        rows = torch.tensor([row for row, _ in pending_rows], dtype=torch.long).to(device, non_blocking=True)
        picked = torch.tensor([index[request_id] for _, request_id in pending_rows], dtype=torch.long)
        tokens = source.tokens.index_select(0, picked.to(source.tokens.device, non_blocking=True))
        input_ids.index_copy_(0, rows, tokens.to(device))

    def _forward_with_images(self, prepared: PreparedStep) -> torch.Tensor:
        """A step that computes image placeholders: eager (never a graph or compiled code), their rows' input
        embeddings replaced by the images' (hybridkv/execution/multimodal.py), and image rows that attend both ways
        seeing on to their image's end in the layers that let them."""
        step, inputs = self.context, prepared.inputs
        self._mark_inputs_sent()
        features = torch.stack(inputs.image_features).to(self.input_device)
        buffers = self.buffers[self.input_device]
        step.key_limits = prepared.key_limits
        try:
            with (
                torch.inference_mode(),
                running_step(step),
                image_embeddings_placed(self.model, inputs.image_rows, features),
            ):
                logits = self._forward(*buffers.model_inputs(prepared.num_tokens, prepared.num_logits_rows))
                step.store_deferred(list(step.deferred))
        finally:
            step.key_limits = None
        return logits

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor
    ) -> torch.Tensor:
        """The model's forward over a step's buffers, eagerly (what a CUDA graph captures when not compiled)."""
        return step_forward(self.model, self.context, input_ids, position_ids, logits_to_keep, **self.step_cache)


@dataclass(slots=True)
class StepInputs:
    """One step as plain lists: its requests (in batch order) with their flattened tokens, query and sequence
    lengths, the logits rows to return, the block tables' updates since the last step, and the block copies
    to make first. Picklable: the driver of a tensor-parallel engine sends it to the other ranks."""

    request_ids: list[str]
    input_ids: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    logits_rows: list[int]
    table_updates: TableUpdates
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    blocks_to_copy: list[tuple[int, int]]
    # Rows asked for instead of the samples' (tests: every row of a prefill).
    requested_rows: Sequence[int] | None = None
    # The managers' lists of the step's requests, when the runner checks its persistent rows (tests).
    checked_tables: list[list[list[int]]] | None = None
    # State-slot copies (source, destination) to make first: forks of a model with state layers, and restored
    # checkpoints; per request, the state checkpoints its step writes (tokens into the step, checkpoint slot).
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # The requests whose step is one prompt token after earlier ones: their state layers run it as a piece of the
    # prompt (hybridkv/execution/state_continuations.py), not among the decode rows.
    prompt_singles: set[str] = field(default_factory=set)
    # Per request whose step recomputes tokens it generated: rows into its step where they begin (its state layers
    # run them as generate decoded them).
    generated_from: dict[str, int] = field(default_factory=dict)
    state_checkpoints: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # Before those copies: the forks' copies since the last step, then swapped states ((device slot, CPU slot)
    # out, (CPU slot, device slot) in): the order of `SchedulerOutput`'s fields.
    state_fork_copies: list[tuple[int, int]] = field(default_factory=list)
    state_swap_out: list[tuple[int, int]] = field(default_factory=list)
    state_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # The host tier's copies (hybridkv/memory/tiers.py): (device block, host slot) out before the swap copies,
    # (host slot, device block) in after them, before copy-on-write.
    offload: list[tuple[int, int]] = field(default_factory=list)
    restore: list[tuple[int, int]] = field(default_factory=list)
    # The same for state checkpoints (checkpoint slot, host state slot), before the hits' state copies.
    state_offload: list[tuple[int, int]] = field(default_factory=list)
    state_restore: list[tuple[int, int]] = field(default_factory=list)
    # Image placeholders the step computes: their flattened rows and embeddings, and the rows of images that
    # attend both ways with how many positions past their own each sees (hybridkv/execution/multimodal.py).
    image_rows: list[int] = field(default_factory=list)
    image_features: list[torch.Tensor] = field(default_factory=list)
    key_limit_rows: list[tuple[int, int]] = field(default_factory=list)
    # Async scheduling: (row, request id) of each row whose token the step before sampled on the device and the
    # host has not read yet; the forward takes it from there (`ModelRunner.pending_tokens`).
    pending_rows: list[tuple[int, str]] = field(default_factory=list)
    # Speculative decoding (hybridkv/engine/speculation.py): per request, the proposed tokens its rows end with; those
    # rows store nothing (their keys are read in flight; a state layer runs them from a copy of the state).
    spec_counts: dict[str, int] = field(default_factory=dict)
    # LoRA (enable_lora): each request's adapter slot, -1 for none (hybridkv/execution/lora.py).
    lora_slots: list[int] | None = None
    unstored_rows: list[int] = field(default_factory=list)


@dataclass(slots=True)
class PreparedStep:
    """A step written into the step buffers: its inputs, its metadata (None: no token to compute), its rows
    and the rows the forward keeps, the samples' rows picked from those afterwards (graph mode), and the
    decode bucket it was padded to (None: not padded)."""

    inputs: StepInputs
    metadata: list[PagedAttentionMetadata] | None
    num_tokens: int
    num_logits_rows: int
    picked_rows: torch.Tensor | None
    bucket: int | None = None
    state_plan: StatePlan | None = None
    key_limits: KeyLimits | None = None


def _image_rows(inputs: StepInputs, multimodal: PromptImages, start: int, end: int, offset: int) -> None:
    """A request's image placeholders in its positions [start, end), whose first row is `offset`: the embeddings
    its images carry (`MultiModalInputs`, which the engine gives a request with images)."""
    if not isinstance(multimodal, MultiModalInputs):
        raise TypeError(f"a request's images must carry their embeddings (MultiModalInputs), got {type(multimodal)}")
    for position, features in multimodal.rows(start, end):
        inputs.image_rows.append(offset + position - start)
        inputs.image_features.append(features)
    if multimodal.bidirectional:
        for position, last in multimodal.limits(start, end):
            inputs.key_limit_rows.append((offset + position - start, last - position))


def layer_views(
    kv_config: KVCacheConfig,
    layer_dtypes: LayerDtypes,
    pages: dict[torch.device, torch.Tensor],
    devices: dict[int, torch.device],
) -> dict[int, LayerKV]:
    """Each layer's K/V: its views into its device's pages (its group's slot of every block, in its dtype) and the
    index of its (device, group) metadata; a KV-sharing layer reads its source's views, and the last layer that
    reads a source stores the source's keys after it attended (`stores_after`)."""
    device_order = list(pages)
    num_groups = len(kv_config.groups)
    specs = {spec.layer_idx: spec for spec in kv_config.layer_specs}
    layers: dict[int, LayerKV] = {}
    for group in kv_config.groups:
        for slot, layer_idx in enumerate(group.layer_indices):
            spec, device = specs[layer_idx], devices[layer_idx]
            keys, values = kv_page_views(
                pages[device],
                slot * group.slot_bytes,
                group.block_size,
                spec.num_kv_heads,
                spec.head_dim,
                spec.value_head_dim,
                layer_dtypes.dtypes[layer_idx],
                spec.value_in_key,
            )
            check_layer_cache(keys, values)
            k_scale, v_scale = layer_dtypes.scales[layer_idx]
            layers[layer_idx] = LayerKV(
                device_order.index(device) * num_groups + group.group_id,
                keys,
                values,
                group.sliding_window,
                attention_chunk_size=group.attention_chunk_size,
                k_scale=k_scale,
                v_scale=v_scale,
                defers_store=layer_idx in kv_config.shared_layers.values(),
            )
    last_readers: dict[int, int] = {}
    for layer_idx, source in kv_config.shared_layers.items():
        if devices[layer_idx] != devices[source]:
            raise ValueError(
                f"layer {layer_idx} reads the K/V of layer {source}, which computes on another device "
                f"({devices[source]} vs {devices[layer_idx]}); place them on one device"
            )
        reads, spec = layers[source], specs[layer_idx]
        layers[layer_idx] = LayerKV(
            reads.metadata_index,
            reads.key_cache,
            reads.value_cache,
            spec.sliding_window,
            writes_kv=False,
            attention_chunk_size=spec.attention_chunk_size,
            k_scale=reads.k_scale,
            v_scale=reads.v_scale,
        )
        last_readers[source] = max(layer_idx, last_readers.get(source, layer_idx))
    for source, reader in last_readers.items():
        layers[reader].stores_after += (source,)
    return layers
