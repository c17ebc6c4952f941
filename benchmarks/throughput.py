"""End-to-end throughput: hybridkv vs transformers' generate (padded batch) and generate_batch.

Same model and workload for every system, greedy, fp32, on the CPU; each system runs --repeats times
(in turn, so that none always runs first) and a row gives the median of its runs:
  1. mixed:  32 requests, prompts of 20-300 tokens (seeded), 64 new tokens each
  2. shared: 32 requests sharing a 1,024-token system prompt plus 8-40 unique tokens, 32 new tokens
  3. long:   4k-token prompts on the hybrid model at a fixed KV budget: how many run at once, tokens/s
Models: a tiny Gemma-3-style hybrid (5 sliding : 1 full) and a Llama-style model (hidden 1,024,
12 layers, vocab 32k), both random. Every system's greedy tokens are checked against
`model.generate` for the same prompts (matches are printed), and hybridkv's host work per step
(scheduling, inputs and metadata, update; and with sampling) is printed as a share of its step time.

    python benchmarks/throughput.py [--workloads mixed,shared,long] [--models hybrid,llama] [--threads N] [--busy]
                                    [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import subprocess
import sys
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

import hybridkv
from hybridkv import SamplingParams
from hybridkv.tiny import tiny_model

VOCAB = 32_000


def hybrid_model() -> torch.nn.Module:
    return tiny_model(
        "gemma3", vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_attention_heads=8, head_dim=32,
        sliding_window=256, max_position_embeddings=8192, pad_token_id=0,
    )  # fmt: skip


def llama_model() -> torch.nn.Module:
    return tiny_model(
        "llama", vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192, initializer_range=0.02,
        pad_token_id=0,
    )  # fmt: skip


def workload(name: str) -> tuple[list[list[int]], int]:
    rng = random.Random(0)
    if name == "mixed":
        return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(20, 300))] for _ in range(32)], 64
    if name == "shared":
        system = [rng.randrange(1, VOCAB) for _ in range(1024)]
        return [system + [rng.randrange(1, VOCAB) for _ in range(rng.randint(8, 40))] for _ in range(32)], 32
    return [[rng.randrange(1, VOCAB) for _ in range(4096)] for _ in range(8)], 16


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One batch for transformers' generate: ids left-padded with 0, the attention mask, and the width."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask, width


def run_generate(model, prompts, max_new):
    """transformers' generate on one left-padded batch."""
    ids, mask, width = left_padded(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
        )
    return time.perf_counter() - start, [row[width:].tolist() for row in out]


def run_generate_batch(model, prompts, max_new):
    """transformers' own continuous batching, with max_batch_tokens=512, its fastest setting measured on this CPU."""
    config = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, eos_token_id=None)
    start = time.perf_counter()
    outputs = model.generate_batch(
        prompts, generation_config=config, continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=512)
    )
    seconds = time.perf_counter() - start
    ordered = sorted(outputs.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
    return seconds, [o.generated_tokens for o in ordered]


def run_hybridkv(model, prompts, max_new, **settings):
    llm = hybridkv.patch(model, max_model_len=8192, **settings)
    params = SamplingParams(temperature=0, max_tokens=max_new)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    hybridkv.unpatch(model)
    return seconds, [o.outputs[0].token_ids for o in outputs], stats


def matches(runs, reference) -> str:
    """Requests whose tokens equal the reference's in every run, of all requests."""
    same = sum(all(run[i] == expected for run in runs) for i, expected in enumerate(reference))
    return f"{same}/{len(reference)}"


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> str:
    """Requests whose tokens all equal the reference's, and the mean position of the first difference (bf16
    comparisons, where greedy tokens part after near ties)."""
    same = sum(a == b for a, b in zip(tokens, reference, strict=True))
    first = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for a, b in zip(tokens, reference, strict=True)
    ]
    return f"{same}/{len(reference)} requests equal, first difference at {statistics.mean(first):.1f} on average"


def throughput_row(model_name, workload_name, model, repeats):
    """One model and workload: every system `repeats` times, in turn (round r starts with system r mod 3, so
    none always runs first or just after another), each timed alone; the row gives the median seconds of
    each, and counts a request as matching only if its tokens equal generate's in every run."""
    prompts, max_new = workload(workload_name)
    generated = len(prompts) * max_new
    systems = ("generate", "generate_batch", "hybridkv")
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    tokens: dict[str, list[list[list[int]]]] = {name: [] for name in systems}
    stats = {}
    for round_index in range(repeats):
        for name in systems[round_index % 3 :] + systems[: round_index % 3]:
            if name == "generate":
                run_s, run_tokens = run_generate(model, prompts, max_new)
            elif name == "generate_batch":
                run_s, run_tokens = run_generate_batch(model, prompts, max_new)
            else:
                run_s, run_tokens, stats = run_hybridkv(model, prompts, max_new)
            seconds[name].append(run_s)
            tokens[name].append(run_tokens)
    gen_s, batch_s, ours_s = (statistics.median(seconds[name]) for name in systems)
    reference = tokens["generate"][0]
    if any(run != reference for run in tokens["generate"]):
        print(f"  note: generate's own tokens differed between runs on {model_name} {workload_name}")
    overhead = stats["overhead_seconds"] / stats["step_seconds"]
    host_ms = stats["overhead_seconds"] / stats["num_steps"] * 1e3
    scheduling = (stats["schedule_seconds"] + stats["prepare_seconds"] + stats["update_seconds"]) / stats[
        "step_seconds"
    ]
    print(
        f"{model_name:<7}{workload_name:<8}{generated / gen_s:>10.1f}{generated / batch_s:>10.1f}"
        f"{generated / ours_s:>10.1f}{gen_s / ours_s:>9.2f}x{batch_s / ours_s:>9.2f}x"
        f"{matches(tokens['generate_batch'], reference):>9}{matches(tokens['hybridkv'], reference):>9}"
        f"{scheduling:>11.1%}{overhead:>8.1%}"
        f"{host_ms:>9.2f}{stats['prefix_cache_hit_rate']:>9.0%}{stats['step_threads']:>9}"
    )


def long_prompt_row(model, budget_bytes: int) -> None:
    """Workload 3: 4k-token prompts under one KV budget. transformers' DynamicCache holds what its layers
    keep for one request (measured on the cache object after a prefill), so generate can batch
    budget // that; hybridkv's concurrency is measured: the most requests it ran at once."""
    prompts, max_new = workload("long")
    with torch.inference_mode():
        out = model(torch.tensor([prompts[0]]), use_cache=True)
    cache = out.past_key_values
    hf_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    hf_concurrent = min(len(prompts), budget_bytes // hf_bytes)
    generated = len(prompts) * max_new
    gen_s = 0.0
    for start in range(0, len(prompts), max(1, hf_concurrent)):
        seconds, _ = run_generate(model, prompts[start : start + max(1, hf_concurrent)], max_new)
        gen_s += seconds
    batch_s, _ = run_generate_batch(model, prompts, max_new)
    llm = hybridkv.patch(model, max_model_len=8192, kv_cache_memory=budget_bytes)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new), use_tqdm=False)
    ours_s = time.perf_counter() - start
    stats = llm.stats()
    hybridkv.unpatch(model)
    print(
        f"long   4k x {len(prompts)}: KV budget {budget_bytes / 2**20:.0f} MiB; transformers' cache "
        f"{hf_bytes / 2**20:.1f} MiB per request -> {hf_concurrent} at once; hybridkv ran "
        f"{stats['max_num_running']} at once ({stats['num_preemptions']} preemptions); tokens/s: generate "
        f"{generated / gen_s:.1f}, generate_batch (its own KV sizing) {generated / batch_s:.1f}, hybridkv "
        f"{generated / ours_s:.1f} ({gen_s / ours_s:.2f}x vs generate, {batch_s / ours_s:.2f}x vs generate_batch)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mixed,shared,long")
    parser.add_argument("--models", default="hybrid,llama")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each system per row, in turn; the row gives the medians"
    )
    parser.add_argument(
        "--busy", action="store_true", help="keep one core busy with another process during the run (a shared machine)"
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    torch.set_num_threads(args.threads)
    with busy_core() if args.busy else contextlib.nullcontext():
        run(args)


@contextlib.contextmanager
def busy_core():
    """Another process spinning on one core for the whole run, as a neighbour on a shared machine would."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def run(args: argparse.Namespace) -> None:
    busy = ", one core kept busy by another process" if args.busy else ""
    print(
        f"torch {torch.__version__}, {args.threads} threads{busy}; tokens/s = generated tokens / wall seconds, "
        f"median of {args.repeats} runs per system (mixed and shared; long: one run), the systems in turn"
    )
    print(
        f"{'model':<7}{'load':<8}{'generate':>10}{'gen_batch':>10}{'hybridkv':>10}{'vs gen':>10}{'vs batch':>10}"
        f"{'batch ok':>9}{'ours ok':>9}{'sched+meta':>11}{'host':>8}{'host ms':>9}{'hits':>9}{'threads':>9}"
    )
    workloads = args.workloads.split(",")
    builders = {"hybrid": hybrid_model, "llama": llama_model}
    for model_name in args.models.split(","):
        model = builders[model_name]()
        for workload_name in ("mixed", "shared"):
            if workload_name in workloads:
                throughput_row(model_name, workload_name, model, args.repeats)
        if model_name == "hybrid" and "long" in workloads:
            long_prompt_row(model, budget_bytes=16 * 2**20)
    print(
        "'ok' = requests whose greedy tokens equal model.generate's; sched+meta = scheduling, inputs and metadata,"
        " update / hybridkv step time; host = all work outside the forward (sampling included) / step time;"
        " host ms = that work per step; threads = torch threads of hybridkv's last step (cpu_threads='auto': the"
        " cores other processes leave; transformers runs on torch's count)"
    )


if __name__ == "__main__":
    main()
