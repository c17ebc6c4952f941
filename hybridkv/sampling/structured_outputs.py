"""Structured outputs: a request's tokens constrained to a JSON schema, a regex, a choice list or a grammar.

The grammar library is llguidance, chosen by measurement (benchmarks/grammar_backends.py; benchmarks/RESULTS.md,
'Choices in the code'): against xgrammar its JSON-schema mask costs less per token on both vocabularies measured,
and its "compilation" is lazy, so nothing has to be compiled ahead of the step; xgrammar is faster only on choice
lists, where both are cheap.

Each sample of a constrained request holds its own matcher (`GrammarMatcher`). Before a step's sampling
the sampler asks every constrained row's matcher for its next-token bitmask and sets the disallowed
logits to -inf (other rows are untouched, so constrained and free requests share a step); the output
processor feeds each new token to the matcher, and a sample whose grammar is complete stops. The
logprobs a request asks for stay those of the model's raw distribution (vLLM's default). A request
preempted by recompute keeps its output tokens, so its matcher needs no rewind.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.scheduling.structured_params import StructuredOutputsParams

# JSON is written compactly by default, with no whitespace between its tokens: a model free to add
# whitespace between tokens can fill max_tokens with it (a tiny random one did, every time). A request may
# ask for free whitespace (disable_any_whitespace=False, vLLM's default), and so may a schema, with
# {"x-guidance": {"whitespace_flexible": true}}.
_EBNF_RULE = re.compile(r"^\s*[\w\-]+\s*::=", re.M)


@dataclass
class MaskCounters:
    """Next-token masks computed (one per constrained row per step) and the seconds they took, the
    unpacking and the logits' masking included: `stats()`' structured_output_* entries."""

    num_masks: int = 0
    seconds: float = 0.0


class GrammarCompiler:
    """The engine's grammars: llguidance's tokenizer (built once, on first use: about a second) and the
    grammars requests asked for, checked and kept by their text (least recently used out). Safe to call
    from several threads (AsyncLLMEngine checks requests in its callers' threads)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], cache_size: int = 256) -> None:
        self._lock = threading.Lock()
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: Any = None
        self._grammars: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._cache_size = cache_size
        self.counters = MaskCounters()

    @property
    def tokenizer(self) -> Any:
        if self._hf_tokenizer is None:
            raise ValueError("structured outputs need a tokenizer: pass tokenizer= to hybridkv.patch")
        if self._tokenizer is None:
            _import_llguidance()
            from llguidance.hf import from_tokenizer

            backend = getattr(self._hf_tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise ValueError(
                    "structured outputs need a fast (tokenizers-backed) tokenizer; "
                    f"{type(self._hf_tokenizer).__name__} is not one: load it with "
                    "AutoTokenizer.from_pretrained(..., use_fast=True)"
                )
            if not self.eos_token_ids:
                raise ValueError(
                    "structured outputs need an EOS token (a grammar that may end ends there), and neither the "
                    "model's config nor the tokenizer names one: set tokenizer.eos_token (or "
                    "model.generation_config.eos_token_id)"
                )
            n_vocab = max(self.vocab_size, len(self._hf_tokenizer))
            self._tokenizer = from_tokenizer(self._hf_tokenizer, n_vocab=n_vocab, eos_token=self.eos_token_ids)
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The constraint's grammar, checked: a ValueError naming the fault if it cannot be followed."""
        key = params.key
        with self._lock:
            tokenizer = self.tokenizer
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return CompiledGrammar(tokenizer, grammar, self.counters)
        grammar = _grammar_text(params)
        error = _import_llguidance().LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(f"structured_outputs {key[0]} cannot be used: {error}")
        with self._lock:
            self._grammars[key] = grammar
            if len(self._grammars) > self._cache_size:
                self._grammars.popitem(last=False)
        return CompiledGrammar(tokenizer, grammar, self.counters)


class CompiledGrammar:
    """A checked grammar: each sample of a request makes its own matcher from it."""

    def __init__(self, tokenizer: Any, grammar: str, counters: MaskCounters) -> None:
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.counters = counters

    def matcher(self) -> GrammarMatcher:
        matcher = _import_llguidance().LLMatcher(self.tokenizer, self.grammar, log_level=0)
        return GrammarMatcher(matcher, self.counters, self.tokenizer.vocab_size)


class GrammarMatcher:
    """One sample's place in its grammar."""

    __slots__ = ("_matcher", "counters", "num_words")

    def __init__(self, matcher: Any, counters: MaskCounters, vocab_size: int) -> None:
        self._matcher = matcher
        self.counters = counters
        self.num_words = (vocab_size + 31) // 32  # of a bitmask row

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The tokens allowed next, one bit each, into int32 row `row` of `bitmask` (on the CPU). A grammar
        that cannot go on (a character no token can write, a parser limit) is a ValueError that says why:
        its row fails alone (hybridkv/sampling/sampler.py's sample_each), it is never sampled unconstrained."""
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        if self._matcher.is_error():
            raise ValueError(f"structured outputs: the grammar cannot go on: {_first_line(self._matcher.get_error())}")
        if not bool(target.any()):
            raise ValueError(
                "structured outputs: the grammar cannot go on: no token of the vocabulary writes what it needs next"
            )

    def accept(self, token: int) -> str | None:
        """Advance by a sampled token; returns None, or why the token broke the grammar."""
        if self._matcher.consume_token(token):
            return None
        return _first_line(self._matcher.get_error()) or f"token {token} is not allowed by the grammar"

    @property
    def is_complete(self) -> bool:
        """Whether the grammar has ended: no token but EOS may follow."""
        return self._matcher.is_stopped()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the start, the grammar would accept one after another (nothing advances)."""
        return self._matcher.validate_tokens(list(tokens)) if tokens else 0

    def fill_bitmasks_along(self, bitmask: torch.Tensor, tokens: Sequence[int]) -> None:
        """Rows 0..len(tokens) of `bitmask`: the tokens allowed before each of `tokens` (each accepted in turn) and
        after the last; the matcher ends where it began (rolled back), also on an error."""
        consumed = 0
        try:
            for row in range(len(tokens) + 1):
                self.fill_bitmask(bitmask, row)
                if row < len(tokens):
                    error = self.accept(tokens[row])
                    if error is not None:
                        raise ValueError(f"structured outputs: a proposed token breaks the grammar: {error}")
                    consumed += 1
        finally:
            if consumed:
                self._matcher.rollback(consumed)


def apply_bitmasks(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
    """`logits` with every token a row's matcher disallows at -inf (a copy when anything is masked)."""
    start = time.perf_counter()
    bitmask = torch.empty(len(rows), matchers[0].num_words, dtype=torch.int32)
    for index, matcher in enumerate(matchers):
        matcher.fill_bitmask(bitmask, index)
    return _masked(logits, rows, bitmask, matchers[0].counters, start)


def mask_along(logits: torch.Tensor, tokens: Sequence[int], matcher: GrammarMatcher) -> torch.Tensor:
    """A speculative check's `len(tokens) + 1` rows of `logits`, each masked as the grammar stands before the
    proposal at its place (after the proposals before it), the last after them all."""
    start = time.perf_counter()
    bitmask = torch.empty(len(tokens) + 1, matcher.num_words, dtype=torch.int32)
    matcher.fill_bitmasks_along(bitmask, tokens)
    return _masked(logits, range(len(tokens) + 1), bitmask, matcher.counters, start)


def _masked(
    logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor, counters: MaskCounters, start: float
) -> torch.Tensor:
    vocab = logits.shape[-1]
    # Unpacked where the logits are, a byte per token (bit i of the little-endian words is token i).
    packed = bitmask.to(logits.device, non_blocking=True).view(torch.uint8)
    bits = torch.arange(8, dtype=torch.uint8, device=logits.device)
    allowed = ((packed.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # logits wider than the grammar's vocabulary: the rest is never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    index = torch.tensor(list(rows), device=logits.device)
    logits = logits.clone()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    counters.num_masks += len(rows)  # every matcher of an engine shares its compiler's counters
    counters.seconds += time.perf_counter() - start
    return logits


def _first_line(error: str) -> str:
    """llguidance's errors carry the parser's state after their first line."""
    return error.split("\n<state>", 1)[0].strip()


def _grammar_text(params: StructuredOutputsParams) -> str:
    matcher_cls = _import_llguidance().LLMatcher
    kind, text = params.key
    if kind in ("json", "json_object"):
        try:
            return matcher_cls.grammar_from_json_schema(params.json_schema(), defaults=params.json_options())
        except ValueError as exc:
            raise ValueError(f"structured_outputs json is not a JSON schema: {exc}") from None
    if kind == "regex":
        return matcher_cls.grammar_from_regex(text)
    if kind == "choice":
        return matcher_cls.grammar_from_regex("|".join(_regex_literal(c) for c in params.choice or ()))
    if kind == "structural_tag":  # vLLM's guidance backend's reading: each structure a tag of its first trigger
        struct_tag = _import_llguidance().StructTag
        tag = json.loads(text)
        tags = [
            struct_tag(
                trigger=next(t for t in tag["triggers"] if structure["begin"].startswith(t)),
                begin=structure["begin"],
                grammar=structure.get("schema") or {"type": "object"},
                end=structure["end"],
            )
            for structure in tag["structures"]
        ]
        return struct_tag.to_grammar(tags)
    if _EBNF_RULE.search(text):  # vLLM's examples' EBNF (GBNF: `name ::= ...`), which llguidance converts to Lark
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # its parser's own error types
            raise ValueError(f"structured_outputs grammar is not EBNF (name ::= ...) it can read: {exc}") from None
    return matcher_cls.grammar_from_lark(text)


def _regex_literal(text: str) -> str:
    """`text` matched literally by llguidance's regex (Rust regex syntax: punctuation escapes are allowed)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}/#&~-])", r"\\\1", text)


def _import_llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ImportError(
            "structured outputs need llguidance: pip install 'hybridkv[structured]' (or pip install llguidance)"
        ) from None
    return llguidance
