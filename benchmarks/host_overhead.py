"""Host work per engine step: what hybridkv spends outside the model's forward.

hybridkv alone on `benchmarks/throughput.py`'s hybrid model and its mixed and shared-prefix workloads,
greedy, repeated; prints the median per step of the host time (scheduling, inputs and metadata,
sampling, update) with its parts, the forward's time and the share, and the host time per decode step
alone (a step whose every row is a sequence's one new token: the prefill chunks' steps, which allocate and
hash whole prompts, are left out of that figure). Machine speed drifts on shared
cores, so compare two versions by running them back to back, alternated, several times: install the
other version to a folder (`pip install --no-deps --target DIR <checkout>`) and run this script with
`PYTHONPATH=DIR` (the model comes from `hybridkv.tiny`, present since the engine-step refactor).

`--model qwen3_5` or `nemotron_h` runs benchmarks/state_layers.py's models with state layers instead (their
state checkpoints' planning is host work too: compare with `--no-prefix-caching`).

    python benchmarks/host_overhead.py [--threads 1] [--repeats 4] [--model hybrid] [--no-prefix-caching]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import hybridkv
from hybridkv import SamplingParams

from throughput import hybrid_model, workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--model", default="hybrid", choices=["hybrid", "qwen3_5", "nemotron_h"])
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model == "hybrid":
        model = hybrid_model()
    else:
        from state_layers import MODELS

        model = MODELS[args.model]()
    print(f"torch {torch.__version__}, {args.threads} threads; median of {args.repeats - 1} runs after a warm-up")
    for name in ("mixed", "shared"):
        prompts, max_new = workload(name)
        runs = []
        for _ in range(args.repeats):
            llm = hybridkv.patch(model, max_model_len=8192, enable_prefix_caching=args.prefix_caching)
            decode_host, decode_steps = run_steps(llm, prompts, SamplingParams(temperature=0, max_tokens=max_new))
            stats = llm.stats()
            hybridkv.unpatch(model)
            steps = stats["num_steps"]
            runs.append(
                [
                    stats[key] / steps * 1e3
                    for key in (
                        "overhead_seconds",
                        "schedule_seconds",
                        "prepare_seconds",
                        "update_seconds",
                        "forward_seconds",
                    )
                ]
                + [decode_host / decode_steps * 1e3]
            )
        host, schedule, prepare, update, forward, decode = (
            statistics.median(column) for column in zip(*runs[1:], strict=True)
        )
        print(
            f"{name:<7} host {host:.3f} ms/step (schedule {schedule:.3f}, inputs+metadata {prepare:.3f}, update "
            f"{update:.3f}, sampling and the rest {host - schedule - prepare - update:.3f}); forward {forward:.2f} ms; "
            f"host / forward {host / forward:.1%}; {steps} steps; host per decode step {decode:.3f} ms "
            f"({decode_steps} decode steps)"
        )


def run_steps(llm, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """Run the prompts to the end step by step (as `generate` does); returns the host seconds of the decode steps
    (every row one new token) and their number, read from the engine's counters around each step."""
    for prompt in prompts:
        llm.add_request(prompt, params)
    runner = llm.runner
    decode_host, decode_steps = 0.0, 0
    while llm.has_unfinished_requests():
        before = (llm.step_seconds, runner.forward_seconds, llm.num_forward_tokens, llm.num_generated_tokens)
        llm.step()
        step, forward, computed, sampled = (
            now - then
            for now, then in zip(
                (llm.step_seconds, runner.forward_seconds, llm.num_forward_tokens, llm.num_generated_tokens),
                before,
                strict=True,
            )
        )
        if computed and computed == sampled:
            decode_host += step - forward
            decode_steps += 1
    return decode_host, decode_steps


if __name__ == "__main__":
    main()
