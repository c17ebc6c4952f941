"""What a model's attention layers really do, measured once at patch time.

hybridkv serves a model when (a) every decoder layer's attention module calls transformers' attention
interface, with the keyword arguments of the model's forward passed through, and (b) each layer's kind
is one hybridkv implements (full attention, a sliding window, or chunked local attention). That is
decided by what the model does, not by its name: `inspect_model` runs one short forward of the model
with hybridkv's functions in a recording mode and compares what every layer did with what the config
declares.

For each attention call the probe records the module and its `layer_idx`, the shapes of query, key and
value, the `sliding_window` the call passes, any other input the kernels would have to implement, and
which keys each query may see. The last comes from the mask: transformers builds every mask through
the mask interface from a `mask_function(batch, head, q_idx, kv_idx)`, which the probe evaluates at
positions far beyond the probe's tokens (so a window of 4,096 is seen in a 40-token forward), and
falls back to the materialized mask when a model builds its own (`patches/visibility.py`).

The layout that comes out (one `LayerSpec` per layer, the window taken from the config and confirmed
by the mask) is the one source of truth for windows: the managers free blocks by it and the kernels
attend with it. Anything that disagrees, or that the kernels do not implement, is refused here with
an error naming the layer and what would be needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv.kv_spec import LayerSpec
from hybridkv.patches import attention
from hybridkv.patches.layer_kinds import SUPPORTED_LAYER_TYPES, ConfigLayer, config_layers, text_config
from hybridkv.patches.visibility import Visibility, visibility_of_function, visibility_of_tensor

PROBE_TOKENS = 40
# Positions past the probe at which mask functions are evaluated (capped: a mask is only arithmetic).
MAX_MASK_HORIZON = 1 << 20

_RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding", "moe"})
_SPARSE_LAYER_TYPES = frozenset(
    {"indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention", "minimax_m3_sparse"}
)


@dataclass(frozen=True)
class ModelLayout:
    """The attention layers of a model as hybridkv will serve them: one spec per layer (in layer
    order) and the qualified name of the module that computes each layer's attention."""

    specs: list[LayerSpec]
    module_names: dict[int, str]
    # Tokens up to which the model's output does not depend on state a step lacks (None: no limit),
    # and why: see `_position_limit`.
    max_exact_tokens: int | None = None
    limit_reason: str = ""


@dataclass
class _AttentionCall:
    module: torch.nn.Module
    query_shape: tuple[int, ...]
    key: torch.Tensor
    value: torch.Tensor
    passed_window: Any
    received_step: bool
    unknown_inputs: list[str]
    visibility: Visibility | None


@dataclass
class Probe:
    """Recorder handed to the registered functions during the probe forward (see attention.py)."""

    horizon: int
    calls: list[_AttentionCall] = field(default_factory=list)
    # id(mask tensor) -> (the tensor, kept alive so its id stays unique; what its function allows)
    masks: dict[int, tuple[torch.Tensor, Visibility | None]] = field(default_factory=dict)

    def mask(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        from transformers.masking_utils import sdpa_mask

        # Always a materialized mask: transformers may skip a plain causal or bidirectional one (None).
        mask = sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})
        function = kwargs.get("mask_function")
        self.masks[id(mask)] = (mask, visibility_of_function(function, self.horizon) if function else None)
        return mask

    def record(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, None]:
        visibility = None
        if isinstance(attention_mask, torch.Tensor):
            _, visibility = self.masks.get(id(attention_mask), (None, None))
            visibility = visibility or visibility_of_tensor(attention_mask)
        elif getattr(module, "is_causal", True) is False:
            visibility = Visibility("bidirectional")
        unknown = kwargs.keys() - attention.READ_KWARGS - attention.IGNORED_KWARGS
        self.calls.append(
            _AttentionCall(
                module,
                tuple(query.shape),
                key,
                value,
                kwargs.get("sliding_window"),
                kwargs.get(attention.STEP_KWARG) is self,
                sorted(name for name in unknown if kwargs[name] is not None),
                visibility,
            )
        )
        batch, _, tokens, _ = query.shape
        return query.new_zeros(batch, tokens, query.shape[1], value.shape[-1]), None


def inspect_model(model: torch.nn.Module, kv_dtype: torch.dtype) -> ModelLayout:
    """Run the probe forward and return the layout hybridkv serves, or raise a ValueError that lists
    every layer hybridkv cannot serve exactly and why."""
    config = text_config(model.config)
    declared = config_layers(config)
    probe = Probe(horizon=_mask_horizon(config))
    _probe_forward(model, probe)
    names = {id(module): name for name, module in model.named_modules()}
    calls: dict[int, list[_AttentionCall]] = {}
    problems: dict[str, list[int]] = {}
    for call in probe.calls:
        layer_idx = getattr(call.module, "layer_idx", None)
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(declared):
            _add(problems, f"{type(call.module).__name__} calls the attention function without a decoder layer_idx")
            continue
        calls.setdefault(layer_idx, []).append(call)
    latent = getattr(config, "kv_lora_rank", None)
    specs = []
    for layer_idx, layer in enumerate(declared):
        problem = _layer_problem(model, layer_idx, layer, calls.get(layer_idx, []))
        if not problem and latent:
            problem = (
                f"multi-head latent attention (kv_lora_rank={latent}): hybridkv would page the decompressed "
                "per-head K/V, many times the latent's bytes; a latent cache is not implemented"
            )
        if problem:
            _add(problems, problem, layer_idx)
            continue
        call = calls[layer_idx][0]
        _, num_kv_heads, _, head_dim = call.key.shape
        source = _kv_source(call, [calls[earlier][0] for earlier in range(layer_idx) if earlier in calls])
        specs.append(
            LayerSpec(
                layer_idx,
                layer.sliding_window,
                num_kv_heads,
                head_dim,
                kv_dtype.itemsize,
                v_head_dim=call.value.shape[-1],
                kv_source=source,
                attention_chunk_size=layer.attention_chunk_size,
            )
        )
    if problems:
        lines = [f"- {_layer_list(layers)}{reason}" for reason, layers in problems.items()]
        raise ValueError(
            f"hybridkv cannot serve this {type(model).__name__} exactly:\n"
            + "\n".join(lines)
            + "\nSee docs/adding_a_model.md for what each of these needs."
        )
    module_names = {spec.layer_idx: names[id(calls[spec.layer_idx][0].module)] for spec in specs}
    return ModelLayout(specs, module_names, *_position_limit(config))


def _position_limit(config: Any) -> tuple[int | None, str]:
    """Llama 4's attention temperature tuning scales the queries of its no-RoPE layers by
    1 + attn_scale * log1p(floor((p + 1) / floor_scale)), with p counted from the length of its own
    cache (`past_key_values.get_seq_length()`), not from position_ids. An engine step has no such
    cache, so p would be the row's index in the step: exact only while every position and every row
    index p has p + 1 < floor_scale, where the factor is 1 for both (max_model_len and
    max_num_batched_tokens at most floor_scale - 1)."""
    floor_scale = getattr(config, "floor_scale", None)
    if not getattr(config, "attn_temperature_tuning", False) or not floor_scale:
        return None, ""
    reason = (
        f"its no-RoPE layers scale queries by a temperature that grows from position {floor_scale - 1} on "
        f"(attn_temperature_tuning, floor_scale={floor_scale}), counted from the model's own cache, which "
        "hybridkv's batched steps do not have"
    )
    return floor_scale - 1, reason


def execution_device(modules: dict[str, torch.nn.Module], name: str) -> torch.device:
    """Where the module `name` (in `dict(model.named_modules())`) computes: accelerate's hook on it or
    its nearest ancestor (offloaded weights sit on the meta device until forward), else where its
    weights are."""
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        hook = getattr(modules[".".join(parts[:depth])], "_hf_hook", None)
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return next(modules[name].parameters()).device


def input_device(model: torch.nn.Module) -> torch.device:
    """Where the model's input ids must live: the execution device of its input embeddings."""
    named = dict(model.named_modules())
    embeddings = model.get_input_embeddings()
    return execution_device(named, next(name for name, module in named.items() if module is embeddings))


def _probe_forward(model: torch.nn.Module, probe: Probe) -> None:
    config = text_config(model.config)
    vocab_size = config.vocab_size
    # Ordinary tokens from the middle of the vocabulary: special and multimodal ids sit at its ends.
    ids = (torch.arange(PROBE_TOKENS) + vocab_size // 2) % vocab_size
    device = input_device(model)
    with _attention_installed(model), attention.probing(probe), torch.inference_mode():
        try:
            model(
                input_ids=ids[None].to(device),
                position_ids=torch.arange(PROBE_TOKENS, device=device)[None],
                # A tensor of rows, as an engine step passes: an int lets some models (Gemma 4) skip
                # rows in their KV-sharing layers, which a step never does.
                logits_to_keep=torch.tensor([PROBE_TOKENS - 1], device=device),
                use_cache=False,
                **{attention.STEP_KWARG: probe},
            )
        except Exception as exc:
            raise ValueError(
                f"hybridkv checks a model's attention layers with one {PROBE_TOKENS}-token forward, and "
                f"{type(model).__name__} failed it: {type(exc).__name__}: {exc}. A model must run a plain "
                "causal forward on input_ids (weights loaded, or offloaded with accelerate)"
            ) from exc


@contextlib.contextmanager
def _attention_installed(model: torch.nn.Module) -> Iterator[None]:
    if model.config._attn_implementation == attention.ATTN_IMPLEMENTATION:
        yield
        return
    attention.install(model)
    try:
        yield
    finally:
        attention.uninstall(model)


def _layer_problem(
    model: torch.nn.Module, layer_idx: int, layer: ConfigLayer, calls: list[_AttentionCall]
) -> str | None:
    """Why layer `layer_idx` cannot be served exactly, or None."""
    layer_type = layer.layer_type
    if layer_type in _RECURRENT_LAYER_TYPES:
        return (
            f"{layer_type!r} layers keep a per-request recurrent state, not a K/V cache; hybridkv pages "
            "K/V only (such models need a state pool beside the block pool)"
        )
    if layer_type in _SPARSE_LAYER_TYPES:
        return f"{layer_type!r} layers use sparse or compressed attention, which hybridkv's kernels do not implement"
    if layer_type not in SUPPORTED_LAYER_TYPES:
        kinds = ", ".join(repr(kind) for kind in SUPPORTED_LAYER_TYPES)
        return f"layer type {layer_type!r} is not one hybridkv implements ({kinds})"
    if not calls:
        mixer = _layer_module_names(model, layer_idx)
        return (
            f"{mixer} never calls transformers' attention interface; hybridkv can only serve attention "
            "that goes through it (ALL_ATTENTION_FUNCTIONS)"
        )
    if len(calls) > 1:
        return f"the attention function is called {len(calls)} times per forward; hybridkv caches one K/V per layer"
    call = calls[0]
    module = type(call.module).__name__
    if not call.received_step:
        return (
            f"{module} does not pass the forward's keyword arguments through to its attention function, "
            "so hybridkv's step data cannot reach it"
        )
    if call.unknown_inputs:
        return (
            f"{module} passes {call.unknown_inputs} to its attention function, which hybridkv's paged "
            "attention does not implement"
        )
    if layer.attention_chunk_size is not None:
        return _shape_problem(call) or _chunk_problem(call, layer.attention_chunk_size)
    return _shape_problem(call) or _window_problem(call, layer.sliding_window)


def _shape_problem(call: _AttentionCall) -> str | None:
    (q_batch, q_heads, q_len, q_dim), (_, kv_heads, k_len, k_dim), (_, v_heads, v_len, _) = (
        call.query_shape,
        tuple(call.key.shape),
        tuple(call.value.shape),
    )
    if q_batch != 1 or k_len != q_len or v_len != q_len:
        return f"{k_len} keys for {q_len} queries: only self-attention over the sequence itself is paged"
    if v_heads != kv_heads:
        return f"K has {kv_heads} heads and V {v_heads}; hybridkv pages K and V with one head count"
    if q_dim != k_dim:
        return f"query head dim {q_dim} differs from key head dim {k_dim}, which the kernels do not implement"
    if q_heads % kv_heads:
        return f"{q_heads} query heads for {kv_heads} kv heads; the kernels need a whole number of queries per kv head"
    return None


def _chunk_problem(call: _AttentionCall, chunk_size: int) -> str | None:
    visibility = call.visibility
    declared = f"chunked local attention of {chunk_size}"
    if call.passed_window:
        return f"the layer passes sliding_window={call.passed_window} to attention, but its config declares {declared}"
    if visibility is None or visibility.kind == "causal":
        return (
            f"the mask that reaches the layer does not show its chunks, so the {declared} its config declares "
            "cannot be confirmed"
        )
    if visibility.kind != "chunked" or visibility.chunk != chunk_size:
        seen = f"chunks of {visibility.chunk}" if visibility.kind == "chunked" else f"a {visibility.kind} mask"
        return f"the mask shows {seen}, but the config declares {declared}"
    return None


def _window_problem(call: _AttentionCall, window: int | None) -> str | None:
    visibility = call.visibility
    declared = f"a sliding window of {window}" if window else "full attention"
    passed = call.passed_window or None
    if passed is not None and passed != window:
        return f"the layer passes sliding_window={passed} to attention, but its config declares {declared}"
    if visibility is None:
        # No mask reached the layer: the model's own attention is then plain causal.
        return (
            f"no mask reaches the layer, so the window of {window} its config declares cannot be confirmed"
            if window
            else None
        )
    if visibility.kind == "bidirectional":
        return "a query sees later tokens (bidirectional attention); hybridkv serves causal decoders"
    if visibility.kind == "other":
        return "the mask is neither causal nor a sliding window"
    if visibility.kind == "chunked":
        return f"the mask keeps only each query's chunk of {visibility.chunk}, but the config declares {declared}"
    if visibility.kind == "window" and visibility.window != window:
        return f"the mask keeps the last {visibility.window} keys, but the config declares {declared}"
    if visibility.kind == "causal" and window:
        if visibility.exact:
            return f"the mask keeps every earlier key, but the config declares {declared}"
        if passed != window:
            # A mask the model built itself, causal over the probe: a longer window is only confirmed
            # by the window the layer passes.
            return (
                f"the mask is causal over the probe's tokens and the layer passes no window, so {declared} "
                "cannot be confirmed"
            )
    return None


def _mask_horizon(config: Any) -> int:
    return min(max(getattr(config, "max_position_embeddings", 0) or 0, 1 << 16), MAX_MASK_HORIZON)


def _kv_source(call: _AttentionCall, earlier: list[_AttentionCall]) -> int | None:
    """The earlier layer whose very K/V tensors this call received (a KV-sharing layer), or None."""
    for other in earlier:
        if _same_tensor(call.key, other.key) and _same_tensor(call.value, other.value):
            return other.module.layer_idx
    return None


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _layer_module_names(model: torch.nn.Module, layer_idx: int) -> str:
    found = sorted(
        {type(m).__name__ for m in model.modules() if getattr(m, "layer_idx", None) == layer_idx and m is not model}
    )
    return ", ".join(found) if found else "no module with this layer_idx"


def _add(problems: dict[str, list[int]], reason: str, layer_idx: int | None = None) -> None:
    layers = problems.setdefault(reason, [])
    if layer_idx is not None:
        layers.append(layer_idx)


def _layer_list(layers: list[int]) -> str:
    if not layers:
        return ""
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(map(str, layers)) + ": "
