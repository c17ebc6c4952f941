"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's class: its names, defaults and
units, mutable as vLLM's is)."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.scheduling.structured_params import StructuredOutputsParams
from hybridkv.scheduling.validation import check_bool, check_float, check_int, is_int

# Temperatures below this are greedy, as vLLM's _SAMPLING_EPS: logits divided by a tinier one overflow
# float32 (temperature=1e-40 gave NaN probabilities, and always token 0).
GREEDY_TEMPERATURE = 1e-5
LOGIT_BIAS_LIMIT = 100.0  # vLLM's and OpenAI's bound on one token's bias
# vLLM's bound on the samples of one request (its VLLM_MAX_N_SEQUENCES, read when a SamplingParams is checked): what
# one request may queue, however many run at once.
MAX_N_SEQUENCES = 16384
_FLOAT_SETTINGS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOL_SETTINGS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "speculative")
# The generation-config fields vLLM takes as a model's default sampling settings (`generation_config="auto"`), with
# the SamplingParams field each sets.
GENERATION_CONFIG_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


class RequestOutputKind(enum.Enum):
    """What each output of a streamed request holds (vLLM's): everything so far (CUMULATIVE), only what is new since the
    last one (DELTA), or nothing until the request ends (FINAL_ONLY). `AsyncLLM.generate` (hybridkv/async_engine.py)
    yields them so; `generate()` returns finished outputs whatever the kind."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Per-request generation settings: vLLM's `SamplingParams`, field for field where hybridkv has the feature.

    temperature 0 is greedy decoding, and so is any temperature below 1e-5 (`GREEDY_TEMPERATURE`). top_k 0 (or -1)
    and top_p 1 and min_p 0 turn those filters off. A request stops after max_tokens new tokens (None: at
    `max_model_len`), at an EOS token (unless ignore_eos), at one of stop_token_ids or when its text contains one of
    the stop strings (the text is cut before it, or after it with include_stop_str_in_output), never before
    min_tokens. n > 1 samples n completions: the prompt is computed once and its blocks shared by every sample
    (forked, copy-on-write). A seed makes the request's samples reproducible whatever else runs in the same batch.
    logprobs=k returns, per new token, a dict of the sampled token and the k most likely tokens (-1: every token),
    each a `Logprob(logprob, rank, decoded_token)` of the model's raw distribution; prompt_logprobs=k the same for
    every prompt token after the first (the request then computes its whole prompt: no prefix-cache hit).
    logit_bias adds a bias in [-100, 100] to token ids' logits (keys may be strings of ids, as JSON sends them).
    skip_special_tokens leaves special tokens out of the text. structured_outputs constrains every sample's text to
    a JSON schema, regex, choice list or grammar (hybridkv/sampling/structured_outputs.py); a sample stops when its
    grammar is complete.

    hybridkv's extras: best_of >= n samples best_of completions and returns the n with the highest cumulative
    logprob; cache_salt keeps a request's prefix-cache blocks apart from those of other salts; speculative=False turns
    speculative decoding off for the request (on an engine patched with `speculative_config`).

    output_kind (`RequestOutputKind`) says what each output of a streamed request holds: everything so far, only what
    is new, or only the final one.

    Everything is checked on construction and again when a request is added (a request takes its own copy: changing
    the object afterwards changes no request): counts must be ints (not bools), the rest finite numbers, stop a
    string or strings, stop_token_ids a list of ints, cache_salt a string. A wrong type is a TypeError, a value out
    of range a ValueError; both name the rule. Like vLLM's, `stop` and `stop_token_ids` are kept as lists, `seed=-1`
    means no seed and `logprobs=True` means 1.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    best_of: int | None = None
    cache_salt: str | None = None
    speculative: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.seed == -1:
            self.seed = None
        for name in ("n", "min_tokens", "top_k"):
            setattr(self, name, check_int(name, getattr(self, name)))
        for name in ("seed", "logprobs", "prompt_logprobs", "best_of", "max_tokens"):
            if getattr(self, name) is not None:
                setattr(self, name, check_int(name, getattr(self, name)))
        for name in _FLOAT_SETTINGS:
            setattr(self, name, check_float(name, getattr(self, name)))
        for name in _BOOL_SETTINGS:
            check_bool(name, getattr(self, name))
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise TypeError(
                f"cache_salt must be a string or None, got {self.cache_salt!r} ({type(self.cache_salt).__name__})"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(
                f"output_kind must be a hybridkv.sampling_params.RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), "
                f"got {self.output_kind!r}"
            )
        if isinstance(self.structured_outputs, Mapping):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(
                "structured_outputs must be a hybridkv.StructuredOutputsParams (or a dict of its fields), "
                f"got {type(self.structured_outputs).__name__}"
            )
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)
        self._verify()

    def _verify(self) -> None:
        max_tokens = self.max_tokens
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (
                self.n <= (limit := max_n_sequences()) and self.num_samples <= limit,
                f"{'n' if self.n > limit else 'best_of'} must be at most {limit} (samples of one request: vLLM's "
                f"VLLM_MAX_N_SEQUENCES), got {max(self.n, self.num_samples)}; ask for fewer, or send several requests",
            ),
            (
                self.best_of is None or self.best_of >= self.n,
                f"best_of must be >= n={self.n} (the n best of best_of samples are returned), got {self.best_of}",
            ),
            (self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                max_tokens is None or max_tokens >= 1,
                f"max_tokens must be >= 1 (or None: up to max_model_len), got {max_tokens}",
            ),
            (
                self.min_tokens >= 0 and (max_tokens is None or self.min_tokens <= max_tokens),
                f"min_tokens must be in [0, max_tokens={max_tokens}], got {self.min_tokens}",
            ),
            (
                self.logprobs is None or self.logprobs >= -1,
                f"logprobs must be >= 0, or -1 for every token, got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= -1,
                f"prompt_logprobs must be >= 0, or -1 for every token, got {self.prompt_logprobs}",
            ),
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

    def clone(self) -> SamplingParams:
        """A checked copy (vLLM's name): what a request keeps, so that changing this object later changes no
        request already added, and a field set to a bad value since construction is refused here."""
        return dataclasses.replace(self)

    @classmethod
    def from_generation_config(cls, generation_config: Any, **overrides: Any) -> SamplingParams:
        """vLLM's defaults from a model's generation config (`generation_config="auto"`): the fields it sets to other
        than transformers' defaults among repetition_penalty, temperature, top_k, top_p, min_p and max_new_tokens
        (as max_tokens), then `overrides`."""
        return cls(**{**generation_config_defaults(generation_config), **overrides})

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

    @property
    def top_k_on(self) -> bool:
        return self.top_k > 0


def generation_config_defaults(generation_config: Any) -> dict[str, Any]:
    """The SamplingParams fields a transformers `GenerationConfig` sets to other than its own defaults (vLLM's
    `get_diff_sampling_param`): {} for None or a config that sets none."""
    if generation_config is None:
        return {}
    diff = generation_config.to_diff_dict() if hasattr(generation_config, "to_diff_dict") else dict(generation_config)
    return {field: diff[key] for key, field in GENERATION_CONFIG_FIELDS.items() if diff.get(key) is not None}


def _stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    strings = list(stop) if isinstance(stop, Iterable) and not isinstance(stop, bytes) else None
    if strings is None or not all(isinstance(s, str) for s in strings):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    if not all(strings):
        raise ValueError("stop strings must be non-empty")
    return strings


def max_n_sequences() -> int:
    """The most samples one request may have: VLLM_MAX_N_SEQUENCES where it is set, as in vLLM, else its default."""
    return int(os.environ.get("VLLM_MAX_N_SEQUENCES", MAX_N_SEQUENCES))


def _stop_token_ids(token_ids: object) -> list[int]:
    if token_ids is None:
        return []
    if is_int(token_ids):
        raise TypeError(
            f"stop_token_ids must be a list of token ids, got {token_ids}; pass stop_token_ids=[{token_ids}]"
        )
    ids = list(token_ids) if isinstance(token_ids, Iterable) and not isinstance(token_ids, (str, bytes)) else None
    if ids is None or not all(is_int(i) for i in ids):
        raise TypeError(f"stop_token_ids must be a list of ints, got {token_ids!r}")
    if any(i < 0 for i in ids):
        raise ValueError(f"stop_token_ids must be token ids >= 0, got {token_ids!r}")
    return list(dict.fromkeys(int(i) for i in ids))


def _logit_bias(bias: object) -> dict[int, float] | None:
    """Token id -> bias, clamped to [-100, 100] as vLLM and OpenAI do; an id may come as a string of digits."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    clamped = {}
    for token, value in bias.items():
        if isinstance(token, str) and token.strip().lstrip("-").isdigit():
            token = int(token)
        if not is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0, or strings of them), got {token!r}")
        value = check_float(f"logit_bias[{token}]", value)
        clamped[int(token)] = math.copysign(min(abs(value), LOGIT_BIAS_LIMIT), value)
    return clamped
