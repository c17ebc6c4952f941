"""`SpeculativeConfig`: what `hybridkv.patch(model, speculative_config={...})` takes, in vLLM's names.

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}
    {"method": "draft_model", "model": draft_hf_model, "num_speculative_tokens": k}

n-gram prompt lookup proposes the k tokens that followed the longest earlier match (m to n tokens) of the
sequence's last tokens; a draft model (any transformers causal LM with the target's vocabulary) proposes its own
greedy continuation. How the proposals are checked and rolled back: hybridkv/engine/speculation.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.scheduling.validation import check_int

METHODS = ("ngram", "draft_model")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}


@dataclass(frozen=True, eq=False)
class SpeculativeConfig:
    """A checked `speculative_config` (see the module docstring). Two configs are equal when their settings are and
    their draft is the same model object."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    model: Any = None

    def _key(self) -> tuple:
        return (
            self.method,
            self.num_speculative_tokens,
            self.prompt_lookup_max,
            self.prompt_lookup_min,
            id(self.model),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SpeculativeConfig) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @classmethod
    def of(cls, value: Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """The checked config of a `speculative_config` dict (vLLM's keys; a `model` without a `method` is a draft
        model, as in vLLM), or None. A wrong key or value is an error naming the fix."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"speculative_config must be a dict of vLLM's keys, got {type(value).__name__}")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; the keys are {sorted(_KEYS)}")
        method = value.get("method", "draft_model" if value.get("model") is not None else None)
        if method not in METHODS:
            raise ValueError(
                f"speculative_config's method must be one of {METHODS} (vLLM's names), got {method!r}; EAGLE and MTP "
                "heads are not supported"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens (tokens proposed per step, e.g. 4)")
        k = check_int("num_speculative_tokens", value["num_speculative_tokens"], 1)
        if method == "ngram":
            if value.get("model") is not None:
                raise ValueError("speculative_config: method 'ngram' takes no model; use method 'draft_model'")
            high = check_int("prompt_lookup_max", value.get("prompt_lookup_max", 5), 1)
            low = check_int("prompt_lookup_min", value.get("prompt_lookup_min", min(high, 2)), 1)
            if low > high:
                raise ValueError(f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
            return cls(method, k, high, low)
        model = value.get("model")
        if model is None or isinstance(model, str):
            raise ValueError(
                "speculative_config's draft model must be a loaded transformers causal LM (nothing is downloaded "
                f"here), got {model!r}"
            )
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            if key in value:
                raise ValueError(f"speculative_config: {key} is for method 'ngram', not 'draft_model'")
        return cls(method, k, model=model)
