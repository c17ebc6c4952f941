"""Limits, not refusals: a model whose output depends on state an engine step lacks is served only
up to the positions where that state makes no difference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PositionLimit:
    """Tokens up to which a model's output does not depend on state a step lacks, and why. Where the model
    counts a step's rows as positions too (`counts_step_rows`), a step's rows stay within `max_tokens` as well."""

    max_tokens: int
    reason: str
    counts_step_rows: bool


def position_limits(config: Any) -> list[PositionLimit]:
    """Every limit the text config `config` imposes (none for most models)."""
    found = (_temperature_tuning_limit(config), _longrope_limit(config))
    return [limit for limit in found if limit is not None]


def _temperature_tuning_limit(config: Any) -> PositionLimit | None:
    """Llama 4's attention temperature tuning scales the queries of its no-RoPE layers by
    1 + attn_scale * log1p(floor((p + 1) / floor_scale)), with p counted from the length of its own
    cache (`past_key_values.get_seq_length()`), not from position_ids. An engine step has no such
    cache, so p would be the row's index in the step: exact only while every position and every row
    index p has p + 1 < floor_scale, where the factor is 1 for both (max_model_len and
    max_num_batched_tokens at most floor_scale - 1)."""
    floor_scale = getattr(config, "floor_scale", None)
    if not getattr(config, "attn_temperature_tuning", False) or not floor_scale:
        return None
    reason = (
        f"its no-RoPE layers scale queries by a temperature that grows from position {floor_scale - 1} on "
        f"(attn_temperature_tuning, floor_scale={floor_scale}), counted from the model's own cache, which "
        "hybridkv's batched steps do not have"
    )
    return PositionLimit(floor_scale - 1, reason, counts_step_rows=True)


def _longrope_limit(config: Any) -> PositionLimit | None:
    """Phi-3-style longrope (Phi-3/3.5 128k, Phi-3.5-MoE, Phi-4-mini) rotates every row of a forward with
    short_factor (and short_mscale) while the forward's largest position + 1 is at most
    original_max_position_embeddings, and with long_factor beyond (transformers' `dynamic_rope_update`). In
    `generate` that length is the request's own, and when it first passes the switch the model's
    `prepare_inputs_for_generation` drops the cache and recomputes the whole sequence with long factors. A step
    sees its largest position over all its requests and keeps the pages as computed: exact only while every
    position p has p + 1 <= original_max_position_embeddings, where every forward uses the short factors
    (max_model_len at most the switch length; a step's rows are positions of their own requests, so any
    max_num_batched_tokens)."""
    rope = getattr(config, "rope_parameters", None) or {}
    # One dict, or one per layer type (Gemma 3's sliding and full layers).
    switches = [
        params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
        for params in ([rope] if "rope_type" in rope else rope.values())
        if isinstance(params, dict) and params.get("rope_type") == "longrope"
    ]
    switches = [switch for switch in switches if switch]
    if not switches:
        return None
    switch = min(switches)
    reason = (
        f"its longrope rotary embedding takes long_factor instead of short_factor once a forward's sequence passes "
        f"original_max_position_embeddings={switch} tokens (generate then recomputes the request's whole cache "
        "with the long factors), and a batched step would switch on another request's length and keep the pages "
        "computed with the short factors"
    )
    return PositionLimit(switch, reason, counts_step_rows=False)
