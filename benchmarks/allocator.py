"""Allocator micro-benchmark: the memory manager's cost per request and per block, hashing included.

Workload (issue 2): 10,000 requests x 2,048 prompt tokens, block size 16, 32 requests held at once,
a pool of 65,536 blocks (so cached blocks get evicted), prefix-hit rates 0% and 50% (8 shared
1,024-token prefixes + 1,024 unique tokens), full attention only and hybrid (1 full + 3 sliding
groups, window 1,024), with one allocation per prompt and with 4 chunks of 512.

Per request it times exactly what an engine does: build the request (hashes its full blocks),
look up the prefix cache, allocate, give the pool's free blocks to sliding windows' chunk middles
(the scheduler's `use_slack_for_caching` once a step's allocations are made), mark computed (cache
full blocks, return out-of-window ones), and finally free. Each row starts after a full garbage
collection and closes its pool at the end: a collection of the torch-sized heap (~200 ms, 100 us a
request at 2,000 requests) otherwise fell inside whichever rows the allocation counts put it in.

The reference is vLLM 0.33's pure-Python allocator on this class of machine, as quoted in issue 2
(vLLM is not installable here): ~540 us per request full-only at 0% hits, ~2,200 us hybrid, plus
~3.5 us per block for hashing.

Decode steps (`--decode`): what a decode step costs the coordinator, 32 requests of 300-331 prompt tokens
decoding 800 tokens each, one token a step, in 1 full + 5 sliding groups (window 256, the benchmarks' hybrid
model's layout): `allocate_slots` of every request, microseconds per step, with the one-block-size fast path
(`_append_one_block`) and without it (the general path it stands for), and the update after it
(`update_computed_many`) with its parts run only where they change something and a filled block cached in every
group in one pool call (`_cache_one_block`), and with both parts run wherever either can, group by group (as before
the split), alternated in one process; the block tables must come out the same.

    python benchmarks/allocator.py [--requests 10000]
    python benchmarks/allocator.py --decode [--pairs 6]
    python benchmarks/allocator.py --pool 262143 [--pairs 6]   # a pool's blocks made (patch()'s start-up)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import deque

from hybridkv.memory.block_pool import BlockPool, KVBlock, make_blocks
from hybridkv.memory.coordinator import KVCacheCoordinator
from hybridkv.memory.grouping import group_layers
from hybridkv.memory.integrity import check_coordinator
from hybridkv.memory.kv_request import KVRequest
from hybridkv.memory.kv_spec import LayerSpec

BLOCK_SIZE = 16
PROMPT_TOKENS = 2048
HELD_AT_ONCE = 32
NUM_BLOCKS = 65_536
WINDOW = 1024
VLLM_US_PER_REQUEST = {"full": 540.0, "hybrid": 2200.0}
VLLM_HASH_US_PER_BLOCK = 3.5


def model_specs(kind: str) -> list[LayerSpec]:
    windows = [None] if kind == "full" else [None, WINDOW, WINDOW, WINDOW]
    return [LayerSpec(i, w, num_kv_heads=8, head_dim=128, dtype_bytes=2) for i, w in enumerate(windows)]


def prompt(i: int, hit_rate: float) -> list[int]:
    if hit_rate == 0.0:
        return list(range(i * PROMPT_TOKENS, (i + 1) * PROMPT_TOKENS))
    shared = 1_000_000_000 + (i % 8) * 1024
    unique = i * 1024
    return list(range(shared, shared + 1024)) + list(range(unique, unique + 1024))


def run(kind: str, hit_rate: float, num_chunks: int, num_requests: int) -> dict[str, float]:
    coordinator = KVCacheCoordinator(group_layers(model_specs(kind), BLOCK_SIZE), NUM_BLOCKS)
    chunk = PROMPT_TOKENS // num_chunks
    held: deque[str] = deque()
    peak_blocks = 0
    elapsed = 0.0
    gc.collect()
    for i in range(num_requests):
        tokens = prompt(i, hit_rate)
        start = time.perf_counter()
        request = KVRequest(f"r{i}", tokens, BLOCK_SIZE)
        hit = coordinator.find_longest_cache_hit(request)
        computed = hit.num_tokens
        while computed < PROMPT_TOKENS:
            num_new = min(chunk, PROMPT_TOKENS - computed)
            ok = coordinator.allocate_slots(request, num_new, hit if request.num_computed_tokens == 0 else None)
            assert ok, "the benchmark pool must fit 32 requests"
            coordinator.use_slack_for_caching()
            elapsed += time.perf_counter() - start
            held_blocks = sum(m.num_real_blocks(request.request_id) for m in coordinator.managers)
            peak_blocks = max(peak_blocks, held_blocks)
            start = time.perf_counter()
            computed += num_new
            request.num_computed_tokens = computed
            coordinator.update_computed(request)
        held.append(request.request_id)
        if len(held) > HELD_AT_ONCE:
            coordinator.free(held.popleft())
        elapsed += time.perf_counter() - start
    while held:
        coordinator.free(held.popleft())
    check_coordinator(coordinator)
    stats = coordinator.stats()
    coordinator.pool.close()
    blocks_per_request = PROMPT_TOKENS // BLOCK_SIZE * len(coordinator.managers)
    return {
        "us_per_request": elapsed / num_requests * 1e6,
        "us_per_block": elapsed / num_requests / blocks_per_request * 1e6,
        "hit_rate": stats.prefix_cache_hit_rate,
        "evictions": stats.num_evictions,
        "peak_blocks_per_request": peak_blocks,
    }


def hashing_us_per_block(num_requests: int = 200) -> float:
    start = time.perf_counter()
    for i in range(num_requests):
        KVRequest(f"h{i}", prompt(i, 0.0), BLOCK_SIZE)
    return (time.perf_counter() - start) / (num_requests * PROMPT_TOKENS // BLOCK_SIZE) * 1e6


def decode_steps(fast_path: bool, num_steps: int = 800) -> tuple[float, float, list]:
    """Microseconds per decode step in allocation and in the update, and the block tables at the end."""
    specs = [LayerSpec(i, w, num_kv_heads=8, head_dim=128, dtype_bytes=2) for i, w in enumerate([None] + [256] * 5)]
    coordinator = KVCacheCoordinator(group_layers(specs, BLOCK_SIZE), 12_000)
    if not fast_path:
        coordinator._append_one_block = lambda request_id, num_total: False
        coordinator._cache_one_block = lambda request_id, block_hashes, num_computed: False
        update_computed = coordinator.update_computed

        def update_both(request: KVRequest) -> None:  # an update that runs runs both of its parts
            coordinator._next_change.pop(request.request_id, None)
            update_computed(request)

        coordinator.update_computed = update_both
    requests = [KVRequest(f"r{i}", [(i * 7919 + t) % 50_000 for t in range(300 + i)], BLOCK_SIZE) for i in range(32)]
    for request in requests:
        assert coordinator.allocate_slots(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
        coordinator.update_computed(request)
    gc.collect()
    allocate = update = 0.0
    for step in range(num_steps):
        start = time.perf_counter()
        for request in requests:
            assert coordinator.allocate_slots(request, 1), "the benchmark pool must fit every request"
        allocate += time.perf_counter() - start
        for request in requests:
            request.num_computed_tokens += 1
            request.append_token((step * 31 + len(request.token_ids)) % 50_000)
        start = time.perf_counter()
        coordinator.update_computed_many(requests)
        update += time.perf_counter() - start
        coordinator.take_table_updates()
    check_coordinator(coordinator)
    return allocate / num_steps * 1e6, update / num_steps * 1e6, [coordinator.block_ids(r.request_id) for r in requests]


def decode_main(pairs: int) -> None:
    results: dict[bool, list[tuple[float, float, list]]] = {True: [], False: []}
    for pair in range(pairs):
        for fast in (True, False) if pair % 2 else (False, True):
            results[fast].append(decode_steps(fast))
    assert all(r[2] == results[True][0][2] for runs in results.values() for r in runs), "the block tables differ"
    general, fast = (statistics.median(r[0] for r in results[f]) for f in (False, True))
    ratios = [f[0] / g[0] for f, g in zip(results[True], results[False], strict=True)]
    print(
        f"decode step, 32 requests, 6 groups, allocation: general path {general:.1f} us, fast path {fast:.1f} us; "
        f"fast / general per pair {' '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.2f}"
    )
    general, fast = (statistics.median(r[1] for r in results[f]) for f in (False, True))
    ratios = [f[1] / g[1] for f, g in zip(results[True], results[False], strict=True)]
    print(
        f"decode step, 32 requests, 6 groups, update: both parts, group by group {general:.1f} us, "
        f"fast path {fast:.1f} us; "
        f"fast / general per pair {' '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.2f}"
    )


def pool_main(num_blocks: int, pairs: int) -> None:
    """A pool's blocks made as `BlockPool` makes them (`make_blocks`: the cycle collector paused) and with the collector
    running, alternated; then a whole `BlockPool` (its free queue's links too)."""
    times: dict[str, list[float]] = {"paused": [], "running": []}
    for pair in range(pairs):
        for way in ("paused", "running") if pair % 2 else ("running", "paused"):
            gc.collect()
            start = time.perf_counter()
            blocks = make_blocks(num_blocks) if way == "paused" else [KVBlock(i) for i in range(num_blocks)]
            times[way].append(time.perf_counter() - start)
            del blocks
    ratios = [r / p for r, p in zip(times["running"], times["paused"], strict=True)]
    gc.collect()
    start = time.perf_counter()
    BlockPool(num_blocks, 6)
    pool_seconds = time.perf_counter() - start
    print(
        f"{num_blocks:,} blocks: collector running {statistics.median(times['running']):.3f} s, paused "
        f"{statistics.median(times['paused']):.3f} s; running / paused per pair "
        f"{' '.join(f'{r:.1f}' for r in ratios)}, median {statistics.median(ratios):.1f}x; "
        f"a whole BlockPool of 6 groups {pool_seconds:.3f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--decode", action="store_true", help="decode steps, with and without the fast path")
    parser.add_argument("--pool", type=int, help="time making a pool of this many blocks (patch()'s start-up)")
    parser.add_argument("--pairs", type=int, default=6)
    args = parser.parse_args()
    if args.decode:
        decode_main(args.pairs)
        return
    if args.pool:
        pool_main(args.pool, args.pairs)
        return
    hash_us = hashing_us_per_block()
    print(f"hashing alone: {hash_us:.2f} us per block (vLLM reference {VLLM_HASH_US_PER_BLOCK} us)")
    header = (
        f"{'model':<7}{'hits':>6}{'chunks':>7}{'us/req':>9}{'us/block':>10}{'hit rate':>10}"
        f"{'evictions':>11}{'peak blk/req':>14}{'vLLM us/req':>13}{'speedup':>9}"
    )
    print(header)
    for kind in ("full", "hybrid"):
        for hit_rate in (0.0, 0.5):
            for num_chunks in (1, 4):
                r = run(kind, hit_rate, num_chunks, args.requests)
                blocks = PROMPT_TOKENS // BLOCK_SIZE
                vllm = VLLM_US_PER_REQUEST[kind] + VLLM_HASH_US_PER_BLOCK * blocks
                print(
                    f"{kind:<7}{hit_rate:>6.0%}{num_chunks:>7}{r['us_per_request']:>9.0f}{r['us_per_block']:>10.2f}"
                    f"{r['hit_rate']:>10.1%}{r['evictions']:>11}{r['peak_blocks_per_request']:>14.0f}"
                    + (f"{vllm:>13.0f}{vllm / r['us_per_request']:>8.1f}x" if hit_rate == 0.0 else f"{'-':>13}{'-':>9}")
                )
    print("vLLM us/req = the issue's reference per-request cost + 3.5 us x 128 blocks of hashing (0% hits only).")


if __name__ == "__main__":
    main()
