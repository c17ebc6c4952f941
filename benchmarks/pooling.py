"""Embedding prompts through `LLM(model=path, runner="pooling").embed` against transformers' own forward.

vLLM's pooling calls (hybridkv/engine/pooling.py) run the model's forward in right-padded batches sorted by length. The
peers, same model, same prompts, the same last-token pooling and normalization, each timed from loaded weights:
- `hf_each`: transformers' forward one prompt at a time (exact, no padding);
- `hf_padded`: transformers' forward over the prompts in arrival order, padded to the longest of each batch of
  `--batch` (a plain batched loop);
- `hf_padded sorted`: the same over the prompts sorted by length (as sentence-transformers' `encode` batches).
Prints the seconds of each (median of `--repeats`), the ratios against hybridkv, and the largest difference between
hybridkv's embeddings and `hf_each`'s.

    python benchmarks/pooling.py [--family llama] [--prompts 256] [--batch 32] [--repeats 3] [--threads 1]
        [--hidden 512 --layers 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from transformers import AutoModel

from hybridkv import LLM
from hybridkv.tiny import tiny_model


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of 8 to 512 tokens, lengths drawn log-uniformly (short queries and long documents)."""
    rng = random.Random(seed)
    lengths = [int(8 * 64 ** rng.random()) for _ in range(count)]
    return [[rng.randrange(1, vocab) for _ in range(length)] for length in lengths]


def word_tokenizer(path: str, size: int = 256) -> object:
    """A word-level tokenizer of `size` words ("w0" ...), saved to `path` (the prompts are token ids: the checkpoint
    needs a tokenizer, not a trained one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0")
    tokenizer.save_pretrained(path)
    return tokenizer


def hf_each(model: torch.nn.Module, batch: list[list[int]]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [
            F.normalize(
                model(input_ids=torch.tensor([ids], device=model.device)).last_hidden_state[0, -1], dim=-1
            ).cpu()
            for ids in batch
        ]


def hf_padded(model: torch.nn.Module, batch: list[list[int]], size: int) -> list[torch.Tensor]:
    out = []
    with torch.inference_mode():
        for start in range(0, len(batch), size):
            chunk = batch[start : start + size]
            longest = max(map(len, chunk))
            tokens = torch.zeros(len(chunk), longest, dtype=torch.long)
            mask = torch.zeros_like(tokens)
            for row, ids in enumerate(chunk):
                tokens[row, : len(ids)] = torch.tensor(ids)
                mask[row, : len(ids)] = 1
            hidden = model(input_ids=tokens.to(model.device), attention_mask=mask.to(model.device)).last_hidden_state
            out += [F.normalize(hidden[row, len(ids) - 1], dim=-1).cpu() for row, ids in enumerate(chunk)]
    return out


def timed(function, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = function()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama", help="a hybridkv.tiny family (its config, random weights)")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="hf_padded's batch size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="hybridkv's batch budget")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=0, help="hidden size (0: the tiny family's own)")
    parser.add_argument("--layers", type=int, default=4, help="layers, with --hidden")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as path:
        tokenizer = word_tokenizer(path)
        shape = {}
        if args.hidden:
            shape = {"hidden_size": args.hidden, "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers}
        model = tiny_model(args.family, vocab_size=len(tokenizer), max_position_embeddings=1024, **shape)
        model.save_pretrained(path)
        batch = prompts(args.prompts, len(tokenizer))
        budget = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
        llm = LLM(model=path, runner="pooling", dtype="float32", **budget)  # on the GPU when there is one
        assert llm.model.device.type == torch.device(args.device).type, "LLM() loads to the GPU where there is one"
        model = AutoModel.from_pretrained(path, dtype=torch.float32).eval().to(args.device)
        token_prompts = [{"prompt_token_ids": ids} for ids in batch]
        ours_s, ours = timed(lambda: llm.embed(token_prompts, use_tqdm=False), args.repeats)
        each_s, each = timed(lambda: hf_each(model, batch), args.repeats)
        padded_s, _ = timed(lambda: hf_padded(model, batch, args.batch), args.repeats)
        by_length = sorted(batch, key=len)
        sorted_s, _ = timed(lambda: hf_padded(model, by_length, args.batch), args.repeats)
    difference = max(
        float((torch.tensor(o.outputs.embedding) - e).abs().max()) for o, e in zip(ours, each, strict=True)
    )
    tokens = sum(map(len, batch))
    shape = f"hidden {args.hidden}, {args.layers} layers" if args.hidden else "hybridkv.tiny's shape"
    print(f"{args.family} ({shape}) on {args.device}, {args.prompts} prompts, {tokens:,} tokens, "
          f"{args.threads} thread(s), median of {args.repeats}")  # fmt: skip
    print(f"  hybridkv embed         {ours_s:7.3f} s  ({tokens / ours_s:,.0f} tok/s)")
    print(f"  hf_each                {each_s:7.3f} s  hybridkv is {each_s / ours_s:.2f}x")
    print(f"  hf_padded ({args.batch:>3})        {padded_s:7.3f} s  hybridkv is {padded_s / ours_s:.2f}x")
    print(f"  hf_padded sorted ({args.batch:>3}) {sorted_s:7.3f} s  hybridkv is {sorted_s / ours_s:.2f}x")
    print(f"  largest difference from hf_each: {difference:.2e}")


if __name__ == "__main__":
    main()
