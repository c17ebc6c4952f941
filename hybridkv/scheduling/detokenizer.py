"""Incremental detokenization and stop strings.

Each new token is decoded together with a few tokens before it, and only the text beyond what those
earlier tokens decode to is new. That keeps the spaces and merges that a tokenizer decides from
context (SentencePiece's leading spaces, byte-level BPE's multi-byte characters) exactly as a full
decode gives them, at a constant cost per token. Text that ends in an incomplete character ("\ufffd")
waits for the next token.

Stop strings: the text is cut right before the first stop string that appears (right after it with
`include_stop_str_in_output`, vLLM's option). Text that could still turn into the start of a stop string is held
back from streaming until it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """The text of one completion, grown token by token."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop = tuple(stop)
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        if tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            context = []  # the prompt ends inside a character: the output's text must not merge into it
        self._tokens = context
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""
        self.stop_reason: str | None = None
        self._streamed = 0

    def add_token(self, token_id: int, check_stop: bool = True) -> bool:
        """Append a token's text; True when a stop string appeared in the text it added (the text is then cut before
        it). With `check_stop` False the text grows and no stop string is looked for (a sample under its
        min_tokens)."""
        self._tokens.append(token_id)
        prefix, full = self._decode_window()
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += delta
        return check_stop and self._check_stop(start)

    def flush(self) -> None:
        """At the end: add text still waiting for a character to complete, as a full decode shows it."""
        if self.stop_reason is not None or self._read_offset == len(self._tokens):
            return
        prefix, full = self._decode_window()
        self._read_offset = len(self._tokens)
        self.text += full[len(prefix) :]

    def _decode_window(self) -> tuple[str, str]:
        """The text of the context tokens alone, and with the unread tokens after them."""
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix = decode(self._tokens[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        return prefix, decode(self._tokens[self._prefix_offset :], skip_special_tokens=skip)

    def _check_stop(self, search_from: int) -> bool:
        found = [(self.text.find(s, search_from), s) for s in self.stop]
        found = [(index, s) for index, s in found if index != -1]
        if not found:
            return False
        index, stop = min(found)
        self.text = self.text[: index + len(stop) if self.include_stop_str_in_output else index]
        self.stop_reason = stop
        return True

    def stream_delta(self, finished: bool) -> str:
        """Text not yet streamed; while unfinished, hold back a tail that may begin a stop string."""
        end = len(self.text)
        if not finished:
            end -= self._held_back()
        delta = self.text[self._streamed : end]
        self._streamed = max(self._streamed, end)
        return delta

    def _held_back(self) -> int:
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
