"""The `compile` setting on the CPU: hybridkv's compiled forward (hybridkv/execution/compilation.py) against eager.

On `benchmarks/throughput.py`'s models and mixed workload (greedy, fp32): for eager and compiled engines, in
turn, the time `patch` takes (the compiled one traces and compiles its forward there, in an empty cache
directory: cold), then --repeats timed generates: their wall time, the median decode step (model forward only)
and host work per step, and how many requests' tokens equal transformers' `generate` (inductor may sum in
another order than eager: a near tie can flip a greedy token; reported, not hidden). Then the compiled engine
is patched again from the disk cache (warm). The last line per model is what decides `compile=None` on the
CPU: how many such generates the compiled forward must serve before its set-up (cold, and warm) is paid back.

    python benchmarks/compile_cpu.py [--models hybrid,llama] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import hybridkv
from hybridkv import SamplingParams

from throughput import hybrid_model, llama_model, matches, run_generate, workload


def run(model, prompts, max_new, compile_forward: bool, repeats: int) -> dict[str, object]:
    start = time.perf_counter()
    llm = hybridkv.patch(model, max_model_len=8192, compile=compile_forward, use_tqdm=False)
    patch_seconds = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=max_new)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    first_seconds = time.perf_counter() - start
    runs, tokens, steps = [], [], []
    for _ in range(repeats):
        before = llm.stats()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(time.perf_counter() - start)
        after = llm.stats()
        num_steps = after["num_steps"] - before["num_steps"]
        steps.append(
            (
                (after["forward_seconds"] - before["forward_seconds"]) / num_steps * 1e3,
                (after["overhead_seconds"] - before["overhead_seconds"]) / num_steps * 1e3,
            )
        )
        tokens.append([o.outputs[0].token_ids for o in outputs])
    hybridkv.unpatch(model)
    return {
        "patch": patch_seconds,
        "first": first_seconds,
        "generate": statistics.median(runs),
        "forward_ms": statistics.median(s[0] for s in steps),
        "host_ms": statistics.median(s[1] for s in steps),
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="hybrid,llama")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="hybridkv-compile-cpu-")  # cold (inductor's caches too), then warm
    os.environ["HYBRIDKV_CACHE_DIR"] = cache
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, mixed workload (32 prompts of 20-300 tokens, 64 new)")
    for name in args.models.split(","):
        model = {"hybrid": hybrid_model, "llama": llama_model}[name]()
        prompts, max_new = workload("mixed")
        _, reference = run_generate(model, prompts, max_new)
        results = {
            mode: run(model, prompts, max_new, mode == "compiled", args.repeats) for mode in ("eager", "compiled")
        }
        for mode, result in results.items():
            print(
                f"{name:<7}{mode:<9} patch {result['patch']:6.2f} s, first generate {result['first']:6.2f} s, "
                f"generate {result['generate']:6.2f} s (median), step: forward {result['forward_ms']:6.2f} ms + host "
                f"{result['host_ms']:.2f} ms; tokens equal to generate's {matches(result['tokens'], reference)}"
            )
        eager, compiled = results["eager"], results["compiled"]
        warm = {}
        for compile_forward in (False, True):  # both patched a second time in this process: like for like
            start = time.perf_counter()
            hybridkv.patch(model, max_model_len=8192, compile=compile_forward, use_tqdm=False)
            warm[compile_forward] = time.perf_counter() - start
            hybridkv.unpatch(model)
        saved = eager["generate"] - compiled["generate"]
        cold_cost = compiled["patch"] + compiled["first"] - eager["patch"] - eager["first"]
        warm_cost = warm[True] - warm[False]
        payback = (
            f"pays back after {cold_cost / saved:.0f} such generates cold, {warm_cost / saved:.0f} warm"
            if saved > 0
            else "never pays back (no generate is faster)"
        )
        print(
            f"  compiled vs eager: generate {eager['generate'] / compiled['generate']:.2f}x, decode forward "
            f"{eager['forward_ms'] / compiled['forward_ms']:.2f}x; set-up {cold_cost:.1f} s cold, {warm_cost:.1f} s "
            f"warm (patched again from the disk cache); {payback}"
        )


if __name__ == "__main__":
    main()
