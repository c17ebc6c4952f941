"""Prefix caching on models with state layers: a shared 1,024-token system prompt, hit through state checkpoints.

32 requests of a 1,024-token system prompt and 16-64 tokens of their own (seeded), 16 new tokens each, greedy,
fp32, on the CPU, all submitted at once; models as in benchmarks/state_layers.py (Qwen3.5-style: Gated DeltaNet
and full attention; Nemotron-H-style: Mamba2, MLP and full attention). A hit on such a model must restore the
state at its end: hybridkv keeps states at multiples of `stats()["state_checkpoint_interval"]` tokens
(hybridkv/memory/state_slots.py). Printed per model: the share of the system prompt's tokens that requests skipped
(cached tokens over 32 x 1,024), the same on a second run of the same prompts, whether both runs' tokens equal
hybridkv's without prefix caching and transformers' `generate` one request at a time (the first 4 requests),
the checkpoints' interval, memory and how many are kept, and the time against hybridkv without prefix caching
(median of --repeats runs each, alternated).

    python benchmarks/state_prefix_cache.py [--models qwen3_5,nemotron_h] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from state_layers import MODELS, VOCAB

import hybridkv
from hybridkv import SamplingParams

SYSTEM, REQUESTS, MAX_NEW = 1024, 32, 16


def workload() -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(1, VOCAB) for _ in range(SYSTEM)]
    return [system + [rng.randrange(1, VOCAB) for _ in range(rng.randint(16, 64))] for _ in range(REQUESTS)]


def run(model, prompts, caching: bool, runs: int = 1):
    """`runs` passes over the prompts on one engine: seconds, tokens and cached tokens of each, and its stats."""
    llm = hybridkv.patch(model, max_model_len=2048, enable_prefix_caching=caching)
    passes = []
    for _ in range(runs):
        start = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in outputs]
        passes.append((seconds, tokens, [o.metrics.num_cached_tokens for o in outputs]))
    stats = llm.stats()
    hybridkv.unpatch(model)
    return passes, stats


def row(name: str, repeats: int) -> None:
    model = MODELS[name]()
    prompts = workload()
    timings: dict[bool, list[float]] = {True: [], False: []}
    for round_index in range(repeats):
        for caching in (True, False) if round_index % 2 == 0 else (False, True):
            passes, _ = run(model, prompts, caching)
            timings[caching].append(passes[0][0])
    (cold, warm), stats = run(model, prompts, True, runs=2)
    ((_, plain, _),), _ = run(model, prompts, False)
    with torch.inference_mode():
        reference = [
            model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts[:4]
        ]
    skipped = [sum(cached) / (REQUESTS * SYSTEM) for _, _, cached in (cold, warm)]
    same = cold[1] == plain and warm[1] == plain and plain[:4] == reference
    with_s, without_s = statistics.median(timings[True]), statistics.median(timings[False])
    print(
        f"{name:<11}{skipped[0]:>9.1%}{skipped[1]:>9.1%}{'yes' if same else 'NO':>8}"
        f"{stats['state_checkpoint_interval']:>10}{stats['state_checkpoints_kept']:>6}/{stats['state_checkpoints']:<4}"
        f"{stats['state_checkpoint_bytes'] / 2**20:>9.1f}{stats['state_bytes_per_request'] / 1024:>10.1f}"
        f"{without_s / with_s:>10.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3_5,nemotron_h")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads; {REQUESTS} requests, {SYSTEM}-token system prompt")
    print(
        f"{'model':<11}{'skipped':>9}{'again':>9}{'same':>8}{'interval':>10}{'kept/slots':>11}{'ckpt MiB':>9}"
        f"{'state KiB':>10}{'speed-up':>11}"
    )
    for name in args.models.split(","):
        row(name, args.repeats)


if __name__ == "__main__":
    main()
