"""Host work per engine step counted, not timed: the Python bytecodes each step runs, by function, against another
version of hybridkv.

`host_overhead.py` times host work, and on the shared 2-core machine single pairs of runs range over about ±20%, so a
change of a few percent needs dozens of pairs to show. This counts instead: the workload of `host_overhead.py`
(`benchmarks/throughput.py`'s hybrid model, greedy, the model's forward replaced by ready logits) runs once through
each version to warm its caches and once more counted, every bytecode of each `step()` tallied by the function that
runs it (`sys.settrace` with opcode events), and the count is the same from run to run. Printed: bytecodes, Python
calls and distinct functions entered per step of each version, then the functions whose count differs most, with their
calls per step.

The distinct functions are what a step pays for after a forward has evicted their code and data from the caches: on
this machine each trivial function entered cold adds about 0.7-0.8 us, the time of 120 warm bytecodes, the first one
of a chain 1.5 us (`python benchmarks/cold_calls.py`), so they are counted beside the bytecodes (13 fewer a step
were still within the noise of `host_overhead.py`: benchmarks/RESULTS.md).

A bytecode is not a unit of time: a call is one bytecode and costs the time of several, a C builtin's loop none
(issue 62 found a batch of comprehensions that ran fewer calls and more bytecodes slower than the calls; numpy's argmax
is no bytecode at all). Read the counts to find where two versions differ; time the candidates with host_overhead.py.

    python benchmarks/host_opcodes.py --against DIR [--workload mixed] [--top 30]

DIR: another version installed with `pip install --no-deps --target DIR <checkout>` (loaded as host_overhead.py loads
it, renamed).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

import torch
from host_overhead import load_renamed, ready_logits

import hybridkv

from throughput import hybrid_model, workload


def count(package, model: torch.nn.Module, prompts: list[list[int]], max_new: int) -> tuple[int, Counter, Counter, int]:
    """(steps, bytecodes by function, calls by function, distinct functions entered summed over the steps) of the
    second of two runs of the prompts."""
    opcodes: Counter = Counter()
    calls: Counter = Counter()
    entered: set = set()  # the functions (code objects) the step under way entered
    name = package.__name__

    def tracer(frame, event, arg):
        code = frame.f_code
        entered.add(code)
        key = f"{re.sub(rf'.*/{name}/', '', code.co_filename)}:{code.co_name}"
        calls[key] += 1
        frame.f_trace_opcodes = True

        def local(frame, event, arg):
            if event == "opcode":
                opcodes[key] += 1
            return local

        return local

    llm = package.patch(model, max_model_len=8192, num_blocks=4096, swap_space=0)
    steps = distinct = 0
    with ready_logits(model, True):
        for round_ in range(2):
            for index, prompt in enumerate(prompts):
                params = package.SamplingParams(temperature=0, max_tokens=max_new)
                llm.add_request(f"{round_}-{index}", prompt, params)
            while llm.has_unfinished_requests():
                if round_ == 0:
                    llm.step()
                    continue
                sys.settrace(tracer)
                try:
                    llm.step()
                finally:
                    sys.settrace(None)
                steps += 1
                distinct += len(entered)
                entered.clear()
    package.unpatch(model)
    return steps, opcodes, calls, distinct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, required=True, help="a folder holding another version (pip --target)")
    parser.add_argument("--workload", default="mixed", choices=["mixed", "shared"])
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = hybrid_model()
    prompts, max_new = workload(args.workload)
    base = load_renamed(args.against)
    figures = {}
    for label, package in (("base", base), ("this", hybridkv)):
        steps, opcodes, calls, distinct = count(package, model, prompts, max_new)
        figures[label] = (steps, opcodes, calls)
        print(
            f"{label}: {sum(opcodes.values()) / steps:,.0f} bytecodes per step, {sum(calls.values()) / steps:.0f} "
            f"Python calls, {distinct / steps:.0f} distinct functions entered; {steps} steps"
        )
    (base_steps, base_ops, base_calls), (steps, ops, this_calls) = figures["base"], figures["this"]
    rows = sorted(
        ((ops[key] / steps - base_ops[key] / base_steps, key) for key in set(ops) | set(base_ops)),
        key=lambda row: -abs(row[0]),
    )
    print("bytecodes per step, this - base (this, base; calls per step, this, base):")
    for difference, key in rows[: args.top]:
        print(
            f"{difference:+8.0f}  ({ops[key] / steps:7.0f}, {base_ops[key] / base_steps:7.0f}; "
            f"{this_calls[key] / steps:5.1f}, {base_calls[key] / base_steps:5.1f})  {key}"
        )


if __name__ == "__main__":
    main()
