"""Which grammar library constrains hybridkv's structured outputs: xgrammar or llguidance, by measurement.

For a JSON schema, a regex and a choice list, on byte-level BPE vocabularies of 32k and 262k tokens
(trained here on the Python sources installed beside this interpreter: no download), it times each
library's grammar compilation and its per-token mask: a matcher walks a valid output token by token,
filling the next-token bitmask before each token, as the sampler does. Prints the medians in
microseconds and the ratio llguidance / xgrammar (below 1: llguidance is faster).

    python benchmarks/grammar_backends.py [--vocab 32000,262144] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

CACHE = Path(os.environ.get("HYBRIDKV_BENCH_CACHE", Path.home() / ".cache" / "hybridkv-bench"))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
SCHEMA_OUTPUT = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "email": "ada@example.org",
        "tags": ["math", "engines", "poetry"],
        "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
        "active": True,
    },
    separators=(", ", ": "),
)
REGEX = r"(\+1 )?\(?[0-9]{3}\)?[ -][0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"
REGEX_OUTPUT = "+1 (415) 555-0132 ext. 204"
CHOICES = ["positive", "negative", "neutral", "mixed feelings", "not applicable"]
CHOICE_OUTPUT = "mixed feelings"


def corpus(limit_bytes: int) -> list[str]:
    """Python sources of the standard library and site-packages, in path order, up to limit_bytes."""
    texts, size = [], 0
    for root in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]):
        for path in sorted(Path(root).rglob("*.py")):
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            texts.append(text)
            size += len(text)
            if size >= limit_bytes:
                return texts
    return texts


def bpe_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of about vocab_size tokens (hybridkv.serving.cli's trainer), trained once and
    cached."""
    from transformers import PreTrainedTokenizerFast

    from hybridkv.serving.cli import tiny_tokenizer

    path = CACHE / f"bpe-{vocab_size}.json"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tiny_tokenizer(corpus(8 * vocab_size * 40), vocab_size=vocab_size).backend_tokenizer.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<eos>")


def median_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.vocab = len(tokenizer)
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, self.vocab)

    def compile(self, kind: str, spec):
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(spec))
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_regex("(" + "|".join(_escape(c) for c in spec) + ")")

    def walk(self, compiled, token_ids: list[int]) -> list[float]:
        matcher = self.xgr.GrammarMatcher(compiled)
        times = []
        for token in token_ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(self.bitmask, 0)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(token), token
        return times


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.llg_torch = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, self.tokenizer.vocab_size)

    def compile(self, kind: str, spec):
        matcher_cls = self.llg.LLMatcher
        if kind == "json":
            grammar = matcher_cls.grammar_from_json_schema(json.dumps(spec))
        elif kind == "regex":
            grammar = matcher_cls.grammar_from_regex(spec)
        else:
            grammar = matcher_cls.grammar_from_regex("(" + "|".join(_escape(c) for c in spec) + ")")
        matcher = matcher_cls(self.tokenizer, grammar)  # llguidance's compilation happens here
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def walk(self, grammar, token_ids: list[int]) -> list[float]:
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        times = []
        for token in token_ids:
            start = time.perf_counter()
            self.llg_torch.fill_next_token_bitmask(matcher, self.bitmask, 0)
            times.append(time.perf_counter() - start)
            assert matcher.consume_token(token), (token, matcher.get_error())
        return times


def _escape(text: str) -> str:
    """A literal in a regex both libraries read (re.escape's escaped spaces warn in xgrammar)."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", default="32000,262144")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}; medians of {args.repeats} runs, microseconds")
    cases = [("json", SCHEMA, SCHEMA_OUTPUT), ("regex", REGEX, REGEX_OUTPUT), ("choice", CHOICES, CHOICE_OUTPUT)]
    for vocab_size in (int(v) for v in args.vocab.split(",")):
        start = time.perf_counter()
        tokenizer = bpe_tokenizer(vocab_size)
        print(f"\nvocabulary {len(tokenizer)} tokens (tokenizer ready in {time.perf_counter() - start:.1f} s)")
        backends = []
        for cls in (Xgrammar, Llguidance):
            start = time.perf_counter()
            backends.append(cls(tokenizer))
            print(f"  {cls.name}: tokenizer set-up {time.perf_counter() - start:.2f} s")
        print(f"  {'case':8s} {'backend':11s} {'compile':>10s} {'mask/token':>11s} {'max mask':>10s}")
        for kind, spec, output in cases:
            token_ids = tokenizer.encode(output, add_special_tokens=False)
            rows = {}
            for backend in backends:
                compile_times, mask_times, max_times = [], [], []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    compiled = backend.compile(kind, spec)
                    compile_times.append(time.perf_counter() - start)
                    walk = backend.walk(compiled, token_ids)
                    mask_times.append(statistics.mean(walk))
                    max_times.append(max(walk))
                rows[backend.name] = (median_us(compile_times), median_us(mask_times), median_us(max_times))
                c, m, x = rows[backend.name]
                print(f"  {kind:8s} {backend.name:11s} {c:10.0f} {m:11.1f} {x:10.0f}")
            (xc, xm, _), (lc, lm, _) = rows["xgrammar"], rows["llguidance"]
            print(f"  {kind:8s} llguidance/xgrammar: compile {lc / xc:.2f}x, mask per token {lm / xm:.2f}x")


if __name__ == "__main__":
    main()
