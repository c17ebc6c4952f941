"""The probe forward: one short forward of the model with hybridkv's functions in recording mode.

For each attention call the recorder (`Probe`) keeps the module and its `layer_idx`, the shapes of
query, key and value, the `sliding_window` the call passes, any other input the kernels would have to
implement, and which keys each query may see. The last comes from the mask: transformers builds every
mask through the mask interface from a `mask_function(batch, head, q_idx, kv_idx)`, which the probe
evaluates at positions far beyond the probe's tokens (so a window of 4,096 is seen in a 40-token
forward), and falls back to the materialized mask when a model builds its own
(`hybridkv/patches/visibility.py`). What the calls mean for serving is decided in `hybridkv/patches/inspection.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from hybridkv.patches import attention
from hybridkv.patches.devices import input_device
from hybridkv.patches.layer_kinds import HYBRID_LAYER_TYPES, STATE_LAYER_TYPES, config_layers, text_config
from hybridkv.patches.own_state import states_through_cache
from hybridkv.patches.visibility import Visibility, visibility_of_function, visibility_of_tensor

PROBE_TOKENS = 40
# Positions past the probe at which mask functions are evaluated (capped: a mask is only arithmetic).
MAX_MASK_HORIZON = 1 << 20


@dataclass
class AttentionCall:
    """What one attention call of the probe forward did."""

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
    calls: list[AttentionCall] = field(default_factory=list)
    # id(module) -> (the nn.Linear, its input, its output) of each linear layer's last call: where a layer's
    # K/V come from (hybridkv/patches/latent.py finds a latent attention's up-projection among them).
    linears: dict[int, tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # layer_idx -> the (key, value) of each cache update, where the forward ran with a recording cache (else None).
    updates: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
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
            AttentionCall(
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


@dataclass
class StateCall:
    """One call of a layer to transformers' cache interface for its state in the probe forward: which module
    made it, whether the conv or the recurrent state, its state index, and one request's state shape and
    dtype (a conv state `[channels, kernel]`)."""

    layer_idx: int
    module: torch.nn.Module | None
    kind: str
    state_idx: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def record_probe_calls(model: torch.nn.Module) -> tuple[Probe, list[StateCall]]:
    """Run the probe forward (hybridkv's functions installed for its duration if the model is not
    patched) and return its recorder (every attention call in call order, every linear layer's last call) and
    every state call. A model whose config declares state layers runs with a cache that records their states
    (`StateRecorder`); any other runs without a cache."""
    config = text_config(model.config)
    if any(layer.layer_type in STATE_LAYER_TYPES | HYBRID_LAYER_TYPES for layer in config_layers(config)):
        try:
            probe, recorder = _recorded_forward(model)
            return probe, recorder.calls
        except ValueError:  # a model that needs a cache of a kind the recorder does not answer: probed without one
            pass
    probe = Probe(horizon=_mask_horizon(config))
    with _recording_linears(model, probe):
        _probe_forward(model, probe, config.vocab_size)
    return probe, []


def record_cache_updates(model: torch.nn.Module) -> Probe:
    """The probe forward again, with a cache that records every update (`StateRecorder`): what each attention layer
    hands its cache (hybridkv/patches/latent.py reads a latent attention's latent from it)."""
    return _recorded_forward(model)[0]


def _recorded_forward(model: torch.nn.Module) -> tuple[Probe, StateRecorder]:
    """The probe forward with a recording cache (`StateRecorder`): the recorder with its updates on `probe.updates`."""
    config = text_config(model.config)
    probe = Probe(horizon=_mask_horizon(config))
    recorder = StateRecorder(model)
    with _recording_linears(model, probe):
        _probe_forward(model, probe, config.vocab_size, recorder)
    probe.updates = recorder.updates
    return probe, recorder


@contextlib.contextmanager
def _recording_linears(model: torch.nn.Module, probe: Probe) -> Iterator[None]:
    """While the probe runs, keep each linear layer's last input and output on `probe.linears`."""

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
            probe.linears[id(module)] = (module, args[0], output)

    # A PEFT tuner layer around a linear layer (`base_layer`) computes what the model uses: its output counts.
    linear = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) or isinstance(getattr(m, "base_layer", None), torch.nn.Linear)
    ]
    handles = [m.register_forward_hook(hook) for m in linear]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class PassThroughCache(DynamicCache):
    """transformers' own cache (`DynamicCache`) for a config, holding no K/V: attention updates return K/V as
    given (hybridkv's attention keeps them, or the probe only looks) and it reports no past. The probe's
    `StateRecorder` and a step's state cache (hybridkv/execution/state_layers.py) answer its state calls; every other
    use of a cache by the model still works."""

    # Its state calls are answered per request (the recorder's, a step's state slots): hybridkv/patches/own_state.py
    # runs a block that keeps its state on itself through them.
    holds_states_per_request = True

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    # MiniMax's lightning attention keeps its state through its own cache's calls (`MiniMaxCache`): its recurrent
    # state, answered as any other.
    def get_linear_cache(self, layer_idx: int):
        return self.get_recurrent_state(layer_idx)

    def set_linear_cache(self, layer_idx: int, linear_cache) -> None:
        self.update_recurrent_state(linear_cache, layer_idx)


class StateRecorder(PassThroughCache):
    """The probe forward's cache for a model with state layers (and for `record_cache_updates`): its attention
    layers' updates are kept as given, its state calls are recorded as a fresh
    request's (no earlier state; a conv input shorter than the kernel padded on the left, as transformers
    pads it), each attributed to the innermost running module with that `layer_idx` (`running`, kept by
    `_tracking_layer_modules`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(config=text_config(model.config))
        self.calls: list[StateCall] = []
        self.running: list[torch.nn.Module] = []
        self.updates: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.updates.setdefault(layer_idx, []).append((key_states, value_states))
        return key_states, value_states

    def _module(self, layer_idx: int) -> torch.nn.Module | None:
        return next((m for m in reversed(self.running) if getattr(m, "layer_idx", None) == layer_idx), None)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> None:
        return None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> None:
        return None

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        kernel = conv_states.shape[-1] if conv_kernel_size is None else conv_kernel_size
        shape = (*conv_states.shape[1:-1], kernel)
        self.calls.append(StateCall(layer_idx, self._module(layer_idx), "conv", state_idx, shape, conv_states.dtype))
        if conv_states.shape[-1] < kernel:
            conv_states = torch.nn.functional.pad(conv_states, (kernel - conv_states.shape[-1], 0))
        return conv_states

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        shape = tuple(recurrent_states.shape[1:])
        module = self._module(layer_idx)
        self.calls.append(StateCall(layer_idx, module, "recurrent", state_idx, shape, recurrent_states.dtype))
        return recurrent_states


def _probe_forward(
    model: torch.nn.Module, probe: Probe, vocab_size: int, recorder: Any = None, inputs: dict[str, Any] | None = None
) -> None:
    """The probe forward: PROBE_TOKENS ordinary ids (and `inputs`, per-token tensors such as token type ids,
    given for one sequence) through the model with hybridkv's functions recording."""
    # Ordinary tokens from the middle of the vocabulary: special and multimodal ids sit at its ends.
    ids = (torch.arange(PROBE_TOKENS) + vocab_size // 2) % vocab_size
    device = input_device(model)
    cache = {} if recorder is None else {"cache": recorder}
    with (
        attention_installed(model),
        states_through_cache(model),
        attention.probing(probe),
        torch.inference_mode(),
        _tracking_layer_modules(model, recorder),
    ):
        try:
            model(
                input_ids=ids[None].to(device),
                position_ids=torch.arange(PROBE_TOKENS, device=device)[None],
                # A tensor of rows, as an engine step passes: an int lets some models (Gemma 4) skip
                # rows in their KV-sharing layers, which a step never does.
                logits_to_keep=torch.tensor([PROBE_TOKENS - 1], device=device),
                use_cache=False,
                **cache,
                **{name: value[None].to(device) for name, value in (inputs or {}).items()},
                **{attention.STEP_KWARG: probe},
            )
        except Exception as exc:
            raise ValueError(
                f"hybridkv checks a model's attention layers with one {PROBE_TOKENS}-token forward, and "
                f"{type(model).__name__} failed it: {type(exc).__name__}: {exc}. A model must run a plain "
                "causal forward on input_ids (weights loaded, or offloaded with accelerate)"
            ) from exc


@contextlib.contextmanager
def attention_installed(model: torch.nn.Module) -> Iterator[None]:
    """hybridkv's attention and mask functions installed on the model for the block (if it is not patched)."""
    if model.config._attn_implementation == attention.ATTN_IMPLEMENTATION:
        yield
        return
    attention.install(model)
    try:
        yield
    finally:
        attention.uninstall(model)


@contextlib.contextmanager
def _tracking_layer_modules(model: torch.nn.Module, recorder: Any) -> Iterator[None]:
    """While the probe runs, keep on `recorder.running` the modules with a `layer_idx` whose forward runs (so a
    state call names its module)."""
    if recorder is None:
        yield
        return
    handles = []
    for module in model.modules():
        if isinstance(getattr(module, "layer_idx", None), int):
            handles.append(module.register_forward_pre_hook(_entering(recorder)))
            handles.append(module.register_forward_hook(_leaving(recorder)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _entering(recorder: Any):
    def hook(module: torch.nn.Module, args: Any) -> None:
        recorder.running.append(module)

    return hook


def _leaving(recorder: Any):
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        recorder.running.pop()

    return hook


def _mask_horizon(config: Any) -> int:
    return min(max(getattr(config, "max_position_embeddings", 0) or 0, 1 << 16), MAX_MASK_HORIZON)


IMAGE_PROBE_SPAN = (8, 12)  # the probe positions marked as one image's tokens


class _ImageMaskProbe(Probe):
    """The probe's recorder, keeping each attention call's mask as well."""

    def __init__(self, horizon: int) -> None:
        super().__init__(horizon=horizon)
        self.layer_masks: list[tuple[int, torch.Tensor | None]] = []

    def record(self, module, query, key, value, attention_mask, kwargs):
        self.layer_masks.append((module.layer_idx, attention_mask))
        return super().record(module, query, key, value, attention_mask, kwargs)


def image_attention_layers(model: torch.nn.Module) -> frozenset[int]:
    """The layers in which an image's tokens see the later tokens of the same image, as the model's own masks
    say: one probe forward with positions 8..11 marked as one image (`token_type_ids` / `mm_token_type_ids`,
    whichever the model's forward takes), then, per layer, whether query 8 sees key 11. Empty for a model
    whose forward takes neither (its image tokens attend causally, as text)."""
    import inspect

    parameters = inspect.signature(model.forward).parameters
    names = [name for name in ("token_type_ids", "mm_token_type_ids") if name in parameters]
    if not names:
        return frozenset()
    config = text_config(model.config)
    probe = _ImageMaskProbe(horizon=_mask_horizon(config))
    types = torch.zeros(PROBE_TOKENS, dtype=torch.long)
    start, end = IMAGE_PROBE_SPAN
    types[start:end] = 1
    try:
        _probe_forward(model, probe, config.vocab_size, inputs=dict.fromkeys(names, types))
    except ValueError as exc:
        raise ValueError(
            f"hybridkv could not tell how {type(model).__name__}'s image tokens attend (its forward with "
            f"{names[0]} failed: {exc.__cause__!r}), so it serves it for text only"
        ) from exc
    layers = set()
    for layer_idx, mask in probe.layer_masks:
        if mask is None:
            raise ValueError(
                f"layer {layer_idx} of {type(model).__name__} built no mask: its image attention is unknown"
            )
        seen = mask[0, 0, start, end - 1]
        if bool(seen if seen.dtype == torch.bool else seen == 0):
            layers.add(layer_idx)
    return frozenset(layers)
