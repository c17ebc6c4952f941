"""The `compile` setting on the CPU: hybridkv's forward under torch.compile (inductor) against eager.

On `benchmarks/throughput.py`'s models and mixed workload (greedy, fp32): for eager and compiled engines,
in turn, the time `patch` takes (the compiled one compiles its forward at patch time), the first
generate (compiled code may still specialise: a single row, a single logits row), then --repeats
timed generates: their wall time, the median decode step (model forward only) and host work per step,
and how many requests' tokens equal transformers' `generate` (inductor may sum in another order than
eager: a near tie can flip a greedy token; reported, not hidden).

    python benchmarks/compile_cpu.py [--models hybrid,llama] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hybridkv
from hybridkv import SamplingParams

from throughput import hybrid_model, llama_model, matches, run_generate, workload


def run(model, prompts, max_new, compile_forward: bool, repeats: int) -> dict[str, object]:
    start = time.perf_counter()
    llm = hybridkv.patch(model, max_model_len=8192, compile=compile_forward)
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
        print(
            f"  compiled vs eager: generate {eager['generate'] / compiled['generate']:.2f}x, decode forward "
            f"{eager['forward_ms'] / compiled['forward_ms']:.2f}x; compile cost "
            f"{compiled['patch'] - eager['patch']:.1f} s at patch + {compiled['first'] - eager['first']:.1f} s in the "
            "first generate"
        )


if __name__ == "__main__":
    main()
