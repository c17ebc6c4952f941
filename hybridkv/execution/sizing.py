"""KV sizing: the model's KV cache groups and max_model_len for a config, and how many blocks the pool
gets (a block count, a byte budget, or on CUDA a share of device memory after a profiling forward)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from hybridkv.execution.config import EngineConfig
from hybridkv.execution.kv_dtypes import LayerDtypes, resolve_layer_dtypes
from hybridkv.kernels import num_blocks_for_budget, num_blocks_for_memory_utilization
from hybridkv.memory.block_pool import cdiv
from hybridkv.memory.coordinator import blocks_for_request
from hybridkv.memory.grouping import KVCacheConfig, group_layers
from hybridkv.patches.inspection import ModelLayout, inspect_model
from hybridkv.patches.position_limit import PositionLimit

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def kv_layout(model: torch.nn.Module, config: EngineConfig) -> tuple[LayerDtypes, ModelLayout, KVCacheConfig, int]:
    """The KV dtypes and fp8 scales per layer, the model's attention layout (measured by a probe forward),
    its KV cache groups and max_model_len that `config` gives for `model` (never beyond the model's
    context: a ValueError)."""
    max_model_len = _max_model_len(model, config)
    model_dtype = next(model.parameters()).dtype
    layout = inspect_model(model, model_dtype)
    specs, layer_dtypes = resolve_layer_dtypes(config.kv_cache_dtype, layout.specs, model_dtype, layout.kv_amax)
    kv_config = group_layers(specs, config.block_size)
    for limit in layout.position_limits:
        max_model_len = _within_limit(model, config, limit, max_model_len)
    return layer_dtypes, layout, kv_config, max_model_len


def _within_limit(model: torch.nn.Module, config: EngineConfig, limit: PositionLimit, max_model_len: int) -> int:
    """`max_model_len` capped at `limit` (a warning) where the config left it to the model, else a ValueError
    beyond it; a ValueError for a max_num_batched_tokens beyond a limit that counts a step's rows."""
    name = type(model).__name__
    if max_model_len > limit.max_tokens:
        if config.max_model_len:
            raise ValueError(
                f"max_model_len={max_model_len} is beyond what hybridkv serves exactly for this {name}: "
                f"{limit.reason}. Pass max_model_len <= {limit.max_tokens}"
            )
        warnings.warn(
            f"hybridkv serves this {name} up to {limit.max_tokens} tokens ({limit.reason}); "
            f"max_model_len is {limit.max_tokens}, not the model's context of {max_model_len}",
            stacklevel=5,
        )
        max_model_len = limit.max_tokens
    if limit.counts_step_rows and config.max_num_batched_tokens > limit.max_tokens:
        raise ValueError(
            f"max_num_batched_tokens={config.max_num_batched_tokens} is beyond what hybridkv serves exactly for "
            f"this {name}: {limit.reason}, and a step's rows count as positions there. "
            f"Pass max_num_batched_tokens <= {limit.max_tokens}"
        )
    return max_model_len


def _max_model_len(model: torch.nn.Module, config: EngineConfig) -> int:
    """`config.max_model_len`, else the model's context length; a ValueError beyond that length."""
    context = context_length(model.config.get_text_config())
    if context is None:
        if config.max_model_len is None:
            raise ValueError(f"{type(model).__name__}'s config has no max_position_embeddings; pass max_model_len")
        return config.max_model_len
    length, source = context
    if config.max_model_len is None:
        return length
    if config.max_model_len > length:
        raise ValueError(
            f"max_model_len={config.max_model_len} is beyond the model's {source}; pass max_model_len <= {length}"
        )
    return config.max_model_len


def context_length(text_config: Any) -> tuple[int, str] | None:
    """The longest context a model is made for, and where that number comes from: max_position_embeddings,
    or YaRN rope scaling's factor x original_max_position_embeddings where that is longer (vLLM's rule:
    Qwen's YaRN recipe leaves max_position_embeddings at the original length). None if neither is set."""
    positions = getattr(text_config, "max_position_embeddings", None)
    # None, or -1 (XLNet): no length the model is made for.
    context = None if positions is None or positions <= 0 else (positions, f"max_position_embeddings={positions}")
    rope = getattr(text_config, "rope_parameters", None) or {}
    # One dict, or one per layer type (Gemma 3's sliding and full layers).
    for params in [rope] if "rope_type" in rope else rope.values():
        if not isinstance(params, dict) or params.get("rope_type") != "yarn":
            continue
        factor, original = params.get("factor"), params.get("original_max_position_embeddings")
        if factor and original and (context is None or factor * original > context[0]):
            source = f"YaRN context of factor {factor} x original_max_position_embeddings={original}"
            context = (int(factor * original), source)
    return context


def blocks_for_requests(kv_config: KVCacheConfig, max_model_len: int, count: int) -> int:
    """The null block plus `count` requests at max_model_len (whatever their chunks: a windowed group
    holds its window only, hybridkv/memory/window_managers.py)."""
    return 1 + count * blocks_for_request(kv_config, max_model_len)


def min_num_blocks(model: torch.nn.Module, **config: Any) -> int:
    """The fewest KV blocks `hybridkv.patch(model, **config)` accepts: one request at max_model_len."""
    engine_config = EngineConfig.from_kwargs(**config)
    _, _, kv_config, max_model_len = kv_layout(model, engine_config)
    return blocks_for_requests(kv_config, max_model_len, 1)


def num_kv_blocks(
    model: torch.nn.Module,
    config: EngineConfig,
    kv_config: KVCacheConfig,
    max_model_len: int,
    largest_graph: int = 0,
) -> int:
    """The pool's block count, null block included: `num_blocks`, else what `kv_cache_memory` bytes hold,
    else on CUDA `gpu_memory_utilization` of the device less the activations of the largest step and, when
    decode steps are captured as CUDA graphs up to `largest_graph` sequences, the graphs' memory pool (the
    activations of a forward of that many rows, which the pool keeps), else 1 GiB on the CPU capped at what
    max_num_seqs requests at max_model_len can use (with prefix caching, every block of them cached, windowed
    groups' too). Never fewer than one request at max_model_len needs
    (else a ValueError naming the fix)."""
    bytes_per_block = kv_config.block_bytes
    min_blocks = blocks_for_requests(kv_config, max_model_len, 1)
    if config.num_blocks is not None:
        if config.num_blocks < min_blocks:
            raise ValueError(
                f"num_blocks={config.num_blocks} cannot hold one request at max_model_len="
                f"{max_model_len} ({min_blocks} blocks with the null block); raise num_blocks "
                "or lower max_model_len"
            )
        return config.num_blocks
    if config.kv_cache_memory is not None:
        return num_blocks_for_budget(config.kv_cache_memory, bytes_per_block, min_blocks)
    device = next(model.parameters()).device
    if device.type == "cuda":
        activation_peak = _profile_forward(model, min(config.max_num_batched_tokens, max_model_len), device)
        if largest_graph:
            activation_peak += _profile_forward(model, largest_graph, device)
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        # What torch's caching allocator holds but no tensor uses (an unpatched engine's pool, say) is ours.
        free_bytes += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return num_blocks_for_memory_utilization(
            config.gpu_memory_utilization, free_bytes - activation_peak, total_bytes, bytes_per_block, min_blocks
        )
    most = blocks_for_requests(kv_config, max_model_len, config.max_num_seqs)
    if config.enable_prefix_caching:
        # A windowed group's blocks past the window stay cached while the pool has room (`fill_middle`): a model of
        # windows only (RecurrentGemma, Mistral) sized by its windows alone would have none, and no hit past one.
        most = 1 + config.max_num_seqs * sum(cdiv(max_model_len, group.block_size) for group in kv_config.groups)
    budget = min(DEFAULT_CPU_KV_CACHE_BYTES, most * bytes_per_block)
    return num_blocks_for_budget(budget, bytes_per_block, min_blocks)


def _profile_forward(model: torch.nn.Module, num_tokens: int, device: torch.device) -> int:
    """Bytes a forward of `num_tokens` needs beyond what stays allocated (its activations), measured
    with the model's own attention before the KV cache exists, as vLLM profiles."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, num_tokens), dtype=torch.long, device=device), use_cache=False)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    torch.cuda.empty_cache()
    return peak
