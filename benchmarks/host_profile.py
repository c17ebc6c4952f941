"""Where a decode step's host work goes, sampled inside real runs (not in a loop, where code and data stay cached).

`benchmarks/host_overhead.py` times host work per step with its forward between steps; this script says which
functions it is spent in. It runs `host_overhead.py`'s workload (tiny hybrid model, mixed prompts, greedy, one
thread) `--runs` times, every decode-only step (each running request one new token, none waiting) called from
`decode_step_marker`, under a sampling profiler started from outside: py-spy (not a dependency of hybridkv:
`pip install py-spy`) writes its raw stacks, and `--aggregate` prints each function's share of the samples
inside decode steps' `LLMEngine._step` but outside the model's forward (`ModelRunner._forward` and what it
calls), inclusive (with what it calls) and own.

    py-spy record -r 1000 -f raw -o /tmp/stacks.txt -- python benchmarks/host_profile.py --runs 12
    python benchmarks/host_profile.py --aggregate /tmp/stacks.txt [--top 40]

`--every-step` aggregates every engine step of any recorded script, the forward's launch included: on a GPU that
is host work too (`py-spy record ... -- python benchmarks/profile_gpu_step.py --steps-only`, gpu_check.sh).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

import hybridkv
from hybridkv import SamplingParams

from throughput import hybrid_model, workload


def decode_step_marker(llm) -> None:
    llm.step()


def other_step(llm) -> None:
    llm.step()


def run(runs: int) -> None:
    torch.set_num_threads(1)
    model = hybrid_model()
    prompts, max_new = workload("mixed")
    for _ in range(runs):
        llm = hybridkv.patch(model, max_model_len=8192, enable_prefix_caching=True)
        for index, prompt in enumerate(prompts):
            llm.add_request(str(index), prompt, SamplingParams(temperature=0, max_tokens=max_new))
        scheduler = llm.core.scheduler
        while llm.has_unfinished_requests():
            decode = not scheduler.waiting and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running
            )
            (decode_step_marker if decode else other_step)(llm)
        hybridkv.unpatch(model)


def aggregate(path: Path, top: int, every_step: bool = False) -> None:
    """Shares of py-spy's raw stacks (`frame;frame;... count` lines, frames as `name (file:line)`). With
    `every_step`, every engine step's samples, the forward's launch included (a GPU step's host work, recorded
    over benchmarks/profile_gpu_step.py by gpu_check.sh's "hoststacks" part)."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not (every_step or "decode_step_marker" in stack):
            continue
        names = [frame.partition(" (")[0] for frame in stack.split(";")]
        # The engine's step: `LLMEngine.step` since issue 62's front and core, `LLMEngine._step` before.
        step = next((name for name in names if name in ("LLMEngine.step", "LLMEngine._step")), None)
        if step is None:
            continue
        if not every_step and any(
            name in ("ModelRunner._forward", "ModelRunner._forward_with_images") for name in names
        ):
            continue
        samples = int(count)
        total += samples
        own[names[-1]] += samples
        for name in dict.fromkeys(names[names.index(step) :]):
            inclusive[name] += samples
    if not total:
        raise SystemExit(f"no step samples in {path}: record this script under py-spy (see the docstring)")
    print(f"{total} samples of " + ("engine steps" if every_step else "decode steps' host work (the forward left out)"))
    for title, counter in (("inclusive", inclusive), ("own", own)):
        print(f"\n{title}:")
        for name, samples in counter.most_common(top):
            print(f"{samples / total:7.1%}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--aggregate", type=Path, help="py-spy's raw output of a run of this script")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--every-step", action="store_true", help="with --aggregate: every step, forward included")
    args = parser.parse_args()
    if args.aggregate is not None:
        aggregate(args.aggregate, args.top, args.every_step)
    else:
        run(args.runs)


if __name__ == "__main__":
    main()
