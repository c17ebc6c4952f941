"""Metadata micro-benchmark: one step's attention metadata for every KV cache group, and the per-layer
cost of the checked and unchecked attention calls.

A decode step of 32 sequences (contexts 100..2,000) and a mixed step (4 prefill chunks of 256 + 28
decodes), block size 16, for a model with 1 group and one with 7 (Gemma-3-1B's layout: 6 sliding
groups + 1 full). Each group gets its own block table and its torch gather plan (which the first layer
of each group builds). "separate" builds a step per group; "shared" builds one `StepMetadata` and every
group from it (`for_group`: one layout per window per step); "together" is what the engine calls,
`build_step_metadata`: the groups of one block size as one tensor (`for_groups`), decode-only slots
and layouts without the tensor bookkeeping. "buffers" is what the engine calls now: `StepBuffers.step`,
the step written into tensors allocated once, from the persistent batch's numpy block tables (each
request's row kept between steps, hybridkv/execution/input_batch.py), slots by numpy over all groups at once.

`--fill-ways`: the runner's `prepare` of one decode step (32 sequences, contexts 20..300, the tiny Gemma-3 layout
of benchmarks/throughput.py: its sliding and full groups), each of the ways the step buffers can be written, warm
(back to back) and cold (a 1024x1024 matmul between calls, as a forward leaves the caches): `decode_step` with its
lists read by the extension module (step_native.c, where Python's headers build it), `decode_step` with the lists
as `array`s and the fill through ctypes (no headers), the general `fill_inputs` + `step` with the extension's fill,
with the ctypes fill, and with numpy alone (no compiler). The fast paths are worth their code only as far as they
beat the general path here.

Per layer: a tiny decode step (4 sequences, contexts 20..50, 4 q heads, 2 kv heads, head dim 16) on
the torch path, timing `paged_attention` / `write_kv` (every input checked, backend picked per call)
against `attend` / `store_kv` (what the engine calls); the difference is the checks' cost per layer.

    python benchmarks/metadata.py
    python benchmarks/metadata.py --fill-ways
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from hybridkv.kernels import (
    PagedAttentionMetadata,
    StepMetadata,
    allocate_kv_cache,
    attend,
    build_step_metadata,
    paged_attention,
    store_kv,
    write_kv,
)
from hybridkv.kernels.step_buffers import StepBuffers
from hybridkv.kernels.torch_plan import torch_plan
from hybridkv.memory.block_pool import cdiv

BLOCK_SIZE = 16
WINDOW = 512


def step(kind: str) -> tuple[list[int], list[int]]:
    rng = random.Random(0)
    contexts = [rng.randint(100, 2000) for _ in range(32)]
    if kind == "decode":
        return [1] * 32, contexts
    return [256] * 4 + [1] * 28, [c + 256 if i < 4 else c for i, c in enumerate(contexts)]


def tables(seq_lens: list[int], num_groups: int) -> list[list[list[int]]]:
    rng = random.Random(1)
    return [
        [[rng.randrange(1, 1 << 20) for _ in range(cdiv(n, BLOCK_SIZE))] for n in seq_lens] for _ in range(num_groups)
    ]


class PersistentTables:
    """The engine's side of a step: the groups' rows in one numpy table (rows 0..n-1 are the step's
    sequences, in a table of 64 rows and blocks for 4,096 tokens) and step buffers for 64 sequences and
    2,048 rows."""

    def __init__(self, group_tables: list[list[list[int]]]) -> None:
        num_groups = len(group_tables)
        self.table = np.zeros((num_groups, 65, cdiv(4096, BLOCK_SIZE)), dtype=np.int32)
        for g, rows in enumerate(group_tables):
            for s, row in enumerate(rows):
                self.table[g, s, : len(row)] = row
        self.rows = np.arange(len(group_tables[0]))
        self.buffers = StepBuffers(
            torch.device("cpu"), "torch", 64, 2048, {BLOCK_SIZE: (num_groups, self.table.shape[2])}
        )

    def step(self, query_lens: list[int], seq_lens: list[int], windows) -> None:
        q, k = np.array(query_lens), np.array(seq_lens)
        positions = np.concatenate([np.arange(n - m, n) for m, n in zip(q, k, strict=True)])
        built = self.buffers.step(q, k, positions, {BLOCK_SIZE: self.table}, self.rows)[BLOCK_SIZE]
        for metadata, window in zip(built, windows, strict=True):
            torch_plan(metadata, window)


def build_step(query_lens, seq_lens, group_tables, windows, how: str, persistent=None) -> None:
    if how == "buffers":
        persistent.step(query_lens, seq_lens, windows)
        return
    if how == "together":
        built = build_step_metadata(
            query_lens, seq_lens, group_tables, [BLOCK_SIZE] * len(windows), [torch.device("cpu")]
        )
        for metadata, window in zip(built, windows, strict=True):
            torch_plan(metadata, window)
        return
    step_metadata = StepMetadata.build(query_lens, seq_lens)
    for rows, window in zip(group_tables, windows, strict=True):
        if how == "separate":
            step_metadata = StepMetadata.build(query_lens, seq_lens)
        torch_plan(step_metadata.for_group(rows, BLOCK_SIZE), window)


def best_ms(function: Callable[[], object], runs: int = 20) -> float:
    function()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def median_us(function: Callable[[], object], calls: int = 200, runs: int = 15) -> float:
    for _ in range(calls):
        function()
    per_call = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        per_call.append((time.perf_counter() - start) / calls)
    return statistics.median(per_call) * 1e6


def per_layer_calls() -> None:
    query_lens, seq_lens = [1] * 4, [20, 30, 40, 50]
    rows = [list(range(1 + 4 * seq, 1 + 4 * seq + cdiv(n, BLOCK_SIZE))) for seq, n in enumerate(seq_lens)]
    metadata = PagedAttentionMetadata.build(query_lens, seq_lens, rows, BLOCK_SIZE)
    key_cache, value_cache = allocate_kv_cache(1, 20, BLOCK_SIZE, 2, 16, torch.float32, "cpu")[0]
    generator = torch.Generator().manual_seed(0)
    key_cache.normal_(generator=generator)
    value_cache.normal_(generator=generator)
    query = torch.randn(4, 4, 16, generator=generator)
    key, value = torch.randn(4, 2, 16, generator=generator), torch.randn(4, 2, 16, generator=generator)
    options = dict(scale=0.25, sliding_window=32)
    calls = {
        "paged_attention (checked)": lambda: paged_attention(query, key_cache, value_cache, metadata, **options),
        "attend (unchecked)": lambda: attend(query, key_cache, value_cache, metadata, **options),
        "write_kv (checked)": lambda: write_kv(key, value, key_cache, value_cache, metadata.slot_mapping),
        "store_kv (unchecked)": lambda: store_kv(key, value, key_cache, value_cache, metadata),
    }
    print("\nper layer, tiny decode step (4 sequences), torch path")
    for name, function in calls.items():
        print(f"  {name:<28}{median_us(function):>8.1f} us")


def fill_ways() -> None:
    """The runner's `prepare` of one decode step, per way of writing the step buffers (see the docstring)."""
    import hybridkv
    from hybridkv import SamplingParams
    from hybridkv.kernels import step_buffers

    from throughput import hybrid_model

    rng = random.Random(0)
    model = hybrid_model()
    llm = hybridkv.patch(model, block_size=BLOCK_SIZE, max_model_len=1024, enable_prefix_caching=False)
    for i in range(32):
        prompt = [rng.randrange(1, 256) for _ in range(rng.randint(20, 300))]
        llm.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    while True:  # the prompts, then one decode step: its plan is what every way prepares
        plan = llm.core.scheduler.schedule()
        inputs = llm.core.runner.step_inputs(plan)
        if len(inputs.input_ids) == len(inputs.query_lens) == 32:
            break
        logits = llm.core.runner.forward(llm.core.runner.prepare(inputs))
        llm.core.scheduler.update(plan, logits.argmax(-1).tolist())
    runner = llm.core.runner
    buffers = runner.buffers[runner.input_device]
    native, extension_inputs = buffers.fill, buffers.decode_inputs
    ways = {
        "decode_step, extension inputs + fill": (native, extension_inputs, True),
        "decode_step, arrays + ctypes fill": (step_buffers._FILL.get(), None, True),
        "fill_inputs + step, extension fill": (native, None, False),
        "fill_inputs + step, ctypes fill": (step_buffers._FILL.get(), None, False),
        "fill_inputs + step, numpy only": (None, None, False),
    }
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    plain = runner._plain_decode
    print(f"\nthe runner's prepare of a 32-sequence decode step ({len(runner._groups_in_order)} groups), median us")
    print(f"{'way':<40}{'warm':>8}{'cold':>8}")
    for name, (fill, decode_inputs, fast) in ways.items():
        buffers.fill, buffers.decode_inputs, runner._plain_decode = fill, decode_inputs, fast and plain

        def prepare():
            runner.prepare(inputs)

        def after_a_matmul():
            torch.mm(a, b)
            start = time.perf_counter()
            runner.prepare(inputs)
            return time.perf_counter() - start

        warm = median_us(prepare, calls=100, runs=11)
        cold = statistics.median(after_a_matmul() for _ in range(200)) * 1e6
        print(f"{name:<40}{warm:>8.1f}{cold:>8.1f}")
    buffers.fill, buffers.decode_inputs, runner._plain_decode = native, extension_inputs, plain
    llm.close()
    hybridkv.unpatch(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fill-ways", action="store_true", help="only the ways of writing a decode step's buffers")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.fill_ways:
        fill_ways()
        return
    print(f"{'step':<8}{'groups':>7}{'separate ms':>13}{'shared ms':>11}{'together ms':>13}{'buffers ms':>12}")
    for kind in ("decode", "mixed"):
        query_lens, seq_lens = step(kind)
        for windows in ([None], [WINDOW] * 6 + [None]):
            group_tables = tables(seq_lens, len(windows))
            persistent = PersistentTables(group_tables)
            timings = [
                best_ms(partial(build_step, query_lens, seq_lens, group_tables, windows, how, persistent))
                for how in ("separate", "shared", "together", "buffers")
            ]
            print(
                f"{kind:<8}{len(windows):>7}{timings[0]:>13.2f}{timings[1]:>11.2f}{timings[2]:>13.2f}"
                f"{timings[3]:>12.2f}"
            )
    per_layer_calls()


if __name__ == "__main__":
    main()
