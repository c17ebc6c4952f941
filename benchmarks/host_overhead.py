"""Host work per engine step: what hybridkv spends outside the model's forward.

hybridkv alone on `benchmarks/throughput.py`'s hybrid model and its mixed and shared-prefix workloads,
greedy, repeated; prints the median per step of the host time (scheduling, inputs and metadata,
sampling, update) with its parts, the forward's time and the share, and the host time per decode step
alone (a step whose every row is a sequence's one new token: the prefill chunks' steps, which allocate and
hash whole prompts, are left out of that figure). Machine speed drifts on shared
cores, so compare two versions in one process: install the other version to a folder (`pip install --no-deps
--target DIR <checkout>`) and pass `--against DIR`. Its package is copied with every `hybridkv` in it renamed
(so its attention op and functions register apart from this one's), imported beside this checkout's, and the
two run the same workload alternately, run by run; each pair's ratio is printed (the machine's drift over
seconds cancels in a pair, where back-to-back processes saw 0.75-1.05 between two copies of one commit). Single
pairs still range over about ±20% on the 2-core machine, so a change of 5-10% needs `--pairs 30` (about 3 minutes
a workload) before its median means anything.
Any version since the engine-step refactor runs (the model comes from `hybridkv.tiny`).

What the host work costs depends on what the forward leaves in the caches. `--ready-logits` replaces the model's
forward by ready logits of the right shape (the same tensor for every step of a size: no KV is stored, tokens are
not the model's), so host work runs with its code and data still in the caches: the difference to a real run is
what a forward's eviction costs it. `--requests N` keeps the workload's first N requests (host work per request
is the slope).

`--max-num-seqs N` patches both versions with `max_num_seqs=N`: with fewer seats than the workload's 32 requests, most
steps run a full batch while requests wait (the regime of a loaded server).

`--model qwen3_5` or `nemotron_h` runs benchmarks/state_layers.py's models with state layers instead (their
state checkpoints' planning is host work too: compare with `--no-prefix-caching`).

    python benchmarks/host_overhead.py [--threads 1] [--repeats 4] [--model hybrid] [--no-prefix-caching]
    python benchmarks/host_overhead.py --against DIR [--pairs 30] [--workloads mixed,shared]
    python benchmarks/host_overhead.py --against DIR --workloads mixed [--ready-logits] [--requests 1]
    python benchmarks/host_overhead.py --against DIR --workloads mixed --pairs 30 --argmax-apart
    python benchmarks/host_overhead.py --against DIR --workloads mixed --pairs 16 --async-scheduling
    python benchmarks/host_overhead.py --against DIR --workloads mixed,shared --pairs 12 --kv-events
    python benchmarks/host_overhead.py --against DIR --workloads mixed --pairs 20 --phases
    python benchmarks/host_overhead.py --against DIR --workloads mixed --pairs 10 --max-num-seqs 8

`--async-scheduling` runs this checkout with the next step planned before the last one's tokens are read
(hybridkv/engine/async_steps.py): on the CPU the forward runs at launch, so what it adds is the path's own host work.

`--kv-events` runs this checkout publishing vLLM's KV events (`kv_events_config`, to an ipc:// socket no one reads):
against a copy of this same checkout (`--against DIR`), the ratio is what recording and sending the events costs.

`--phases` also splits each version's steps into planning, running less the forward, updating, checking the model
and the rest (the step's entry, its reports), each timed around the methods that do it in that version.

`--argmax-apart` times each version's greedy argmax (`greedy_tokens`, numpy's over the step's float32 logits) and
prints the host per decode step without it too: on a GPU that argmax is a kernel on the device, not host work.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

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
    parser.add_argument("--against", type=Path, help="a folder holding another version of hybridkv (pip --target)")
    parser.add_argument("--pairs", type=int, default=6, help="with --against: alternated pairs of runs")
    parser.add_argument("--workloads", default="mixed,shared")
    parser.add_argument("--ready-logits", action="store_true", help="ready logits instead of the forward")
    parser.add_argument("--requests", type=int, help="the workload's first N requests only")
    parser.add_argument(
        "--max-num-seqs", type=int, help="patch(max_num_seqs=N): a full batch with requests waiting (both versions)"
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="this checkout's async_scheduling (default: the engine's, off on the CPU)",
    )
    parser.add_argument(
        "--argmax-apart", action="store_true", help="with --against: also host per decode step without the argmax"
    )
    parser.add_argument("--kv-events", action="store_true", help="this checkout publishes vLLM's KV events")
    parser.add_argument(
        "--phases", action="store_true", help="with --against: also each step's plan, run and update apart"
    )
    args = parser.parse_args()
    args.events_config = None
    if args.kv_events:
        folder = tempfile.mkdtemp(prefix="host_overhead_events_")
        args.events_config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{folder}/events"}
    torch.set_num_threads(args.threads)
    if args.model == "hybrid":
        model = hybrid_model()
    else:
        from state_layers import MODELS

        model = MODELS[args.model]()
    # Both versions' settings beyond the defaults (every version since the engine-step refactor takes max_num_seqs).
    args.seats = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    if args.against is not None:
        compare(model, load_renamed(args.against), args.pairs, args.workloads.split(","), args.prefix_caching, args)
        return
    print(f"torch {torch.__version__}, {args.threads} threads; median of {args.repeats - 1} runs after a warm-up")
    for name in args.workloads.split(","):
        prompts, max_new = workload(name)
        prompts = prompts[: args.requests]
        runs = []
        for _ in range(args.repeats):
            llm = hybridkv.patch(
                model,
                max_model_len=8192,
                enable_prefix_caching=args.prefix_caching,
                async_scheduling=args.async_scheduling,
                kv_events_config=args.events_config,
                **args.seats,
            )
            with ready_logits(model, args.ready_logits):
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


def load_renamed(folder: Path):
    """The hybridkv installed in `folder`, copied to a scratch folder as `hybridkv_base` with every mention of its
    name rewritten, and imported."""
    scratch = Path(tempfile.mkdtemp(prefix="host_overhead_"))
    shutil.copytree(folder / "hybridkv", scratch / "hybridkv_base", ignore=shutil.ignore_patterns("__pycache__"))
    for path in (scratch / "hybridkv_base").rglob("*"):
        if path.suffix in (".py", ".c"):
            path.write_text(path.read_text().replace("hybridkv", "hybridkv_base"))
    sys.path.insert(0, str(scratch))
    return importlib.import_module("hybridkv_base")


def compare(model, base, pairs: int, workloads: list[str], prefix_caching: bool, args: argparse.Namespace) -> None:
    """Host work per step and per decode step of this checkout against `base`, alternated run by run in this
    process (which goes first alternates too), after a warm-up run of each."""

    def run(package, prompts, max_new) -> tuple[float, ...]:
        # --async-scheduling sets this checkout's (versions before issue 47 have no such setting).
        ours = dict(args.seats)
        if package is hybridkv and args.async_scheduling is not None:
            ours["async_scheduling"] = args.async_scheduling
        if package is hybridkv and args.events_config is not None:
            ours["kv_events_config"] = args.events_config
        llm = package.patch(model, max_model_len=8192, enable_prefix_caching=prefix_caching, **ours)
        phases = phase_timers(llm) if args.phases else None
        with ready_logits(model, args.ready_logits), argmax_timed(package, args.argmax_apart) as argmax:
            decode_host, decode_steps = run_steps(
                llm, prompts, package.SamplingParams(temperature=0, max_tokens=max_new), argmax
            )
        forward = engine_runner(llm).forward_seconds
        host = (llm.step_seconds - forward) / llm.num_steps
        package.unpatch(model)
        figures = (host * 1e3, decode_host / decode_steps * 1e3)
        if args.argmax_apart:
            figures += ((decode_host - argmax.decode_seconds) / decode_steps * 1e3,)
        if phases is not None:
            plan, run_, update, checks = phases["plan"], phases["run"] - forward, phases["update"], phases["checks"]
            rest = llm.step_seconds - forward - plan - run_ - update - checks
            figures += tuple(seconds / llm.num_steps * 1e3 for seconds in (plan, run_, update, checks, rest))
        return figures

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; this checkout against {base.__file__}")
    for name in workloads:
        prompts, max_new = workload(name)
        prompts = prompts[: args.requests]
        run(hybridkv, prompts, max_new), run(base, prompts, max_new)
        results: dict[str, list[tuple[float, ...]]] = {"base": [], "new": []}
        for pair in range(pairs):
            order = [("base", base), ("new", hybridkv)]
            for label, package in order if pair % 2 == 0 else reversed(order):
                results[label].append(run(package, prompts, max_new))
        figures = ["host per step", "host per decode step"] + ["  without the argmax"] * args.argmax_apart
        figures += [
            "  planning", "  running, less the forward", "  updating", "  checking the model", "  the rest of the step"
        ] * args.phases  # fmt: skip
        for index, what in enumerate(figures):
            old, new = ([r[index] for r in results[label]] for label in ("base", "new"))
            ratios = [b / a for a, b in zip(old, new, strict=True)]
            print(
                f"{name:<7} {what}: base {statistics.median(old):.3f} ms, this {statistics.median(new):.3f} ms; "
                f"this / base per pair {' '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.3f}"
            )
            # The machine's interference only adds time: each version's fastest quarter of runs is its least
            # disturbed, and their ratio moves less from run to run than the pairs' median.
            if pairs < 2:  # a quartile needs two runs
                continue
            low_old, low_new = (statistics.quantiles(runs, n=4)[0] for runs in (old, new))
            print(
                f"{name:<7} {what}, lower quartiles: base {low_old:.3f} ms, this {low_new:.3f} ms, "
                f"ratio {low_new / low_old:.3f}"
            )


@contextlib.contextmanager
def ready_logits(model: torch.nn.Module, ready: bool) -> Iterator[None]:
    """With `ready`, the model's forward returns ready logits (one random tensor per number of rows kept) instead of
    computing: the engine's host work runs with nothing between its steps (see the module docstring)."""
    if not ready:
        yield
        return
    vocab = model.config.get_text_config().vocab_size
    tensors: dict[int, torch.Tensor] = {}

    def forward(*args, logits_to_keep, **kwargs) -> SimpleNamespace:
        rows = len(logits_to_keep)
        if rows not in tensors:
            tensors[rows] = torch.randn(1, rows, vocab, generator=torch.Generator().manual_seed(rows))
        return SimpleNamespace(logits=tensors[rows])

    model.forward = forward
    try:
        yield
    finally:
        del model.forward


class ArgmaxTimer:
    """The seconds a package's `greedy_tokens` (the greedy argmax) took, in all and in the decode steps."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.decode_seconds = 0.0


@contextlib.contextmanager
def argmax_timed(package, timed: bool) -> Iterator[ArgmaxTimer | None]:
    """With `timed`, the package's `sampling.sampler.greedy_tokens` adds its time to the yielded timer (the engine
    looks it up in that module at each call: every version since the subpackages of issue 48 does)."""
    if not timed:
        yield None
        return
    sampler, timer = importlib.import_module(f"{package.__name__}.sampling.sampler"), ArgmaxTimer()
    greedy_tokens = sampler.greedy_tokens

    def timed_greedy_tokens(logits):
        start = time.perf_counter()
        try:
            return greedy_tokens(logits)
        finally:
            timer.seconds += time.perf_counter() - start

    sampler.greedy_tokens = timed_greedy_tokens
    try:
        yield timer
    finally:
        sampler.greedy_tokens = greedy_tokens


def phase_timers(llm) -> dict[str, float]:
    """Seconds each phase of `llm`'s steps takes, summed as they run: planning (the scheduler's plan), running (the
    forward and sampling: the forward's own time is taken off by the caller), updating (the requests and their
    blocks after it) and checking the model (its weights and adapters where a request is admitted; since issue 61
    also its attention layout, at every `step()` call); the rest of a step is its entry and its reports. The phases
    are the core's public steps since issue 62 and the engine's private ones before it (5c251f4)."""
    seconds = {"plan": 0.0, "run": 0.0, "update": 0.0, "checks": 0.0}
    core = getattr(llm, "core", None)
    if core is not None:
        timed = [(core, "schedule", "plan"), (core, "execute", "run"), (core, "sample", "run")]
        timed += [(llm, "_finish_alone", "update"), (llm, "finish_step", "update")]
        timed += [(core, "check_layout", "checks"), (core, "follow_model", "checks")]
    else:
        timed = [(llm.scheduler, "schedule", "plan"), (llm, "_execute", "run")]
        timed += [(llm, "_update_alone", "update"), (llm, "_update", "update"), (llm, "_follow_model", "checks")]
    for owner, name, phase in timed:
        method = getattr(owner, name)

        def timed_method(*args, _method=method, _phase=phase, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                seconds[_phase] += time.perf_counter() - start

        setattr(owner, name, timed_method)
    return seconds


def engine_runner(llm):
    """The engine's model runner: its core's (`llm.core.runner`), or the engine's own in versions before issue 62."""
    return getattr(llm, "core", llm).runner


def run_steps(
    llm, prompts: list[list[int]], params: SamplingParams, argmax: ArgmaxTimer | None = None
) -> tuple[float, int]:
    """Run the prompts to the end step by step (as `generate` does); returns the host seconds of the decode steps
    (every row one new token) and their number, read from the engine's counters around each step (and adds the
    decode steps' argmax seconds to `argmax`, given)."""
    # vLLM's (request_id, prompt, params) since the issue 45 change; (prompt, params) in the versions before it.
    vllm_order = next(iter(inspect.signature(llm.add_request).parameters)) == "request_id"
    for index, prompt in enumerate(prompts):
        if vllm_order:
            llm.add_request(str(index), prompt, params)
        else:
            llm.add_request(prompt, params)
    runner = engine_runner(llm)
    decode_host, decode_steps = 0.0, 0
    while llm.has_unfinished_requests():
        before = (llm.step_seconds, runner.forward_seconds, llm.num_forward_tokens, llm.num_generated_tokens)
        argmax_before = argmax.seconds if argmax is not None else 0.0
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
            if argmax is not None:
                argmax.decode_seconds += argmax.seconds - argmax_before
    return decode_host, decode_steps


if __name__ == "__main__":
    main()
