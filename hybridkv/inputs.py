"""vLLM's `vllm.inputs` path: the dict prompts `generate`, `add_request` and the async engine take beside text and token
ids (hybridkv/execution/inputs.py reads them)."""

from __future__ import annotations

from typing import Any, TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the engine's tokenizer; images in `multi_modal_data` ({"image": ...})."""

    prompt: str
    multi_modal_data: NotRequired[dict[str, Any] | None]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt as token ids, taken as they are."""

    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[dict[str, Any] | None]
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
