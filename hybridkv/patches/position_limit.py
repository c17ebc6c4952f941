"""Limits, not refusals: a model whose output depends on state an engine step lacks is served only
up to the positions where that state makes no difference."""

from __future__ import annotations

from typing import Any


def position_limit(config: Any) -> tuple[int | None, str]:
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
