"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (names follow vLLM).

    temperature 0 means greedy decoding. A request stops at max_tokens new tokens, at an EOS token
    (unless ignore_eos) or at one of stop_token_ids, never before min_tokens.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.temperature != 0.0:
            raise ValueError(
                f"temperature={self.temperature}: only greedy decoding (temperature=0) is implemented so far"
            )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
