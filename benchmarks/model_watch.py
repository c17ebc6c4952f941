"""What following the model costs: each of `ModelWatch`'s signals, and a whole check, per engine call.

hybridkv checks the model (hybridkv/execution/model_watch.py) at most once per engine call, in the first step that may
admit a request or replay a CUDA graph. The cost grows with the number of tensors, not their size, so the model here has
a real model's tensor count with tiny shapes: Gemma-3-1B's 26 layers (342 tensors), or Qwen3-8B-shaped's 36
(`--layers 36`), with `--lora` a LoRA adapter on every attention and MLP projection (PEFT's tuner layers, and
twice the tensors). Prints the median microseconds of each part over `--repeats` calls, beside the engine's own
`add_request` of a 100-token prompt on the same model for scale (`benchmarks/host_overhead.py --against` gives
the host work per step with and without the check).

`--cold` times each call after a 64 MiB read instead, one call at a time: what a step pays after a forward has evicted
the watch's code and the tensors' objects (benchmarks/cold_calls.py).

    python benchmarks/model_watch.py [--layers 26] [--lora] [--repeats 2000] [--cold]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import hybridkv
from hybridkv.execution.model_watch import ModelWatch, _same_samples
from hybridkv.tiny import tiny_model


def timed(function, repeats: int) -> float:
    """Median microseconds of `function()` over `repeats` calls, in batches of 50 (a timer call costs too)."""
    function()
    batches = []
    for _ in range(max(1, repeats // 50)):
        start = time.perf_counter()
        for _ in range(50):
            function()
        batches.append((time.perf_counter() - start) / 50 * 1e6)
    return statistics.median(batches)


def timed_cold(function, repeats: int) -> float:
    """Median microseconds of `function()` called once after each of `repeats` reads of 64 MiB."""
    evict = np.ones(64 << 18, dtype=np.float32)
    function()
    times = []
    for _ in range(repeats):
        evict.sum()
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--cold", action="store_true", help="each call after a 64 MiB read")
    args = parser.parse_args()
    time_it = timed_cold if args.cold else timed
    torch.set_num_threads(1)
    model = tiny_model("gemma3", num_hidden_layers=args.layers, hidden_size=64, intermediate_size=128)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=4, target_modules=targets), "adapter")
    watch = ModelWatch(model)
    print(
        f"torch {torch.__version__}, 1 thread; {type(model).__name__}, {args.layers} layers, "
        f"{len(watch._slots)} tensors, {len(watch._tuner_layers)} PEFT tuner layers; median microseconds"
        f"{', each call cold' if args.cold else ''}"
    )
    sampled = watch._read_samples()
    parts = {
        "version counters and addresses": watch._read_counters,
        "content sample, read and compared": lambda: _same_samples(watch._read_samples(), sampled),
        "PEFT adapter and merge state": lambda: (watch._adapter_state(), watch._merged_adapters()),
        "structure read again (after a registration)": watch._read_structure,
        "whole check, nothing changed": watch.check,
    }
    for name, function in parts.items():
        print(f"  {name:<46} {time_it(function, args.repeats):9.1f}")
    watch.close()

    llm = hybridkv.patch(model, max_model_len=512)
    prompt = list(range(1, 101))
    params = hybridkv.SamplingParams(max_tokens=1)

    def add_and_abort() -> None:
        llm.abort(llm.add_request("timed", prompt, params))

    check = time_it(llm.core.model_watch.check, args.repeats)
    add = time_it(add_and_abort, args.repeats // 4)
    print(f"  {'engine add_request + abort (no check)':<46} {add:9.1f}")
    print(f"  whole check / add_request: {check / add:.2f}x (a check runs once per call, however many requests)")
    hybridkv.unpatch(model)


if __name__ == "__main__":
    main()
