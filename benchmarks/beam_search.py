"""Beam search throughput: hybridkv's in-engine beam search vs transformers' `generate(num_beams=...)`.

One run, same model and prompts for both, fp32 on the CPU, no EOS (every beam runs to max_new):
  16 prompts of 20-200 tokens (seeded), beam width 4, 32 new tokens.
transformers runs one left-padded batch (its fastest way; its continuous batching, `generate_batch`,
ignores num_beams); hybridkv runs every search in one continuous batch. Models: the Gemma-3-style
hybrid and the Llama-style model of benchmarks/throughput.py. Prints searches/s, the ratio, how many
searches return the same best sequence as transformers, and hybridkv's peak KV blocks against what the
same requests would hold as 4 independent greedy requests each.

    python benchmarks/beam_search.py [--models hybrid,llama] [--prompts 16] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import hybridkv
from hybridkv import BeamSearchParams

from throughput import hybrid_model, left_padded, llama_model

VOCAB = 32_000
BEAMS = 4
MAX_NEW = 32


def workload(count: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(20, 200))] for _ in range(count)]


def run_generate(model, prompts) -> tuple[float, list[list[int]]]:
    """transformers' beam search on one left-padded batch: per prompt, its best sequence's new tokens."""
    ids, mask, width = left_padded(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            num_beams=BEAMS,
            num_return_sequences=BEAMS,
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=None,
            pad_token_id=0,
        )
    seconds = time.perf_counter() - start
    return seconds, [out[i * BEAMS, width:].tolist() for i in range(len(prompts))]


def run_hybridkv(model, prompts) -> tuple[float, list[list[int]], dict]:
    llm = hybridkv.patch(model, max_model_len=1024)
    params = BeamSearchParams(beam_width=BEAMS, max_tokens=MAX_NEW)
    start = time.perf_counter()
    outputs = llm.beam_search(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    hybridkv.unpatch(model)
    return seconds, [o.sequences[0].output_token_ids for o in outputs], stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="hybrid,llama")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = workload(args.prompts)
    print(
        f"torch {torch.__version__}, {args.threads} threads; {len(prompts)} prompts of 20-200 tokens, "
        f"beam width {BEAMS}, {MAX_NEW} new tokens, no EOS"
    )
    print(f"{'model':<8}{'generate':>12}{'hybridkv':>12}{'vs gen':>9}{'same best':>11}{'max running':>13}")
    builders = {"hybrid": hybrid_model, "llama": llama_model}
    for name in args.models.split(","):
        model = builders[name]()
        model.generation_config.eos_token_id = None
        gen_s, reference = run_generate(model, prompts)
        ours_s, ours, stats = run_hybridkv(model, prompts)
        same = sum(a == b for a, b in zip(ours, reference, strict=True))
        print(
            f"{name:<8}{len(prompts) / gen_s:>10.2f}/s{len(prompts) / ours_s:>10.2f}/s{gen_s / ours_s:>8.2f}x"
            f"{same:>8}/{len(prompts)}{stats['max_num_running']:>8} seqs"
        )
    print("searches/s = prompts / wall seconds; same best = searches whose best sequence equals transformers'")


if __name__ == "__main__":
    main()
