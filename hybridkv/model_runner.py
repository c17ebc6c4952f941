"""The model runner: KV tensors, per-step metadata, one forward of the flattened batch."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from hybridkv.coordinator import KVCacheCoordinator
from hybridkv.grouping import KVCacheConfig
from hybridkv.kernels import PagedAttentionMetadata, allocate_kv_cache
from hybridkv.patches.attention import STEP_KWARG, LayerKV, StepContext, step_running
from hybridkv.patches.inspection import execution_device, input_device
from hybridkv.request import Request


class ModelRunner:
    """Runs one scheduled step as a single forward over all of its tokens.

    One K and one V tensor per (group slot, device): slot s is shared by layer s of every group, and
    a model spread over devices by accelerate gets that slot's tensors on each device that holds one
    of its layers.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_config: KVCacheConfig,
        module_names: dict[int, str],
        num_blocks: int,
        kv_dtype: torch.dtype,
        backend: str | None = None,
    ) -> None:
        self.model = model
        self.kv_config = kv_config
        self.block_size = kv_config.block_size
        self.backend = backend
        spec = kv_config.layer_spec
        named = dict(model.named_modules())
        self.input_device = input_device(model)
        caches: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        placements: list[tuple[int, int, int, torch.device]] = []
        for group in kv_config.groups:
            for slot, layer_idx in enumerate(group.layer_indices):
                device = execution_device(named, module_names[layer_idx])
                if device not in caches:
                    caches[device] = allocate_kv_cache(
                        kv_config.num_kv_tensors,
                        num_blocks,
                        self.block_size,
                        spec.num_kv_heads,
                        spec.head_dim,
                        kv_dtype,
                        device,
                    )
                placements.append((layer_idx, group.group_id, slot, device))
        # Metadata is built once per (device, group) each step; a layer reads the copy on its device.
        self.devices = list(caches)
        num_groups = len(kv_config.groups)
        self.layers: dict[int, LayerKV] = {}
        for layer_idx, group_id, slot, device in placements:
            key_cache, value_cache = caches[device][slot]
            index = self.devices.index(device) * num_groups + group_id
            window = kv_config.groups[group_id].sliding_window
            self.layers[layer_idx] = LayerKV(index, key_cache, value_cache, window)
        self._caches = caches
        self.prepare_seconds = 0.0  # building inputs and metadata (host work per step)
        self.forward_seconds = 0.0
        self._swap_caches: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.kv_cache_bytes = sum(k.numel() * k.element_size() * 2 for tensors in caches.values() for k, _ in tensors)

    def allocate_swap_space(self, num_cpu_blocks: int) -> None:
        """CPU copies of every KV tensor, num_cpu_blocks blocks each (pinned when the cache is on CUDA)."""
        if num_cpu_blocks == 0:
            return
        for device, tensors in self._caches.items():
            pin = device.type == "cuda"
            self._swap_caches[device] = [
                (
                    torch.empty((num_cpu_blocks, *k.shape[1:]), dtype=k.dtype, pin_memory=pin),
                    torch.empty((num_cpu_blocks, *v.shape[1:]), dtype=v.dtype, pin_memory=pin),
                )
                for k, v in tensors
            ]

    def swap(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        """Copy blocks device -> CPU (device id, CPU id), then CPU -> device (CPU id, device id), in
        every KV tensor: a block id is one page in each of them."""
        for pairs, outbound in ((swap_out, True), (swap_in, False)):
            if not pairs:
                continue
            for device, tensors in self._caches.items():
                device_ids = torch.tensor([p[0] if outbound else p[1] for p in pairs], device=device)
                cpu_ids = torch.tensor([p[1] if outbound else p[0] for p in pairs])
                for (key, value), (cpu_key, cpu_value) in zip(tensors, self._swap_caches[device], strict=True):
                    if outbound:
                        cpu_key[cpu_ids] = key[device_ids].to("cpu")
                        cpu_value[cpu_ids] = value[device_ids].to("cpu")
                    else:
                        key[device_ids] = cpu_key[cpu_ids].to(device)
                        value[device_ids] = cpu_value[cpu_ids].to(device)

    def execute(
        self,
        scheduled: Sequence[tuple[Request, int]],
        coordinator: KVCacheCoordinator,
        logits_rows: Sequence[int],
    ) -> torch.Tensor:
        """Compute the scheduled tokens and return float32 logits for the given flattened rows."""
        start_time = time.perf_counter()
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            input_ids.extend(request.token_ids[start : start + num_new])
            positions.extend(range(start, start + num_new))
            query_lens.append(num_new)
            seq_lens.append(start + num_new)
        tables = [coordinator.block_ids(request.request_id) for request, _ in scheduled]
        metadata: list[PagedAttentionMetadata] = []
        for device in self.devices:
            first = None
            for group in self.kv_config.groups:
                rows = [table[group.group_id] for table in tables]
                group_metadata = PagedAttentionMetadata.build(
                    query_lens, seq_lens, rows, self.block_size, device, share_with=first
                )
                first = first or group_metadata
                metadata.append(group_metadata)
        device = self.input_device
        step = StepContext(self.layers, metadata, self.backend)
        forward_time = time.perf_counter()
        self.prepare_seconds += forward_time - start_time
        with torch.inference_mode(), step_running():
            output = self.model(
                input_ids=torch.tensor([input_ids], device=device),
                position_ids=torch.tensor([positions], device=device),
                logits_to_keep=torch.tensor(logits_rows, dtype=torch.long, device=device),
                use_cache=False,
                **{STEP_KWARG: step},
            )
        logits = output.logits[0].float()
        self.forward_seconds += time.perf_counter() - forward_time
        return logits
