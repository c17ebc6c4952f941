"""KV memory under one budget: long prompts, how many requests run at once, and tokens/s.

Model: a random 12-layer Gemma-3-style model (10 sliding layers of window 512 : 2 full layers, 1 kv head of
64 dims, hidden 256), bf16 (the "16-bit" KV of transformers and hybridkv), on the CPU, greedy.
Workload: --requests prompts of --prompt-tokens random tokens, --new-tokens each.
Budget: --budget-requests transformers DynamicCache requests, each counted as the issue counts one (the bytes
its layers keep after the prompt's prefill: full layers every token, sliding layers their last W-1).

Per request, printed against that DynamicCache figure:
  ideal            full layers x tokens + sliding layers x window (at the request's largest context)
  DynamicCache     the bytes it keeps at the end of generation, and the bytes it holds after the prefill: a
                   sliding layer keeps a view of its last W-1 tokens, which keeps the whole prefill alive
  hybridkv         blocks held at the largest context (the scheduler's own count), 16-bit and fp8 pages
Requests at once under the budget: generate batches as many as the budget holds through their generation;
generate_batch gets the budget as its cache (num_blocks) and is measured (its scheduler's decoding requests);
hybridkv gets it as kv_cache_memory (steps of --max-num-batched-tokens) and is measured (requests holding
their whole prompt's KV at once: admission counts a request's first chunk, so more may run while
prefilling, to be preempted; the token budget and the short generations may keep it below what the pool
holds); and, for every --chunks value, replayed without the model (the scheduler and memory manager alone,
every request prefilled that many tokens per step, a step's budget holding all their chunks, so memory
alone limits admission): how many the pool holds, the preemptions, and the peak blocks beyond the ideal.
Tokens/s = generated tokens / wall seconds, measured under whatever else the machine runs.

    python benchmarks/memory.py [--requests 12] [--prompt-tokens 3000] [--new-tokens 16] [--budget-requests 6]
        [--max-num-batched-tokens 2048] [--chunks 256,512,2048,4096] [--threads N]
    python benchmarks/memory.py --layout deepseek-v2-lite [--budget-requests 8]   # latent attention (issue 49)
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import scheduler as hf_scheduler

import hybridkv
from hybridkv import SamplingParams
from hybridkv.memory.coordinator import KVCacheCoordinator, blocks_for_request
from hybridkv.scheduling.request import Request, RequestStatus
from hybridkv.scheduling.scheduler import Scheduler, SchedulerConfig
from hybridkv.tiny import tiny_model

VOCAB, WINDOW, MODEL_LEN = 8000, 512, 8192
FP8 = "fp8"


def build_model() -> torch.nn.Module:
    return tiny_model(
        "gemma3", num_hidden_layers=12, hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, sliding_window=WINDOW, max_position_embeddings=MODEL_LEN,
        vocab_size=VOCAB, pad_token_id=0,
    ).to(torch.bfloat16)  # fmt: skip


def cache_bytes(cache) -> tuple[int, int]:
    """(bytes the cache's layers keep, bytes of the storage those tensors hold alive)."""
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(t.numel() * t.element_size() for t in tensors), sum(storages.values())


def dynamic_cache(model, prompt: list[int], new_tokens: int) -> dict[str, int]:
    with torch.inference_mode():
        kept_prefill, held_prefill = cache_bytes(model(torch.tensor([prompt]), use_cache=True).past_key_values)
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            return_dict_in_generate=True,
        )  # fmt: skip
    kept_end, held_end = cache_bytes(out.past_key_values)
    return {"kept_prefill": kept_prefill, "held_prefill": held_prefill, "kept_end": kept_end, "held_end": held_end}


def ideal_bytes(model, context: int) -> int:
    """Full layers x tokens + sliding layers x window, K and V, in the model's dtype."""
    config = model.config
    per_layer_token = 2 * config.num_key_value_heads * config.head_dim * model.dtype.itemsize
    return sum(context if kind == "full_attention" else min(context, WINDOW) for kind in config.layer_types) * (
        per_layer_token
    )


def run_generate(model, prompts, new_tokens: int, batch: int) -> tuple[float, list[list[int]]]:
    """transformers' generate (DynamicCache) over batches of `batch` prompts, one after another."""
    start, tokens = time.perf_counter(), []
    for first in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[first : first + batch])
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        tokens += out[:, ids.shape[1] :].tolist()
    return time.perf_counter() - start, tokens


def run_generate_batch(model, prompts, new_tokens: int, budget: int) -> tuple[float, list[list[int]], int, int]:
    """transformers' continuous batching with a cache of `budget` bytes; the most requests decoding at once."""
    config = model.config
    block_bytes = config.num_hidden_layers * 256 * 2 * config.num_key_value_heads * config.head_dim * 2
    seen = [0]
    original = hf_scheduler.FIFOScheduler.schedule_batch

    def counting(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        decoding = sum(s.status == hf_scheduler.RequestStatus.DECODING for s in self.active_requests.values())
        seen[0] = max(seen[0], decoding)
        return result

    hf_scheduler.FIFOScheduler.schedule_batch = counting
    try:
        generation = GenerationConfig(
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None
        )
        batching = ContinuousBatchingConfig(max_batch_tokens=512, num_blocks=budget // block_bytes)
        start = time.perf_counter()
        outputs = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching)
        seconds = time.perf_counter() - start
    finally:
        hf_scheduler.FIFOScheduler.schedule_batch = original
    ordered = sorted(outputs.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
    return seconds, [o.generated_tokens for o in ordered], seen[0], budget // block_bytes * block_bytes


def run_hybridkv(model, prompts, new_tokens: int, budget: int, step_tokens: int, kv_cache_dtype) -> dict:
    """hybridkv with a pool of `budget` bytes and steps of `step_tokens` tokens: seconds, tokens, the most
    requests holding their whole prompt's KV at once, preemptions."""
    llm = hybridkv.patch(
        model, max_model_len=MODEL_LEN, kv_cache_memory=budget, max_num_batched_tokens=step_tokens,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [llm.add_request(str(i), prompt, params) for i, prompt in enumerate(prompts)]
    outputs, at_once = {}, 0
    while llm.has_unfinished_requests():
        for output in llm.step():
            outputs[output.request_id] = output
        at_once = max(at_once, holding_whole_prompts(llm.core.scheduler.running))
    seconds = time.perf_counter() - start
    stats = llm.stats()
    hybridkv.unpatch(model)
    return {
        "seconds": seconds,
        "tokens": [outputs[i].outputs[0].token_ids for i in ids],
        "at_once": at_once,
        "preemptions": stats["num_preemptions"],
        "kv_config": llm.kv_config,
        "num_blocks": stats["num_blocks"],
        "block_bytes": llm.bytes_per_block,
    }


def replay(kv_config, num_blocks: int, num_requests: int, prompt_tokens: int, new_tokens: int, chunk: int) -> tuple:
    """The engine's admissions without the model, every request prefilled `chunk` tokens per step (the step's
    budget holds every request's chunk, so memory alone limits admission): (most requests holding their whole
    prompt at once, preemptions, most blocks in use beyond the ideal of the requests held, in blocks per group
    per request). Prefix caching off: no speculative blocks."""
    coordinator = KVCacheCoordinator(kv_config, num_blocks, enable_caching=False)
    config = SchedulerConfig(
        max_num_batched_tokens=chunk * num_requests, long_prefill_token_threshold=chunk, max_model_len=MODEL_LEN
    )
    scheduler = Scheduler(config, coordinator)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    requests = [Request(str(i), [1] * prompt_tokens, params, None) for i in range(num_requests)]
    for request in requests:
        scheduler.add_request(request)
    at_once, excess = 0, 0.0
    groups = len(kv_config.groups)
    while any(not r.status.is_finished for r in requests):
        plan = scheduler.schedule()
        held = {s.request.request_id: s.request.num_computed_tokens + s.num_new_tokens for s in plan.scheduled}
        ideal_blocks = sum(ideal_group_blocks(kv_config, context) for context in held.values())
        if held:
            excess = max(excess, (coordinator.pool.num_used_blocks - ideal_blocks) / (groups * len(held)))
        scheduler.update(plan, [0] * len(plan.sampling))
        for request in plan.sampling:
            if len(request.output_token_ids) >= new_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
        at_once = max(at_once, holding_whole_prompts(scheduler.running))
    return at_once, scheduler.num_preemptions, excess


def holding_whole_prompts(running) -> int:
    """Running requests whose whole prompt is in KV. (Admission counts only a request's first chunk, so more
    may run while prefilling, to be preempted later; requests past their prompt are what the pool holds.)"""
    return sum(r.num_computed_tokens >= r.num_prompt_tokens for r in running)


def ideal_group_blocks(kv_config, context: int) -> float:
    """The ideal's bytes for one request, in blocks: every group's tokens (window tokens in a sliding group)."""
    return sum(
        (context if g.sliding_window is None else min(context, g.sliding_window)) / g.block_size
        for g in kv_config.groups
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--budget-requests", type=int, default=6)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="hybridkv's step budget in the runs")
    parser.add_argument("--chunks", default="256,512,2048,4096", help="the same, replayed without the model")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--layout", choices=["gemma3", "deepseek-v2-lite"], default="gemma3",
        help="deepseek-v2-lite: latent attention's bytes per token and requests of 4,096 tokens at DynamicCache's "
        "budget for --budget-requests of them (benchmarks/latent_attention.py's memory part)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.layout == "deepseek-v2-lite":
        from latent_attention import memory

        memory(args.budget_requests, 4096)
        return
    report(args)


def report(args: argparse.Namespace) -> None:
    model = build_model()
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, VOCAB, (args.requests, args.prompt_tokens), generator=generator).tolist()
    new, largest = args.new_tokens, args.prompt_tokens + args.new_tokens - 1
    dc = dynamic_cache(model, prompts[0], new)
    budget = args.budget_requests * dc["kept_prefill"]
    mib = 2**20
    print(f"torch {torch.__version__}, {args.threads} threads; {args.requests} prompts of {args.prompt_tokens} tokens,")
    print(f"{new} new each; KV budget {budget / mib:.2f} MiB = {args.budget_requests} DynamicCache requests")
    runs = {
        name: run_hybridkv(model, prompts, new, budget, args.max_num_batched_tokens, dtype)
        for name, dtype in (("16-bit", None), (FP8, FP8))
    }
    kv16, kv8 = runs["16-bit"], runs[FP8]
    per_request = {
        "ideal (full x tokens + sliding x window)": ideal_bytes(model, largest),
        "DynamicCache, kept after the prefill (the budget's unit)": dc["kept_prefill"],
        "DynamicCache, kept at the end": dc["kept_end"],
        "DynamicCache, held after the prefill (views keep it alive)": dc["held_prefill"],
        "hybridkv 16-bit": blocks_for_request(kv16["kv_config"], largest) * kv16["block_bytes"],
        "hybridkv fp8": blocks_for_request(kv8["kv_config"], largest) * kv8["block_bytes"],
    }
    print(f"\nKV bytes per request at {largest} tokens (ratio to DynamicCache's kept bytes at the end):")
    for name, value in per_request.items():
        print(f"  {name:<60}{value / mib:>8.3f} MiB {value / dc['kept_end']:>7.3f}x")
    gen_batch = budget // dc["kept_end"]
    gen_s, reference = run_generate(model, prompts, new, max(1, gen_batch))
    batch_s, batch_tokens, batch_at_once, batch_bytes = run_generate_batch(model, prompts, new, budget)
    generated = args.requests * new
    rows = [
        ("ideal", budget // ideal_bytes(model, largest), None, None),
        ("generate (DynamicCache, kept bytes)", gen_batch, gen_s, reference),
        ("  by its bytes after the prefill", budget // dc["kept_prefill"], None, None),
        ("  by the bytes it holds after the prefill", budget // dc["held_prefill"], None, None),
        (f"generate_batch ({batch_bytes / mib:.2f} MiB cache)", batch_at_once, batch_s, batch_tokens),
        (f"hybridkv 16-bit ({kv16['num_blocks']} blocks)", kv16["at_once"], kv16["seconds"], kv16["tokens"]),
        (f"hybridkv fp8 ({kv8['num_blocks']} blocks)", kv8["at_once"], kv8["seconds"], kv8["tokens"]),
    ]
    print(f"\n{'system':<44}{'at once':>8}{'vs DC':>8}{'tok/s':>8}{'vs gen':>8}{'same tokens':>13}")
    for name, at_once, seconds, tokens in rows:
        timing = f"{generated / seconds:>8.2f}{gen_s / seconds:>7.2f}x" if seconds else " " * 16
        same = f"{sum(a == b for a, b in zip(tokens, reference, strict=True))}/{len(reference)}" if tokens else ""
        print(f"{name:<44}{at_once:>8}{at_once / gen_batch:>7.2f}x{timing}{same:>13}")
    print(f"hybridkv preemptions: 16-bit {kv16['preemptions']}, fp8 {kv8['preemptions']}")
    print("\nhybridkv at every prefill chunk (replayed without the model; prefix caching off):")
    print(f"{'chunk (tokens/request/step)':>28}{'16-bit':>8}{'fp8':>6}{'preempted':>11}{'excess over ideal':>19}")
    for chunk in map(int, args.chunks.split(",")):
        results = [
            replay(run["kv_config"], run["num_blocks"], args.requests, args.prompt_tokens, new, chunk)
            for run in (kv16, kv8)
        ]
        excess = max(r[2] for r in results)
        print(
            f"{chunk:>28}{results[0][0]:>8}{results[1][0]:>6}{results[0][1] + results[1][1]:>11}"
            f"{excess:>13.2f} blocks per group per request"
        )


if __name__ == "__main__":
    main()
