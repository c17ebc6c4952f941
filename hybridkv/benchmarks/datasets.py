"""vLLM's `vllm.benchmarks.datasets` path, for the scripts that draw their prompts from it (vLLM's
examples/offline_inference/spec_decode.py): `add_dataset_parser(parser)` adds vLLM's dataset flags, `get_samples(args,
tokenizer)` returns `SampleRequest`s.

Datasets read here, with vLLM's flags and defaults: `random` (token ids drawn at random, decoded to text:
`--random-input-len`, `--random-output-len`, `--random-range-ratio`, `--random-prefix-len`), `custom` (a local JSON
Lines file with a "prompt" field, put in the chat template unless `--skip-chat-template`: `--custom-output-len`, -1 for
each line's "output_tokens"), `sharegpt` (a local ShareGPT JSON file: each conversation's first turn is the prompt, its
second the expected output's length unless `--sharegpt-output-len`) and `prefix_repetition` (prompts over a few
shared prefixes). Nothing is downloaded: vLLM's hub datasets (`hf`, `sonnet`, `burstgpt`, ...) are refused with the
datasets that run here.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# vLLM's --dataset-name choices; those not in `_SAMPLERS` are refused by get_samples.
DATASET_NAMES = (
    "sharegpt", "burstgpt", "sonnet", "random", "random-mm", "random-rerank", "hf", "custom", "custom_mm",
    "prefix_repetition", "spec_bench",
)  # fmt: skip


@dataclass
class SampleRequest:
    """One prompt of a dataset (vLLM's): its text, its length in tokens and the output length it asks for."""

    prompt: str | list[str]
    prompt_len: int
    expected_output_len: int
    multi_modal_data: dict[str, Any] | list[dict[str, Any]] | None = None
    lora_request: Any = None
    request_id: str | None = None


def add_dataset_parser(parser: argparse.ArgumentParser) -> None:
    """vLLM's dataset flags, with its defaults (the module docstring says which datasets run here)."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=1000, help="Number of prompts to process.")
    parser.add_argument("--dataset-name", type=str, default="random", choices=DATASET_NAMES)
    parser.add_argument("--no-stream", action="store_true", help="Accepted as vLLM's; local files are read whole.")
    parser.add_argument("--dataset-path", type=str, default=None, help="A local file (custom, sharegpt).")
    parser.add_argument("--no-oversample", action="store_true")
    parser.add_argument("--skip-chat-template", action="store_true")
    parser.add_argument("--enable-multimodal-chat", action="store_true")
    parser.add_argument("--disable-shuffle", action="store_true")
    custom = parser.add_argument_group("custom dataset options")
    custom.add_argument("--custom-output-len", type=int, default=256)
    sharegpt = parser.add_argument_group("sharegpt dataset options")
    sharegpt.add_argument("--sharegpt-output-len", type=int, default=None)
    rand = parser.add_argument_group("random dataset options")
    rand.add_argument("--random-input-len", type=int, default=1024)
    rand.add_argument("--random-output-len", type=int, default=128)
    rand.add_argument("--random-range-ratio", type=float, default=0.0)
    rand.add_argument("--random-prefix-len", type=int, default=0)
    repetition = parser.add_argument_group("prefix repetition dataset options")
    repetition.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    repetition.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    repetition.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    repetition.add_argument("--prefix-repetition-output-len", type=int, default=128)


def get_samples(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    """`args.num_prompts` samples of the dataset `args.dataset_name` names (the flags of `add_dataset_parser`)."""
    sampler = _SAMPLERS.get(args.dataset_name)
    if sampler is None:
        raise ValueError(
            f"--dataset-name {args.dataset_name} is not read by hybridkv (nothing is downloaded here); use one of "
            f"{sorted(_SAMPLERS)}: e.g. --dataset-name custom --dataset-path prompts.jsonl (one JSON object a line "
            'with a "prompt" field)'
        )
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    rng = random.Random(args.seed)
    samples = sampler(args, tokenizer, rng)
    prefix = getattr(args, "request_id_prefix", "")
    for index, sample in enumerate(samples):
        sample.request_id = f"{prefix}{index}"
    return samples


def _random(args: argparse.Namespace, tokenizer: Any, rng: random.Random) -> list[SampleRequest]:
    """Prompts of drawn token ids (no special token), decoded to text: a shared prefix of `--random-prefix-len` ids,
    then `--random-input-len` more, the lengths drawn from [len * (1 - ratio), len * (1 + ratio)]."""
    ratio = args.random_range_ratio
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    vocab = _vocab(tokenizer)
    prefix = _drawn_text(tokenizer, vocab, args.random_prefix_len, rng)

    def drawn(length: int) -> int:
        return rng.randint(int(length * (1 - ratio)), int(length * (1 + ratio)))

    samples = []
    for _ in range(args.num_prompts):
        prompt = prefix + _drawn_text(tokenizer, vocab, max(1, drawn(args.random_input_len)), rng)
        samples.append(SampleRequest(prompt, _length(tokenizer, prompt), max(1, drawn(args.random_output_len))))
    return samples


def _vocab(tokenizer: Any) -> list[int]:
    """The token ids a drawn prompt takes: all but the special ones."""
    special = set(tokenizer.all_special_ids)
    return [token for token in range(len(tokenizer)) if token not in special]


def _drawn_text(tokenizer: Any, vocab: list[int], length: int, rng: random.Random, tries: int = 10) -> str:
    """Text of `length` drawn token ids (no special token) that encodes to about `length` tokens: drawn ids rarely
    decode to text that encodes back to themselves, so the text's ids are cut, or drawn ids added, and decoded again
    until the lengths agree (vLLM's way), at most `tries` times."""
    if length < 1:
        return ""
    text = tokenizer.decode([rng.choice(vocab) for _ in range(length)])
    for _ in range(tries):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            break
        text = tokenizer.decode(ids[:length] + [rng.choice(vocab) for _ in range(length - len(ids))])
    return text


def _custom(args: argparse.Namespace, tokenizer: Any, rng: random.Random) -> list[SampleRequest]:
    """Each line of a JSON Lines file: its "prompt" in the tokenizer's chat template (unless --skip-chat-template)."""
    rows = [json.loads(line) for line in _local_file(args).read_text().splitlines() if line.strip()]
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f'{args.dataset_path}, line {number}: a custom dataset line is an object with a "prompt"')
    samples = []
    for row in _ordered(args, rows, rng):
        prompt = row["prompt"]
        if not args.skip_chat_template:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
        output_len = args.custom_output_len if args.custom_output_len != -1 else row.get("output_tokens")
        if not isinstance(output_len, int) or output_len < 1:
            raise ValueError(
                f'{args.dataset_path}: with --custom-output-len -1 each line needs "output_tokens" (a positive int)'
            )
        samples.append(SampleRequest(prompt, _length(tokenizer, prompt), output_len))
    return _oversampled(args, samples, rng)


def _sharegpt(args: argparse.Namespace, tokenizer: Any, rng: random.Random) -> list[SampleRequest]:
    """ShareGPT conversations (a JSON list of {"conversations": [{"value": ...}, ...]}): the first turn is the prompt,
    the second's length in tokens the output length (unless --sharegpt-output-len)."""
    data = json.loads(_local_file(args).read_text())
    rows = [row for row in data if len(row.get("conversations", [])) >= 2]
    samples = []
    for row in _ordered(args, rows, rng):
        prompt, completion = row["conversations"][0]["value"], row["conversations"][1]["value"]
        output_len = args.sharegpt_output_len or _length(tokenizer, completion)
        if output_len >= 1:
            samples.append(SampleRequest(prompt, _length(tokenizer, prompt), output_len))
    return _oversampled(args, samples, rng)


def _prefix_repetition(args: argparse.Namespace, tokenizer: Any, rng: random.Random) -> list[SampleRequest]:
    """`--prefix-repetition-num-prefixes` drawn prefixes, each shared by an equal share of the prompts, each prompt
    ending in a suffix of its own (drawn token ids, decoded to text)."""
    vocab, num_prefixes = _vocab(tokenizer), max(1, args.prefix_repetition_num_prefixes)
    prefixes = [_drawn_text(tokenizer, vocab, args.prefix_repetition_prefix_len, rng) for _ in range(num_prefixes)]
    samples = []
    for index in range(args.num_prompts):
        suffix = _drawn_text(tokenizer, vocab, args.prefix_repetition_suffix_len, rng)
        prompt = prefixes[index % num_prefixes] + suffix
        samples.append(SampleRequest(prompt, _length(tokenizer, prompt), args.prefix_repetition_output_len))
    if not args.disable_shuffle:
        rng.shuffle(samples)
    return samples


_SAMPLERS = {"random": _random, "custom": _custom, "sharegpt": _sharegpt, "prefix_repetition": _prefix_repetition}


def _local_file(args: argparse.Namespace) -> Path:
    if args.dataset_path is None:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path, a local file")
    path = Path(args.dataset_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"--dataset-path {args.dataset_path} is not a local file (hybridkv downloads no dataset; save it first)"
        )
    return path


def _ordered(args: argparse.Namespace, rows: list[Any], rng: random.Random) -> list[Any]:
    """The rows shuffled (vLLM's default) unless --disable-shuffle, at most --num-prompts of them."""
    rows = list(rows)
    if not args.disable_shuffle:
        rng.shuffle(rows)
    return rows[: args.num_prompts]


def _oversampled(args: argparse.Namespace, samples: list[SampleRequest], rng: random.Random) -> list[SampleRequest]:
    """Fewer samples than --num-prompts are repeated (drawn again) up to it, as vLLM does, unless --no-oversample."""
    if not samples:
        raise ValueError(f"{args.dataset_path} holds no usable sample")
    if len(samples) < args.num_prompts and not args.no_oversample:
        samples += [
            SampleRequest(s.prompt, s.prompt_len, s.expected_output_len)
            for s in rng.choices(samples, k=args.num_prompts - len(samples))
        ]
    return samples


def _length(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text).input_ids)


__all__ = ["SampleRequest", "add_dataset_parser", "get_samples"]
