"""Where a decode step's time goes on the GPU: hybridkv's steps under `torch.profiler`, for the next GPU session.

Issue 28 left the Gemma-3-1B shape at 0.83x a compiled static-cache `generate` with no profile of why. This
runs `--running` requests of `--prompt-len` tokens to their decode phase on benchmarks/throughput_gpu.py's
model (random bf16 weights), then profiles `--steps` engine steps and prints: each step's wall time and the
GPU's busy time in it, the share of the step that is the forward call, the sampler and the rest, and the top
kernels by GPU time. With `--tiny` it runs a tiny Gemma 3 on the CPU (what the CPU tests can check of it).

    python benchmarks/profile_gpu_step.py [--model gemma3|llama] [--running 64] [--prompt-len 512] [--steps 20]
                                          [--async-scheduling default|on|off]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

import hybridkv
from hybridkv import SamplingParams
from hybridkv.tiny import tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3", choices=["gemma3", "llama"])
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="a tiny Gemma 3 on the CPU")
    parser.add_argument("--async-scheduling", choices=["default", "on", "off"], default="default")
    parser.add_argument(
        "--steps-only",
        action="store_true",
        help="no torch profiler: the steps alone (for py-spy, host_profile.py --every-step)",
    )
    args = parser.parse_args()
    if args.tiny:
        model, activities = tiny_model("gemma3"), [ProfilerActivity.CPU]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("profile_gpu_step.py needs a CUDA GPU (or --tiny, on the CPU)")
        from throughput_gpu import MODELS

        model, activities = MODELS[args.model](), [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    rng = random.Random(0)
    vocab = model.config.get_text_config().vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.running)]
    scheduling = {"default": None, "on": True, "off": False}[args.async_scheduling]
    llm = hybridkv.patch(
        model,
        max_model_len=args.prompt_len + 4 * args.steps + 64,
        max_num_seqs=args.running,
        async_scheduling=scheduling,
    )
    params = SamplingParams(temperature=0, max_tokens=4 * args.steps, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        llm.add_request(str(index), prompt, params)
    while llm.stats()["num_waiting"] or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in llm.core.scheduler.running
    ):
        llm.step()  # every prompt computed: what follows are decode steps
    for _ in range(3):
        llm.step()  # warm: graphs replayed, kernels compiled
    synchronize = torch.cuda.synchronize if not args.tiny else (lambda: None)
    before = llm.stats()
    # Steps back to back, synchronised only around them all: with async scheduling a step's host work runs while
    # the step before it is on the GPU, which a synchronisation per step would serialise.
    with contextlib.nullcontext() if args.steps_only else profile(activities=activities) as prof:
        synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            llm.step()
        synchronize()
        wall_ms = (time.perf_counter() - start) / args.steps * 1e3
    stats = llm.stats()
    ahead = stats["num_overlapped_steps"] - before["num_overlapped_steps"]
    print(
        f"{args.model}: {args.running} running, {args.prompt_len}-token prompts; graphs {stats['cuda_graphs']}; "
        f"async scheduling {stats['async_scheduling']} ({ahead} of {args.steps} steps planned ahead)"
    )
    parts = {
        "schedule": "schedule_seconds",
        "prepare inputs": "prepare_seconds",
        "forward launch": "forward_seconds",
        "update": "update_seconds",
        "waiting for tokens": "token_wait_seconds",
    }
    host = ", ".join(
        f"{name} {(stats[key] - before[key]) / args.steps * 1e3:.2f} ms" for name, key in parts.items() if key in stats
    )
    print(f"host per step{'' if args.steps_only else ' (profiled, so slower than unprofiled)'}: {host}")
    if args.steps_only:
        print(f"step wall {wall_ms:.2f} ms")
    elif args.tiny:
        print(f"step wall {wall_ms:.2f} ms (CPU)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    else:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / args.steps
        print(f"step wall {wall_ms:.2f} ms; GPU kernels {busy_ms:.2f} ms per step ({busy_ms / wall_ms:.0%} busy)")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25))
    llm.abort_all()
    hybridkv.unpatch(model)


if __name__ == "__main__":
    main()
