"""The input side of the engine: a prompt (text or token ids) made into checked token ids, and the
model's end-of-sequence ids."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

# Text, token ids, or vLLM's dict prompts: {"prompt": text} (TextPrompt), {"prompt_token_ids": ids} (TokensPrompt),
# either with "multi_modal_data" (images) and "cache_salt".
Prompt = str | Sequence[int] | torch.Tensor | dict
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data", "cache_salt"})


def plain_prompt(prompt: dict[str, Any]) -> tuple[Any, str | None]:
    """A dict prompt (vLLM's TextPrompt or TokensPrompt) as the text or token ids it holds, or, with images in
    `multi_modal_data`, as the dict without its `cache_salt`; and that salt (None when not given)."""
    unknown = prompt.keys() - _PROMPT_KEYS
    if unknown:
        raise ValueError(
            f"a dict prompt takes 'prompt' (text) or 'prompt_token_ids', and optionally 'multi_modal_data' and "
            f"'cache_salt'; got {sorted(unknown)}"
        )
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a dict prompt needs exactly one of 'prompt' (text) and 'prompt_token_ids'")
    salt = prompt.get("cache_salt")
    if prompt.get("multi_modal_data"):
        return {key: value for key, value in prompt.items() if key != "cache_salt"}, salt
    return (prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]), salt


def token_ids(prompt: Any) -> list[int]:
    """One prompt's token ids as Python ints: from a sequence of ints, or a 1-D or [1, N] tensor or
    array of integers. Anything else is a TypeError that says what a prompt can be."""
    if hasattr(prompt, "tolist") and hasattr(prompt, "shape"):  # a tensor or an array
        if len(prompt.shape) == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if len(prompt.shape) != 1:
            raise TypeError(
                f"a prompt tensor or array must be 1-D or [1, N], got shape {tuple(prompt.shape)}; "
                "pass a [B, N] batch to generate(), which takes each row as a prompt"
            )
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(
            f"a prompt is a string, a list of token ids or a 1-D tensor of them, got {type(prompt).__name__}"
        )
    for token in prompt:
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):  # numpy integers are Integral
            raise TypeError(
                f"token ids must be integers, got {token!r} ({type(token).__name__}); tokenize text with the "
                "tokenizer given to hybridkv.patch, or pass a string"
            )
    return [int(t) for t in prompt]


def prompt_list(prompts: Any) -> list[Any]:
    """generate()'s prompts as a list of single prompts: one string or token-id list, a list of them, or
    a [B, N] tensor or array (each row a prompt, taken whole: padding is not removed)."""
    if isinstance(prompts, (str, dict)):  # a dict: one prompt with images (hybridkv/execution/multimodal.py)
        return [prompts]
    if hasattr(prompts, "tolist") and hasattr(prompts, "shape"):
        if len(prompts.shape) == 1:
            return [prompts]
        if len(prompts.shape) == 2:
            return list(prompts)
        raise TypeError(f"a prompt tensor or array must be 1-D or [B, N], got shape {tuple(prompts.shape)}")
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a string, a list of token ids, a list of those, or a [B, N] tensor; got "
            f"{type(prompts).__name__}"
        )
    if not prompts:
        raise ValueError("generate() got no prompts; give at least one")
    if all(isinstance(p, numbers.Integral) for p in prompts):
        return [prompts]
    return list(prompts)


class InputProcessor:
    """Tokenizes text prompts and checks token ids against the model: inside the vocabulary, and no
    image, video or audio placeholder (hybridkv serves text only)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text_config = model.config.get_text_config()
        self.vocab_size = self.text_config.vocab_size  # as patched: what the engine's grammars were made for
        self.media_token_ids = _media_token_ids(model.config)

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and its checked token ids; a ValueError (TypeError for a
        wrong type) naming the fix. Token ids may be a list, a 1-D or [1, N] tensor or array."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: pass tokenizer= to hybridkv.patch or give token ids")
            text, ids = prompt, list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        else:
            text, ids = None, token_ids(prompt)
        self.check(ids)
        return text, ids

    def check(self, ids: list[int], allowed: int | None = None) -> None:
        """Token ids inside the vocabulary, and no media placeholder but `allowed` (the image placeholder of a
        prompt whose images came with it), which may also sit past the vocabulary (Gemma 3's)."""
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        media = self.media_token_ids.keys() & set(ids) - {allowed}
        if media:
            token = min(media)
            raise ValueError(
                f"the prompt holds token {token}, the model's {self.media_token_ids[token]}, with no image "
                "given for it: pass the prompt as {'prompt': ..., 'multi_modal_data': {'image': ...}} (images "
                "only; video and audio are not served), or remove it"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size and t != allowed]
        if bad:
            if self.vocab_changed():
                raise ValueError(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}) the model had when it was "
                    f"patched; it has {self.model_vocab_size()} tokens now (resize_token_embeddings): call "
                    "hybridkv.patch(model) again to serve them"
                )
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}); check the tokenizer")

    def model_vocab_size(self) -> int:
        """The model's vocabulary now (`resize_token_embeddings` changes it)."""
        return self.text_config.vocab_size

    def vocab_changed(self) -> bool:
        """Whether the model's vocabulary is another size than when it was patched."""
        return self.model_vocab_size() != self.vocab_size


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
