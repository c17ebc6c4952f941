"""The `hybridkv` command line."""

from __future__ import annotations

import argparse
import random

from hybridkv.coordinator import KVCacheCoordinator
from hybridkv.grouping import group_layers
from hybridkv.kv_spec import LayerSpec
from hybridkv.request import KVRequest


def demo(num_requests: int, seed: int) -> None:
    """Serve a simulated workload on a Gemma-3-1B-shaped layout (26 layers, 5 sliding : 1 full,
    window 512) and show what the hybrid memory manager holds compared with a full-attention cache."""
    block_size, window = 16, 512
    windows = [None if (i + 1) % 6 == 0 else window for i in range(26)]
    specs = [LayerSpec(i, w, num_kv_heads=1, head_dim=256, dtype_bytes=2) for i, w in enumerate(windows)]
    config = group_layers(specs, block_size)
    coordinator = KVCacheCoordinator(config, num_blocks=4096)
    print(f"layers: {len(specs)} ({windows.count(None)} full, {len(specs) - windows.count(None)} sliding, W={window})")
    print(
        f"groups: {len(config.groups)} of {config.group_size} layers, {config.padding_layers} padding slots "
        f"({config.padding_fraction:.1%} of KV memory); block = {config.block_bytes / 1024:.0f} KiB"
    )
    rng = random.Random(seed)
    system_prompt = [rng.randrange(32_000) for _ in range(1024)]
    requests = []
    for i in range(num_requests):
        prompt = system_prompt + [rng.randrange(32_000) for _ in range(rng.randrange(200, 2000))]
        request = KVRequest(f"req-{i}", prompt, block_size)
        hit = coordinator.find_longest_cache_hit(request)
        if not coordinator.allocate_slots(request, request.num_tokens - hit.num_tokens, hit):
            print(f"req-{i}: pool full, would wait")
            continue
        request.num_computed_tokens = request.num_tokens
        coordinator.update_computed(request)
        requests.append(request)
        print(f"req-{i}: {request.num_tokens:>5} prompt tokens, {hit.num_tokens:>5} from the prefix cache")
    stats = coordinator.stats()
    held_bytes = stats.blocks_in_use * config.block_bytes
    full_bytes = sum(r.num_tokens for r in requests) * specs[0].kv_bytes_per_token * len(specs)
    print(f"blocks in use per group: {stats.blocks_in_use_per_group}")
    print(
        f"KV held: {held_bytes / 2**20:.1f} MiB vs {full_bytes / 2**20:.1f} MiB for a full-attention cache "
        f"of the same tokens ({full_bytes / held_bytes:.1f}x less)"
    )
    print(f"prefix cache: {stats.prefix_cache_hits} of {stats.prefix_cache_queries} prompt tokens hit")
    for request in requests:
        coordinator.free(request.request_id)
    coordinator.check_integrity()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridkv", description="hybridkv command line")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="a short demonstration on a simulated workload")
    demo_parser.add_argument("--requests", type=int, default=8)
    demo_parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo(args.requests, args.seed)
    return 0
