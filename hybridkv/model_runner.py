"""The model runner: KV tensors, per-step metadata, one forward of the flattened batch."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridkv.grouping import KVCacheConfig
from hybridkv.kernels import allocate_kv_pages, build_step_metadata, check_layer_cache, kv_page_views
from hybridkv.kv_dtypes import LayerDtypes
from hybridkv.patches.attention import STEP_KWARG, LayerKV, StepContext, step_running
from hybridkv.patches.devices import execution_device, input_device
from hybridkv.scheduler import SchedulerOutput


class ModelRunner:
    """Runs one scheduled step as a single forward over all of its tokens.

    One page tensor per device that holds a layer (`[num_blocks, page bytes]`, see
    hybridkv/grouping.py); each layer that holds pages gets K and V views of its slot in its own dtype
    (hybridkv/kv_dtypes.py), and a KV-sharing layer reads its source layer's views.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_config: KVCacheConfig,
        module_names: dict[int, str],
        num_blocks: int,
        layer_dtypes: LayerDtypes,
        backend: str | None = None,
    ) -> None:
        self.model = model
        self.kv_config = kv_config
        self.backend = backend
        named = dict(model.named_modules())
        self.input_device = input_device(model)
        devices = {idx: execution_device(named, name) for idx, name in module_names.items()}
        self._pages: dict[torch.device, torch.Tensor] = {}
        for device in devices.values():
            if device not in self._pages:
                self._pages[device] = allocate_kv_pages(num_blocks, kv_config.block_bytes, torch.uint8, device)
        # Metadata is built once per (device, group) each step; a layer reads the copy on its device.
        self.devices = list(self._pages)
        num_groups = len(kv_config.groups)
        specs = {spec.layer_idx: spec for spec in kv_config.layer_specs}
        self.layers: dict[int, LayerKV] = {}
        for group in kv_config.groups:
            for slot, layer_idx in enumerate(group.layer_indices):
                spec, device = specs[layer_idx], devices[layer_idx]
                keys, values = kv_page_views(
                    self._pages[device],
                    slot * group.slot_bytes,
                    group.block_size,
                    spec.num_kv_heads,
                    spec.head_dim,
                    spec.value_head_dim,
                    layer_dtypes.dtypes[layer_idx],
                )
                check_layer_cache(keys, values)
                index = self.devices.index(device) * num_groups + group.group_id
                k_scale, v_scale = layer_dtypes.scales[layer_idx]
                self.layers[layer_idx] = LayerKV(
                    index,
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
            reads, spec = self.layers[source], specs[layer_idx]
            self.layers[layer_idx] = LayerKV(
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
            self.layers[reader].stores_after += (source,)
        self.prepare_seconds = 0.0  # building inputs and metadata (host work per step)
        self.forward_seconds = 0.0
        self._swap_pages: dict[torch.device, torch.Tensor] = {}
        self.kv_cache_bytes = sum(pages.numel() * pages.element_size() for pages in self._pages.values())

    def allocate_swap_space(self, num_cpu_blocks: int) -> None:
        """CPU pages for num_cpu_blocks blocks per device (pinned when the cache is on CUDA)."""
        if num_cpu_blocks == 0:
            return
        for device, pages in self._pages.items():
            self._swap_pages[device] = torch.empty(
                (num_cpu_blocks, pages.shape[1]), dtype=pages.dtype, pin_memory=device.type == "cuda"
            )

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

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: each (source, destination) block's page, every layer's K and V of its group,
        on every device. All sources are read before any destination is written."""
        if not pairs:
            return
        for device, pages in self._pages.items():
            sources = torch.tensor([p[0] for p in pairs], device=device)
            destinations = torch.tensor([p[1] for p in pairs], device=device)
            pages[destinations] = pages[sources]

    def execute(self, plan: SchedulerOutput, logits_rows: Sequence[int] | None = None) -> torch.Tensor:
        """Compute the plan's tokens in one forward and return float32 logits of `logits_rows` of the
        flattened batch (by default the last row of each request that samples, once per sample drawn
        from it: the rows of `plan.sampling`)."""
        return self.forward(self.prepare(self.step_inputs(plan, logits_rows)))

    def step_inputs(self, plan: SchedulerOutput, logits_rows: Sequence[int] | None = None) -> StepInputs:
        """The plan flattened into plain lists (what another rank needs to run the same step)."""
        start_time = time.perf_counter()
        inputs = StepInputs([], [], [], [], [], plan.block_tables, plan.swap_out, plan.swap_in, plan.blocks_to_copy)
        input_ids, positions, sample_rows = inputs.input_ids, inputs.positions, inputs.logits_rows
        for request, num_new, samples in plan.scheduled:
            start = request.num_computed_tokens
            end = start + num_new
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            inputs.query_lens.append(num_new)
            inputs.seq_lens.append(end)
            if samples:  # one row of logits per sample that draws from it (forks share their leader's)
                sample_rows.extend([len(input_ids) - 1] * len(samples))
        if logits_rows is not None:
            inputs.logits_rows = list(logits_rows)
        self.prepare_seconds += time.perf_counter() - start_time
        return inputs

    def prepare(self, inputs: StepInputs) -> tuple[StepInputs, StepContext | None]:
        """The step's attention metadata (None when it computes no token): everything that can fail before
        the step changes any KV page."""
        if not inputs.query_lens:
            return inputs, None
        start_time = time.perf_counter()
        block_sizes = [group.block_size for group in self.kv_config.groups]
        metadata = build_step_metadata(
            inputs.query_lens, inputs.seq_lens, inputs.block_tables, block_sizes, self.devices, self.backend
        )
        self.prepare_seconds += time.perf_counter() - start_time
        return inputs, StepContext(self.layers, metadata)

    def forward(self, prepared: tuple[StepInputs, StepContext | None]) -> torch.Tensor | None:
        """Run a prepared step: its swap copies, its copy-on-write copies, then one forward over all of its
        tokens; float32 logits of its logits rows (None when it computes no token)."""
        inputs, step = prepared
        self.swap(inputs.swap_out, inputs.swap_in)
        self.copy_blocks(inputs.blocks_to_copy)
        if step is None:
            return None
        device = self.input_device
        forward_time = time.perf_counter()
        with torch.inference_mode(), step_running():
            output = self.model(
                input_ids=torch.tensor([inputs.input_ids], device=device),
                position_ids=torch.tensor([inputs.positions], device=device),
                logits_to_keep=torch.tensor(inputs.logits_rows, dtype=torch.long, device=device),
                use_cache=False,
                **{STEP_KWARG: step},
            )
            # A store waits for its layer's KV-sharing readers; one the forward did not reach is made now.
            step.store_deferred(list(step.deferred))
        logits = output.logits[0].float()
        self.forward_seconds += time.perf_counter() - forward_time
        return logits


@dataclass(slots=True)
class StepInputs:
    """One step as plain lists: the flattened tokens and positions, each request's query and sequence
    length, the logits rows to return, the block-table rows per group, and the block copies to make
    first. Picklable: the driver of a tensor-parallel engine sends it to the other ranks."""

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    logits_rows: list[int]
    block_tables: list[list[list[int]]]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    blocks_to_copy: list[tuple[int, int]]
