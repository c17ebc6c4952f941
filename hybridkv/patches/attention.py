"""hybridkv's attention, plugged in through transformers' own extension points.

`AttentionInterface.register("hybridkv", ...)` and `AttentionMaskInterface.register("hybridkv", ...)`,
then `model.set_attn_implementation("hybridkv")`. Inside an engine step the model's forward receives a
`hybridkv_step` keyword argument (a `StepContext`); transformers passes it, untouched, to every
attention call, which writes the layer's new K/V into its group's paged tensors and attends over them.
The batch is one flattened sequence with explicit position ids, so no dense mask is built: the mask
function returns None while a step runs.

Inside a step each layer's attention is one opaque torch op, `torch.ops.hybridkv.paged_attention`
(registered with `torch.library`, with a fake implementation): it takes the layer's query, key and value
rows and its index, and finds its pages and the step's metadata in the step that runs in this thread
(`running_step`, as vLLM's forward context and nano-vllm's `Context` do). The pages (dtype views of one
uint8 tensor) and the metadata never enter the op's signature, so `torch.compile(model, fullgraph=True)`
traces a step's forward with no graph break and no copy of a mutated view, and a CUDA graph replays the
op's kernels over buffers that keep their addresses (hybridkv/kernels/step_buffers.py). An eager step calls the op's
function itself (`paged_attention`): the same code, without the dispatcher's cost per layer. What a step passes the
model (`hybridkv_step`) is the runner's one `StepContext`, the same object every step; which step runs is
a thread-local, which compiled code reads without a graph break (a `ContextVar` would break the graph).

Called outside an engine step (a plain `model(...)` or `model.generate(...)` on a patched model), both
functions hand over to the implementation the model had before it was patched, so the model behaves
exactly as the original.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hybridkv.kernels import PagedAttentionMetadata, attend, store_kv
from hybridkv.kernels.latent_attention import latent_attention
from hybridkv.kernels.metadata import KeyLimits

ATTN_IMPLEMENTATION = "hybridkv"
STEP_KWARG = "hybridkv_step"

# Keyword arguments transformers' attention modules pass that the paged path reads, and the ones it
# may ignore (bookkeeping). Any other argument with a value could change the result: the probe at patch
# time (hybridkv/patches/inspection.py, hybridkv/patches/layer_checks.py) refuses a model whose layers pass one.
READ_KWARGS = frozenset({STEP_KWARG, "sliding_window", "softcap", "s_aux"})
IGNORED_KWARGS = frozenset(
    {"position_ids", "cache_position", "use_cache", "output_attentions", "output_router_logits", "return_dict"}
)

# Per thread: `step`, the StepContext of the step whose forward runs (None outside one), and `probe`, the
# recorder of hybridkv/patches/probe.py while its probe forward runs.
_running = threading.local()
# id(config) -> the attention implementation the model had before it was patched, and how many patched
# models read that config object (two models built from one config share it: the first one's original
# is kept, and the config switches back only when the last of them is unpatched).
_original_implementation: dict[int, str] = {}
_num_patched_models: dict[int, int] = {}


@dataclass(slots=True)
class LatentUp:
    """A latent attention layer's up-projection, found where the model holds it now (`owner`'s attribute `name`: a
    PEFT adapter may wrap it after patching), and the key columns per head it gives before the values."""

    owner: torch.nn.Module
    name: str
    nope_dim: int
    # Decode rows attend in latent space (`hybridkv/kernels/latent_attention.py`) where the projection is a plain linear
    # layer.
    absorb: bool = True

    def module(self) -> torch.nn.Module:
        return getattr(self.owner, self.name)


@dataclass(slots=True)
class LayerKV:
    """Where one attention layer's K/V live (views of its slot in every page), which entry of the
    step's metadata list describes its group on its device, and the window (or attention chunk size)
    the layer attends with: the layout's, the same one its group's manager frees blocks by. A KV-sharing
    layer reads its source layer's views, metadata and scales and writes nothing (`writes_kv` False).

    `k_scale` and `v_scale` are the layer's fp8 scales (1.0 for 16/32-bit pages). A layer that KV-sharing
    layers read stores its rows only after the last of them attended (`defers_store`; that reader's
    `stores_after` names it): a windowed group may store the step's rows into a block that held keys
    before the step, which the readers must still see."""

    metadata_index: int
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    sliding_window: int | None
    writes_kv: bool = True
    attention_chunk_size: int | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    defers_store: bool = False
    stores_after: tuple[int, ...] = ()
    # A latent attention layer (hybridkv/patches/latent.py): its cache update stored the step's latent and rotary-key
    # rows; it attends over its pages through its up-projection (`LatentUp`, hybridkv/kernels/latent_attention.py).
    latent: LatentUp | None = None


@dataclass(slots=True, eq=False)
class StepContext:
    """What every attention layer needs in a step: its tensors (fixed for the runner's life) and its group's
    metadata for the step that runs (`metadata`, one entry per (device, group), each carrying its step's
    backend, replaced every step), and the K/V rows of layers whose store waits for their readers. A runner
    keeps one, passed to every forward as `hybridkv_step`: compiled code guards on its identity only."""

    layers: dict[int, LayerKV]
    metadata: list[PagedAttentionMetadata] = field(default_factory=list)
    deferred: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # A step with the tokens of images that attend both ways: the rows that see past themselves, and the
    # layers that let them (hybridkv/execution/multimodal.py); None in every other step.
    key_limits: KeyLimits | None = None
    image_layers: frozenset[int] = frozenset()
    # LoRA (hybridkv/execution/lora.py): entered around a latent layer's hooked up-projection of the step's sequence i,
    # which expands that sequence's context rather than the step's rows.
    sequence_scope: Callable[[int], contextlib.AbstractContextManager[None]] | None = None

    def store(self, layer_idx: int, key_rows: torch.Tensor, value_rows: torch.Tensor) -> None:
        """Store a layer's rows of this step into its pages (after its attention: see `hybridkv_attention`)."""
        layer = self.layers[layer_idx]
        metadata = self.metadata[layer.metadata_index]
        store_kv(key_rows, value_rows, layer.key_cache, layer.value_cache, metadata, layer.k_scale, layer.v_scale)

    def store_deferred(self, layer_indices: Iterable[int]) -> None:
        for layer_idx in layer_indices:
            rows = self.deferred.pop(layer_idx, None)
            if rows is not None:
                self.store(layer_idx, *rows)


@contextlib.contextmanager
def probing(probe: Any) -> Iterator[None]:
    """Marks the probe forward of hybridkv/patches/probe.py: both functions report to `probe`."""
    previous = getattr(_running, "probe", None)
    _running.probe = probe
    try:
        yield
    finally:
        _running.probe = previous


class running_step:  # a context manager, named as the function it was
    """Marks an engine forward in this thread: the mask function builds no mask, and each layer's op finds
    its pages and metadata in `step`. A class rather than a generator: it is entered once per step."""

    __slots__ = ("previous", "step")

    def __init__(self, step: StepContext) -> None:
        self.step = step
        self.previous: StepContext | None = None

    def __enter__(self) -> None:
        self.previous = getattr(_running, "step", None)
        _running.step = self.step

    def __exit__(self, *exc_info: object) -> None:
        _running.step = self.previous


def current_step() -> StepContext:
    """The step whose forward runs in this thread (the attention op's lookup)."""
    step = getattr(_running, "step", None)
    if step is None:
        raise RuntimeError("hybridkv's attention op ran outside an engine step (no running_step in this thread)")
    return step


def hybridkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: paged inside a step, the original implementation outside.

    query `[1, q_heads, tokens, head_dim]`, key/value `[1, kv_heads, tokens, head_dim]` (after RoPE);
    returns `[1, tokens, q_heads, head_dim]` as every transformers attention function does. Inside a step
    this is all that compiled code traces: one `paged_attention` op per layer, with what the call passes.
    """
    step = kwargs.get(STEP_KWARG)
    if type(step) is not StepContext:
        probe = getattr(_running, "probe", None)
        if probe is not None:
            return probe.record(module, query, key, value, attention_mask, kwargs)
        kwargs.pop(STEP_KWARG, None)
        return _original_attention(module)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    # [1, heads, tokens, dim] -> [tokens, heads, dim]. Traced, the opaque op; run eagerly, its function itself (the
    # op's dispatch costs more than a short step's attention on the CPU: benchmarks/speculative.py).
    op = torch.ops.hybridkv.paged_attention if torch.compiler.is_compiling() else paged_attention
    out = op(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        kwargs.get("s_aux"),
        module.layer_idx,
        query.shape[-1] ** -0.5 if scaling is None else scaling,
        kwargs.get("softcap"),
        kwargs.get("sliding_window") or None,
    )
    return out.unsqueeze(0), None


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: torch.Tensor | None,
    layer_idx: int,
    scale: float,
    softcap: float | None,
    passed_window: int | None,
) -> torch.Tensor:
    """One layer's attention in the running step (`current_step`): attend over its pages with the step's
    own K/V rows in flight, then store them into the layer's slots. `query` `[tokens, q_heads, dim]`,
    `key`/`value` `[tokens, kv_heads, dim]`; returns `[tokens, q_heads, v_dim]`. Its side effect (the store)
    is on pages outside the signature, which compiled code cannot see to copy."""
    step = current_step()
    layer = step.layers[layer_idx]
    if passed_window and passed_window != layer.sliding_window:
        raise ValueError(
            f"layer {layer_idx} passes sliding_window={passed_window} to attention, but hybridkv's "
            f"layout gives it {layer.sliding_window}; the model changed since it was patched: patch it again"
        )
    if layer.latent is not None:
        if softcap or sinks is not None:
            raise ValueError(f"layer {layer_idx}: latent attention with softcapping or sinks is not implemented")
        up = layer.latent.module()
        plain = type(up) is torch.nn.Linear and up.bias is None and not (up._forward_hooks or up._forward_pre_hooks)
        return latent_attention(
            query, layer.key_cache, layer.value_cache, step.metadata[layer.metadata_index], up, layer.latent.nope_dim,
            scale, layer.k_scale, absorb=layer.latent.absorb and plain,
            sequence_scope=None if plain else step.sequence_scope,
        )  # fmt: skip
    # Unchecked calls: the step's lengths were checked when its metadata was built, the layer's cache
    # when the runner built its views, and its shapes and window by the probe at patch time. The step's
    # own keys are read in flight (a sharing layer receives its source's rows), earlier ones from the
    # pages; the rows are stored afterwards (by `attend`, `store=True`), because a windowed group may store
    # them into a block that held keys this attention reads (docs/design.md, "Window-only sliding groups").
    out = attend(
        query,
        layer.key_cache,
        layer.value_cache,
        step.metadata[layer.metadata_index],
        scale=scale,
        sliding_window=layer.sliding_window,
        softcap=softcap,
        sinks=sinks,
        attention_chunk_size=layer.attention_chunk_size,
        key=key,
        value=value,
        k_scale=layer.k_scale,
        v_scale=layer.v_scale,
        store=layer.writes_kv and not layer.defers_store,
        key_limits=step.key_limits if step.key_limits is not None and layer_idx in step.image_layers else None,
    )
    if layer.defers_store:
        # A copy: compiled code may reuse the inputs' memory once the op returns.
        step.deferred[layer_idx] = (key.clone(), value.clone())
    step.store_deferred(layer.stores_after)
    return out


# The op compiled code traces (hybridkv/execution/compilation.py splits the graph at it); eager steps call its function.
paged_attention_op = torch.library.custom_op("hybridkv::paged_attention", mutates_args=())(paged_attention)


@torch.library.custom_op("hybridkv::store_latent", mutates_args=())
def store_latent_op(latent: torch.Tensor, rotary: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A latent attention layer's cache update in the running step (hybridkv/execution/latent_layers.py): its rows
    `[1, 1, tokens, dim]` stored into its pages (a K row of the latent then the rotary key; the V row, a view of the
    latent, gets the same bytes again), and returned (copies: an op's outputs may not alias its inputs), so that what
    the layer expands depends on the store and compiled code keeps it in order. The pages are outside the
    signature, as `paged_attention_op`'s are."""
    step = current_step()
    layer = step.layers[layer_idx]
    rows = latent[0].transpose(0, 1)
    store_kv(
        torch.cat([rows, rotary[0].transpose(0, 1)], dim=-1), rows, layer.key_cache, layer.value_cache,
        step.metadata[layer.metadata_index], layer.k_scale, layer.v_scale,
    )  # fmt: skip
    return latent.clone(), rotary.clone()


@store_latent_op.register_fake
def _store_latent_shape(latent, rotary, layer_idx):
    return torch.empty_like(latent), torch.empty_like(rotary)


@paged_attention_op.register_fake
def _paged_attention_shape(query, key, value, sinks, layer_idx, scale, softcap, passed_window) -> torch.Tensor:
    return query.new_empty((query.shape[0], query.shape[1], value.shape[-1]))


def hybridkv_mask(*args: Any, config: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """The registered mask function: no mask inside a step, the original mask outside."""
    if getattr(_running, "step", None) is not None:
        return None
    probe = getattr(_running, "probe", None)
    if probe is not None:
        return probe.mask(*args, config=config, **kwargs)
    original = _original_implementation.get(id(config), "sdpa")
    return ALL_MASK_ATTENTION_FUNCTIONS[original](*args, config=config, **kwargs)


def _original_attention(module: torch.nn.Module):
    original = _original_implementation.get(id(module.config), "sdpa")
    if original == "eager":
        # Each modeling file has its own eager function (softcap, sinks, ...): use the module's.
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[original]


def install(model: torch.nn.Module) -> None:
    """Register hybridkv's functions (once per process) and switch the model to them."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, hybridkv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, hybridkv_mask)
    for config in attention_configs(model):
        key = id(config)
        if key not in _num_patched_models:  # a model dropped without unpatch: its config's entries go with it, so a
            weakref.finalize(config, _forget_config, key)  # later config given the same id starts afresh
        if config._attn_implementation != ATTN_IMPLEMENTATION:  # else a patched model's original stays
            _original_implementation[key] = config._attn_implementation or "eager"
        _num_patched_models[key] = _num_patched_models.get(key, 0) + 1
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


def _forget_config(key: int) -> None:
    _num_patched_models.pop(key, None)
    _original_implementation.pop(key, None)


def uninstall(model: torch.nn.Module) -> None:
    """Switch the model back to the implementation it had before install(), unless another patched model
    shares a config with it (then hybridkv's functions stay, and outside a step they call the original), or the
    model was switched to another implementation since (it keeps that one)."""
    configs = attention_configs(model)
    original = _original_implementation.get(id(configs[0]), "sdpa")
    for config in configs:
        _num_patched_models[id(config)] = max(0, _num_patched_models.get(id(config), 1) - 1)
    if any(_num_patched_models[id(config)] for config in configs):
        return
    if model.config._attn_implementation == ATTN_IMPLEMENTATION:
        model.set_attn_implementation(original)
    for config in configs:
        _num_patched_models.pop(id(config), None)
        _original_implementation.pop(id(config), None)


def attention_configs(model: torch.nn.Module) -> list[Any]:
    """Every distinct config object the model's modules read _attn_implementation from."""
    seen: dict[int, Any] = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())
