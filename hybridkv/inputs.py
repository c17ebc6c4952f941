"""The input side of the engine: a prompt (text or token ids) made into checked token ids, and the
model's end-of-sequence ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

Prompt = str | Sequence[int]


class InputProcessor:
    """Tokenizes text prompts and checks token ids against the model: inside the vocabulary, and no
    image, video or audio placeholder (hybridkv serves text only)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = model.config.get_text_config().vocab_size
        self.media_token_ids = _media_token_ids(model.config)

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and its checked token ids; a ValueError naming the fix."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: pass tokenizer= to hybridkv.patch or give token ids")
            text, ids = prompt, list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}); check the tokenizer")
        media = self.media_token_ids.keys() & set(ids)
        if media:
            token = min(media)
            raise ValueError(
                f"the prompt holds token {token}, the model's {self.media_token_ids[token]}; hybridkv serves "
                "text prompts only (image, video and audio inputs are not supported yet): remove it"
            )
        return text, ids


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """The ids that end a sample: the generation config's eos_token_id(s) and the tokenizer's."""
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(eos)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def _media_token_ids(config: Any) -> dict[int, str]:
    """The placeholder ids a multimodal config reserves for image, video and audio inputs, each with
    the config field that names it."""
    found = {}
    for kind in ("image", "video", "audio"):
        for field in (f"{kind}_token_id", f"{kind}_token_index"):
            token = getattr(config, field, None)
            if isinstance(token, int):
                found[token] = f"{kind} placeholder (config.{field})"
    return found
