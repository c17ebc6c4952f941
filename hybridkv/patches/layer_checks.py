"""Why one decoder layer cannot be served exactly, or None: the refusal reasons of the probe.

A layer is served when its kind is one hybridkv implements (full attention, a sliding window, chunked
local attention), its attention module calls transformers' attention interface exactly once with the
forward's keyword arguments and no input the kernels do not implement, its shapes are self-attention
the kernels compute (one head count for K and V, query head dim = key head dim, a whole number of
query heads per kv head), and what its mask (or the window it passes) shows agrees with its kind.
Each reason names what would be needed; docs/adding_a_model.md lists them.
"""

from __future__ import annotations

import torch

from hybridkv.patches.layer_kinds import SUPPORTED_LAYER_TYPES, ConfigLayer
from hybridkv.patches.probe import AttentionCall, StateCall

_SPARSE_LAYER_TYPES = frozenset(
    {"indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention", "minimax_m3_sparse"}
)


def layer_problem(model: torch.nn.Module, layer_idx: int, layer: ConfigLayer, calls: list[AttentionCall]) -> str | None:
    """Why layer `layer_idx` cannot be served exactly, or None."""
    layer_type = layer.layer_type
    if layer_type in _SPARSE_LAYER_TYPES:
        return f"{layer_type!r} layers use sparse or compressed attention, which hybridkv's kernels do not implement"
    if layer_type not in SUPPORTED_LAYER_TYPES:
        kinds = ", ".join(repr(kind) for kind in SUPPORTED_LAYER_TYPES)
        return f"layer type {layer_type!r} is not one hybridkv implements ({kinds})"
    if not calls:
        mixer = _layer_module_names(model, layer_idx)
        who = f"{mixer} never calls" if mixer else "no module with this layer_idx calls"
        return (
            f"{who} transformers' attention interface; hybridkv can only serve attention that goes through it "
            "(ALL_ATTENTION_FUNCTIONS)"
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


def stateless_layer_problem(layer: ConfigLayer, calls: list[AttentionCall], state_calls: list[StateCall]) -> str | None:
    """Why a layer its config declares as neither attending nor keeping a state (an MLP or MoE layer) cannot be
    served, or None: it must indeed do neither."""
    if calls or state_calls:
        return f"the {layer.layer_type!r} layer attends or keeps a state, which its config does not declare"
    return None


def state_layer_problem(
    layer_idx: int,
    layer: ConfigLayer,
    calls: list[AttentionCall],
    state_calls: list[StateCall],
    attends: bool = False,
) -> str | None:
    """Why state layer `layer_idx` (its config declares a linear-attention, SSM or conv layer, or with `attends` a
    layer that also attends) cannot be served exactly, or None: it must keep its state through transformers'
    cache interface (get/update_conv_state, get/update_recurrent_state), from one module, and attend only if
    declared to."""
    if not state_calls:
        return (
            f"{layer.layer_type!r} layers keep a per-request state, and this one never reached it through "
            "transformers' cache interface (get/update_conv_state, get/update_recurrent_state): it keeps it in a "
            "cache of its own, which hybridkv cannot hold per request"
        )
    if calls and not attends:
        return f"the {layer.layer_type!r} layer also calls the attention function, which its config does not declare"
    modules = {id(state_call.module) for state_call in state_calls}
    if None in {state_call.module for state_call in state_calls} or len(modules) > 1:
        return "its state is kept by more than one module, or by none with this layer_idx"
    return None


def _shape_problem(call: AttentionCall) -> str | None:
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


def _chunk_problem(call: AttentionCall, chunk_size: int) -> str | None:
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


def _window_problem(call: AttentionCall, window: int | None) -> str | None:
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


def _layer_module_names(model: torch.nn.Module, layer_idx: int) -> str:
    found = sorted(
        {type(m).__name__ for m in model.modules() if getattr(m, "layer_idx", None) == layer_idx and m is not model}
    )
    return ", ".join(found)
