"""What a model's attention layers really do, measured once at patch time: `inspect_model`.

hybridkv serves a model when (a) every decoder layer's attention module calls transformers' attention
interface, with the keyword arguments of the model's forward passed through, and (b) each layer's kind
is one hybridkv implements (full attention, a sliding window, or chunked local attention). That is
decided by what the model does, not by its name: `inspect_model` runs one short forward of the model
with hybridkv's functions in a recording mode (`hybridkv/patches/probe.py`), checks every layer's calls against
what the config declares (`hybridkv/patches/layer_checks.py`), and adds the limits a model's own state imposes
(`hybridkv/patches/position_limit.py`).

The layout that comes out (one `LayerSpec` per layer, the window taken from the config and confirmed
by the mask) is the one source of truth for windows: the managers free blocks by it and the kernels
attend with it. Anything that disagrees, or that the kernels do not implement, is refused here with
one error naming each layer and what would be needed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from hybridkv.memory.kv_spec import LayerSpec, StateSpec
from hybridkv.patches.devices import check_weights_loaded, execution_device, input_device
from hybridkv.patches.latent import LatentLayer, latent_layer, up_projection
from hybridkv.patches.layer_checks import layer_problem, state_layer_problem, stateless_layer_problem
from hybridkv.patches.layer_kinds import (
    FULL_ATTENTION,
    HYBRID_LAYER_TYPES,
    SLIDING_ATTENTION,
    STATE_LAYER_TYPES,
    STATELESS_LAYER_TYPES,
    ConfigLayer,
    config_layers,
    decoder_layers,
    text_config,
)
from hybridkv.patches.position_limit import PositionLimit, position_limits
from hybridkv.patches.probe import (
    PROBE_TOKENS,
    AttentionCall,
    Probe,
    StateCall,
    record_cache_updates,
    record_probe_calls,
)

__all__ = [
    "PROBE_TOKENS",
    "AttentionCall",
    "ModelLayout",
    "Probe",
    "execution_device",
    "input_device",
    "inspect_model",
]


@dataclass(frozen=True)
class ModelLayout:
    """The attention layers of a model as hybridkv will serve them: one spec per layer (in layer
    order) and the qualified name of the module that computes each layer's attention."""

    specs: list[LayerSpec]
    module_names: dict[int, str]
    # Tokens up to which the model's output does not depend on state a step lacks, and why (none for most
    # models): see `hybridkv/patches/position_limit.py`.
    position_limits: list[PositionLimit] = field(default_factory=list)
    # Per layer, the largest |K| and |V| of the probe forward: the calibration of fp8 pages' scales.
    kv_amax: dict[int, tuple[float, float]] = field(default_factory=dict)
    # The state layers (linear attention, SSM, short convolution): a per-request state each, in layer order.
    states: list[StateSpec] = field(default_factory=list)
    # The latent attention layers (hybridkv/patches/latent.py), paged as the latent and rotary key they hand their
    # cache.
    latent: dict[int, LatentLayer] = field(default_factory=dict)


def inspect_model(model: torch.nn.Module, kv_dtype: torch.dtype) -> ModelLayout:
    """Run the probe forward and return the layout hybridkv serves, or raise a ValueError that lists
    every layer hybridkv cannot serve exactly and why (or why no forward can run: weights not loaded)."""
    check_weights_loaded(model)
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and not can_generate():
        raise ValueError(
            f"{type(model).__name__} is not a causal decoder: it does not generate text (model.can_generate() is "
            "False: a masked-LM, encoder or classification head). hybridkv serves models that generate; load a "
            "causal language model (AutoModelForCausalLM)"
        )
    config = text_config(model.config)
    declared = config_layers(config)
    probe, state_calls = record_probe_calls(model)
    recorded = probe.calls
    names = {id(module): name for name, module in model.named_modules()}
    states_by_layer: dict[int, list[StateCall]] = {}
    for state_call in state_calls:
        states_by_layer.setdefault(state_call.layer_idx, []).append(state_call)
    calls: dict[int, list[AttentionCall]] = {}
    problems: dict[str, list[int]] = {}
    for call in recorded:
        layer_idx = getattr(call.module, "layer_idx", None)
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(declared):
            layer_idx = _decoder_layer_of(model, call.module)
        if layer_idx is None:
            _add(problems, f"{type(call.module).__name__} calls the attention function without a decoder layer_idx")
            continue
        calls.setdefault(layer_idx, []).append(call)
    latent = _latent_layers(model, probe, calls)
    specs = []
    states = []
    for layer_idx, layer in enumerate(declared):
        layer_state_calls = states_by_layer.get(layer_idx, [])
        if layer.layer_type in STATELESS_LAYER_TYPES:
            problem = stateless_layer_problem(layer, calls.get(layer_idx, []), layer_state_calls)
            if problem:
                _add(problems, problem, layer_idx)
            continue
        hybrid = layer.layer_type in HYBRID_LAYER_TYPES
        if layer.layer_type in STATE_LAYER_TYPES or hybrid:
            problem = state_layer_problem(layer_idx, layer, calls.get(layer_idx, []), layer_state_calls, hybrid)
            if problem:
                _add(problems, problem, layer_idx)
                continue
            states.append(_state_spec(layer_idx, layer_state_calls, names))
            if not hybrid:
                continue
            # Its attention side, checked as any other: full attention, or a sliding window (`hybrid_sliding`).
            layer = ConfigLayer(SLIDING_ATTENTION if layer.sliding_window else FULL_ATTENTION, layer.sliding_window)
        problem = layer_problem(model, layer_idx, layer, calls.get(layer_idx, []))
        found = latent.get(layer_idx)
        if not problem and isinstance(found, str):
            problem = f"multi-head latent attention: {found}"
        elif not problem and found is not None and (layer.sliding_window or layer.attention_chunk_size):
            problem = "multi-head latent attention with a sliding window or chunks: not implemented"
        elif not problem and found is None and _layer_attribute(config, "kv_lora_rank", layer_idx):
            problem = (
                "its config declares multi-head latent attention (kv_lora_rank), but its keys and values are not one "
                "linear up-projection of a latent it hands its cache; hybridkv would page the decompressed per-head "
                "K/V, many times the latent's bytes"
            )
        if problem:
            _add(problems, problem, layer_idx)
            continue
        call = calls[layer_idx][0]
        if isinstance(found, LatentLayer):
            # One "head": a K row is the latent then the rotary key, and V its latent (hybridkv/patches/latent.py).
            row = found.latent_dim + found.rope_dim
            spec = LayerSpec(layer_idx, None, 1, row, kv_dtype.itemsize, v_head_dim=found.latent_dim, value_in_key=True)
            specs.append(spec)
            continue
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
    if not specs:
        kind = "only state layers (SSM, linear attention or convolution)" if states else "no attention layers"
        raise ValueError(
            f"{type(model).__name__} has {kind}: hybridkv pages attention layers' K/V and keeps state layers' "
            "states beside them, and does not serve a model without attention layers yet; use its own generate"
        )
    module_names = {spec.layer_idx: names[id(calls[spec.layer_idx][0].module)] for spec in specs}
    kv_amax = {
        spec.layer_idx: (_amax(calls[spec.layer_idx][0].key), _amax(calls[spec.layer_idx][0].value)) for spec in specs
    }
    latent = {idx: found for idx, found in latent.items() if isinstance(found, LatentLayer)}
    kv_amax.update({idx: (max(found.latent_amax, found.rope_amax),) * 2 for idx, found in latent.items()})
    return ModelLayout(specs, module_names, position_limits(config), kv_amax=kv_amax, states=states, latent=latent)


def _decoder_layer_of(model: torch.nn.Module, module: torch.nn.Module) -> int | None:
    """The index of the one decoder layer (`decoder_layers`) that holds `module`:
    the layer an attention module without an index of its own serves (Zamba2's shared attention block, a copy per
    hybrid layer with tied weights, takes its cache index as an argument). None where no layer, or more than one,
    holds it (one module instance at several depths would need K/V of its own per use: refused)."""
    found = [index for index, layer in decoder_layers(model) if any(inner is module for inner in layer.modules())]
    return found[0] if len(found) == 1 else None


def _latent_layers(model: torch.nn.Module, probe: Probe, calls: dict[int, list[AttentionCall]]):
    """layer_idx -> the `LatentLayer` of each layer whose attention is latent (hybridkv/patches/latent.py), or why such
    a layer cannot be paged in latent space. A forward with a recording cache runs only when a layer's keys and values
    are an up-projection (a model probed with its state recorder has that forward already)."""
    found = {
        layer_idx: projection
        for layer_idx, layer_calls in calls.items()
        if len(layer_calls) == 1 and (projection := up_projection(layer_calls[0], probe.linears)) is not None
    }
    if not found:
        return {}
    if probe.updates is None:
        probe = record_cache_updates(model)
    names = {id(module): name for name, module in model.named_modules()}
    by_layer = {
        call.module.layer_idx: call for call in probe.calls if isinstance(getattr(call.module, "layer_idx", None), int)
    }
    result: dict[int, LatentLayer | str] = {}
    for layer_idx, (module, nope_dim) in found.items():
        call = by_layer.get(layer_idx)
        recorded = probe.linears.get(id(module))
        if call is None or recorded is None:
            result[layer_idx] = "the forward with a recording cache did not attend as the probe did"
            continue
        found_layer = latent_layer(call, (module, nope_dim), probe.updates.get(layer_idx, []), recorded[1])
        if isinstance(found_layer, LatentLayer):
            found_layer = dataclasses.replace(found_layer, up_proj=names[id(module)])
        result[layer_idx] = found_layer
    return result


def _state_spec(layer_idx: int, state_calls: list[StateCall], names: dict[int, str]) -> StateSpec:
    """A state layer's spec from its probe calls (one module made them all: `state_layer_problem`)."""
    by_kind: dict[str, dict[int, tuple[tuple[int, ...], torch.dtype]]] = {"conv": {}, "recurrent": {}}
    for state_call in state_calls:
        by_kind[state_call.kind][state_call.state_idx] = (state_call.shape, state_call.dtype)
    conv, recurrent = (tuple(kind[i] for i in sorted(kind)) for kind in (by_kind["conv"], by_kind["recurrent"]))
    return StateSpec(layer_idx, names[id(state_calls[0].module)], conv, recurrent)


def _layer_attribute(config: object, name: str, layer_idx: int) -> object:
    """A config attribute as layer `layer_idx` has it: its per-layer value where the config keeps one per layer
    (transformers' heterogeneous configs refuse a global read of those), else the config's."""
    if name in (getattr(config, "per_layer_attributes", None) or ()):
        return getattr(config.per_layer_config[layer_idx], name, None)
    return getattr(config, name, None)


def _amax(tensor: torch.Tensor) -> float:
    return float(tensor.detach().abs().amax().float())


def _kv_source(call: AttentionCall, earlier: list[AttentionCall]) -> int | None:
    """The earlier layer whose very K/V tensors this call received (a KV-sharing layer), or None."""
    for other in earlier:
        if _same_tensor(call.key, other.key) and _same_tensor(call.value, other.value):
            return other.module.layer_idx
    return None


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _add(problems: dict[str, list[int]], reason: str, layer_idx: int | None = None) -> None:
    layers = problems.setdefault(reason, [])
    if layer_idx is not None:
        layers.append(layer_idx)


def _layer_list(layers: list[int]) -> str:
    if not layers:
        return ""
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(map(str, layers)) + ": "
