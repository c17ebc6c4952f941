"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hybridkv.structured_outputs import StructuredOutputsParams
from hybridkv.validation import check_bool, check_float, check_int, is_int

# Temperatures below this are greedy, as vLLM's _SAMPLING_EPS: logits divided by a tinier one overflow
# float32 (temperature=1e-40 gave NaN probabilities, and always token 0).
GREEDY_TEMPERATURE = 1e-5
_FLOAT_SETTINGS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings; names and meanings follow vLLM.

    temperature 0 is greedy decoding, and so is any temperature below 1e-5 (`GREEDY_TEMPERATURE`).
    top_k -1 (or 0, as in vLLM; stored as -1) and top_p 1 and min_p 0 turn those filters off. A request
    stops after max_tokens new tokens, at an EOS token (unless ignore_eos), at one of stop_token_ids or
    when its text contains one of the stop strings (the text is cut before it), never before
    min_tokens. n > 1 samples n completions: the prompt is computed once and its blocks shared by every
    sample (forked, copy-on-write). best_of >= n samples best_of completions and returns the n with the
    highest cumulative logprob (vLLM's meaning; while the request runs, its output lists all best_of). A
    seed makes the request's samples reproducible whatever else runs in the same batch. logprobs=k returns the sampled
    token's log-probability and the k most likely tokens' at every step. structured_outputs constrains
    every sample's text to a JSON schema, regex, choice list or grammar (hybridkv/structured_outputs.py);
    a sample stops when its grammar is complete.

    Everything is checked here, not when the request runs: counts (n, max_tokens, min_tokens, top_k,
    logprobs, seed) must be ints (not bools), the rest finite numbers, stop a string or strings,
    stop_token_ids a list of ints, cache_salt a string. A wrong type is a TypeError, a value out of
    range a ValueError; both name the rule.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: Sequence[str] | str | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        set_field = functools.partial(object.__setattr__, self)
        for name in ("n", "max_tokens", "min_tokens", "top_k"):
            set_field(name, check_int(name, getattr(self, name)))
        for name in ("seed", "logprobs", "best_of"):
            if getattr(self, name) is not None:
                set_field(name, check_int(name, getattr(self, name)))
        for name in _FLOAT_SETTINGS:
            set_field(name, check_float(name, getattr(self, name)))
        check_bool("ignore_eos", self.ignore_eos)
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise TypeError(
                f"cache_salt must be a string or None, got {self.cache_salt!r} ({type(self.cache_salt).__name__})"
            )
        if isinstance(self.structured_outputs, dict):
            set_field("structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(
                "structured_outputs must be a hybridkv.StructuredOutputsParams (or a dict of its fields), "
                f"got {type(self.structured_outputs).__name__}"
            )
        if self.top_k == 0:
            set_field("top_k", -1)
        set_field("stop", _stop_strings(self.stop))
        set_field("stop_token_ids", _stop_token_ids(self.stop_token_ids))
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (
                self.best_of is None or self.best_of >= self.n,
                f"best_of must be >= n={self.n} (the n best of best_of samples are returned), got {self.best_of}",
            ),
            (self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (
                0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            ),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}"),
            (
                self.seed is None or -(2**63) <= self.seed <= 2**64 - self.num_samples,
                f"seed must be in [-2**63, 2**64 - best_of] (sample i draws from the 64-bit seed + i), got {self.seed}",
            ),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def num_samples(self) -> int:
        """How many completions are sampled: best_of, or n when best_of is not given."""
        return self.n if self.best_of is None else self.best_of

    @property
    def needs_logprob(self) -> bool:
        """Whether each sampled token's logprob is needed (asked for, or to rank best_of samples)."""
        return self.logprobs is not None or self.num_samples > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    strings = tuple(stop) if isinstance(stop, Iterable) and not isinstance(stop, bytes) else None
    if strings is None or not all(isinstance(s, str) for s in strings):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    if not all(strings):
        raise ValueError("stop strings must be non-empty")
    return strings


def _stop_token_ids(token_ids: object) -> tuple[int, ...]:
    if token_ids is None:
        return ()
    if is_int(token_ids):
        raise TypeError(
            f"stop_token_ids must be a list of token ids, got {token_ids}; pass stop_token_ids=[{token_ids}]"
        )
    ids = tuple(token_ids) if isinstance(token_ids, Iterable) and not isinstance(token_ids, (str, bytes)) else None
    if ids is None or not all(is_int(i) for i in ids):
        raise TypeError(f"stop_token_ids must be a list of ints, got {token_ids!r}")
    if any(i < 0 for i in ids):
        raise ValueError(f"stop_token_ids must be token ids >= 0, got {token_ids!r}")
    return tuple(int(i) for i in ids)
