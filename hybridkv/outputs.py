"""What the engine returns: RequestOutput with one CompletionOutput per sample, and Logprob; for a pooling model the
PoolingRequestOutput family. vLLM's classes, field for field (hybridkv adds `RequestOutput.error`, the reason a request
failed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """vLLM's: one token's log-probability, its rank in the distribution (1: the most likely) and its text
    (`tokenizer.decode([token_id])`; None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position, token id -> Logprob: the sampled (or prompt) token and the k most likely (vLLM's shapes). A
# request's prompt logprobs start with None: its first token has no distribution.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sample of a request. finish_reason: None while running, then "stop" (EOS, a stop token or
    a stop string: stop_reason says which), "length", "abort" or "error". cumulative_logprob: the sum of
    its tokens' logprobs, when logprobs or best_of asked for them (None otherwise)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        """vLLM's: whether the sample has ended (a method, as vLLM's is)."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) and prefix-cache use of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    # hybridkv's: of num_cached_tokens, the tokens each tier gave ({"device", "host", "disk"}; empty without a hit),
    # and where and why the hit stopped short of the prompt ({"group", "kind", "tokens", "reason"}: "evicted", "never
    # cached", "no checkpoint kept there"; None for a whole hit or a request that read no cache).
    prefix_cache_tiers: dict[str, int] = field(default_factory=dict)
    prefix_cache_miss: dict[str, int | str] | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's state, vLLM's fields in vLLM's order: its prompt, the prompt's logprobs (with
    `prompt_logprobs`), its samples, whether it has finished, its metrics and how many prompt tokens came from the
    prefix cache; `error` says why a failed request failed (hybridkv's)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None

    @property
    def num_cached_tokens(self) -> int:
        """vLLM's: the prompt tokens taken from the prefix cache when the request was first admitted."""
        return self.metrics.num_cached_tokens


@dataclass
class StreamDelta:
    """What one sample produced since the last delta: new token ids (and their logprobs, when asked for) and new
    text; the last delta has the finish reason, and the error when the request failed."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    logprobs: SampleLogprobs | None = None


# ---- pooling models' outputs (vLLM's `vllm.outputs` classes; hybridkv/engine/pooling.py makes them) ----------------


@dataclass
class PoolingOutput:
    """vLLM's: what a pooling call computed for one prompt, as a torch tensor (`LLM.encode`; a reward model's
    per-token scores, `LLM.reward`)."""

    data: Any


@dataclass
class EmbeddingOutput:
    """vLLM's: one prompt's embedding (`LLM.embed`)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """vLLM's: one prompt's class probabilities (`LLM.classify`)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """vLLM's: one pair's score (`LLM.score`): a cross-encoder's probability, or two embeddings' cosine."""

    score: float


@dataclass
class PoolingRequestOutput:
    """vLLM's: one prompt's pooling result. `outputs` is a `PoolingOutput` here; the typed calls return the
    subclasses below, whose `outputs` are their own types."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


class EmbeddingRequestOutput(PoolingRequestOutput):
    """vLLM's: `outputs` is an `EmbeddingOutput`."""


class ClassificationRequestOutput(PoolingRequestOutput):
    """vLLM's: `outputs` is a `ClassificationOutput`."""


class ScoringRequestOutput(PoolingRequestOutput):
    """vLLM's: `outputs` is a `ScoringOutput`."""
