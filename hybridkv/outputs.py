"""What the engine returns: RequestOutput with one CompletionOutput per sample (names follow vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprobs:
    """The sampled token's logprob and the top-k (token id, logprob) pairs, most likely first."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    """One sample of a request. finish_reason: None while running, then "stop" (EOS, a stop token or
    a stop string: stop_reason says which), "length", "abort" or "error". cumulative_logprob: the sum of
    its tokens' logprobs, when logprobs or best_of asked for them (None otherwise)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) and prefix-cache use of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's state: its prompt and samples; `error` says why a failed request failed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None


@dataclass
class StreamDelta:
    """What one sample produced since the last delta: new token ids (and their logprobs, when asked for) and new
    text; the last delta has the finish reason, and the error when the request failed."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
