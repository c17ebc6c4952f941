"""Metadata micro-benchmark: building one step's attention metadata for every KV cache group.

A decode step of 32 sequences (contexts 100..2,000) and a mixed step (4 prefill chunks of 256 + 28
decodes), block size 16, for a model with 1 group and one with 7 (Gemma-3-1B's layout: 6 sliding
groups + 1 full). Each group gets its own block table; "shared" builds the later groups with
`share_with=` the first (one layout per window per step), "separate" builds every group from scratch.
It also times the torch path's gather plan, which the first layer of each group builds.

    python benchmarks/metadata.py
"""

from __future__ import annotations

import random
import time

import torch

from hybridkv.kernels import PagedAttentionMetadata
from hybridkv.utils import cdiv

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


def build_step(query_lens, seq_lens, group_tables, windows, shared: bool) -> None:
    first = None
    for rows, window in zip(group_tables, windows, strict=True):
        metadata = PagedAttentionMetadata.build(query_lens, seq_lens, rows, BLOCK_SIZE, share_with=first)
        if shared:
            first = first or metadata
        metadata.torch_plan(window)


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'step':<8}{'groups':>7}{'separate ms':>13}{'shared ms':>11}")
    for kind in ("decode", "mixed"):
        query_lens, seq_lens = step(kind)
        for windows in ([None], [WINDOW] * 6 + [None]):
            group_tables = tables(seq_lens, len(windows))
            timings = []
            for shared in (False, True):
                build_step(query_lens, seq_lens, group_tables, windows, shared)
                runs = []
                for _ in range(20):
                    start = time.perf_counter()
                    build_step(query_lens, seq_lens, group_tables, windows, shared)
                    runs.append(time.perf_counter() - start)
                timings.append(min(runs) * 1e3)
            print(f"{kind:<8}{len(windows):>7}{timings[0]:>13.2f}{timings[1]:>11.2f}")


if __name__ == "__main__":
    main()
