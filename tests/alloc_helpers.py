"""Builders shared by the memory-manager tests."""

from __future__ import annotations

from hybridkv.memory.coordinator import KVCacheCoordinator
from hybridkv.memory.grouping import group_layers
from hybridkv.memory.kv_request import KVRequest
from hybridkv.memory.kv_spec import LayerSpec


def specs(windows: list[int | str | None], kv_heads: list[int] | None = None) -> list[LayerSpec]:
    """One layer per entry: None = full attention, W = sliding window W, "cC" = chunked local attention
    in chunks of C; 2 kv heads of 8 dims unless `kv_heads` gives each layer's (layers of fewer heads get
    larger blocks)."""
    heads = kv_heads or [2] * len(windows)
    layers = []
    for i, (window, num_heads) in enumerate(zip(windows, heads, strict=True)):
        chunk = int(window[1:]) if isinstance(window, str) else None
        window = None if chunk else window
        layers.append(LayerSpec(i, window, num_heads, 8, 2, attention_chunk_size=chunk))
    return layers


def make_coordinator(
    windows: list[int | str | None],
    num_blocks: int,
    block_size: int = 4,
    enable_caching: bool = True,
    kv_heads: list[int] | None = None,
) -> KVCacheCoordinator:
    return KVCacheCoordinator(group_layers(specs(windows, kv_heads), block_size), num_blocks, enable_caching)


def run_prefill(coordinator: KVCacheCoordinator, request: KVRequest) -> bool:
    """Look up the cache, allocate the whole rest of the prompt (and, as the scheduler does once a step's
    allocations are made, the free blocks for windows' middles) and mark it computed, as one step."""
    hit = coordinator.find_longest_cache_hit(request)
    if not coordinator.allocate_slots(request, request.num_tokens - hit.num_tokens, hit):
        return False
    coordinator.use_slack_for_caching()
    request.num_computed_tokens = request.num_tokens
    coordinator.update_computed(request)
    return True


def free_order(coordinator: KVCacheCoordinator) -> list[int]:
    return [b.block_id for b in coordinator.pool.free_queue]


def restore_layout(manager, request_id: str, real: list[bool]) -> None:
    """Give a request that holds nothing a fresh block at each True position and the null block elsewhere
    (as a swap-in does), in the order the pool hands blocks out."""
    fresh = iter(manager.pool.get_new_blocks(sum(real)))
    manager.restore(request_id, [next(fresh) if is_real else manager.pool.null_block for is_real in real])
