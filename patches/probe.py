"""The probe forward: one short forward of the model with hybridkv's functions in recording mode.

For each attention call the recorder (`Probe`) keeps the module and its `layer_idx`, the shapes of
query, key and value, the `sliding_window` the call passes, any other input the kernels would have to
implement, and which keys each query may see. The last comes from the mask: transformers builds every
mask through the mask interface from a `mask_function(batch, head, q_idx, kv_idx)`, which the probe
evaluates at positions far beyond the probe's tokens (so a window of 4,096 is seen in a 40-token
forward), and falls back to the materialized mask when a model builds its own
(`patches/visibility.py`). What the calls mean for serving is decided in `patches/inspection.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv.patches import attention
from hybridkv.patches.devices import input_device
from hybridkv.patches.layer_kinds import text_config
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


def record_attention_calls(model: torch.nn.Module) -> list[AttentionCall]:
    """Run the probe forward (hybridkv's functions installed for its duration if the model is not
    patched) and return every attention call, in call order."""
    config = text_config(model.config)
    probe = Probe(horizon=_mask_horizon(config))
    _probe_forward(model, probe, config.vocab_size)
    return probe.calls


def _probe_forward(model: torch.nn.Module, probe: Probe, vocab_size: int) -> None:
    # Ordinary tokens from the middle of the vocabulary: special and multimodal ids sit at its ends.
    ids = (torch.arange(PROBE_TOKENS) + vocab_size // 2) % vocab_size
    device = input_device(model)
    with attention_installed(model), attention.probing(probe), torch.inference_mode():
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


def _mask_horizon(config: Any) -> int:
    return min(max(getattr(config, "max_position_embeddings", 0) or 0, 1 << 16), MAX_MASK_HORIZON)
