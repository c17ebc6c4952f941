"""benchmarks/tiered_cache.py's sessions workload: the figures the tiers are measured against. Eight sessions
round robin, six turns: with every block kept, turns 2-6 hit their whole previous sequence's full blocks; a pool of
a quarter of the final history (what the benchmark computes) keeps none of them (LRU under a cyclic workload),
and the tokens are the same."""

import importlib
import sys
from pathlib import Path

import pytest

import hybridkv
from hybridkv.tiny import tiny_model


@pytest.fixture(scope="module")
def tiered_cache():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        yield importlib.import_module("tiered_cache")
    finally:
        sys.path.pop(0)


@pytest.mark.slow
def test_a_quarter_pool_hits_nothing_that_an_unbounded_pool_hits(tiered_cache, patched):
    model = tiny_model("llama")
    unbounded = patched(model, block_size=16, num_blocks=10_000)
    pool_blocks = tiered_cache.SESSIONS * tiered_cache.history_blocks(unbounded, tiered_cache.FINAL_TOKENS) // 4
    unbounded_tokens, unbounded_cached, _ = tiered_cache.run_sessions(unbounded, model.config.vocab_size)
    pool = patched(model, block_size=16, num_blocks=pool_blocks)
    pool_tokens, pool_cached, _ = tiered_cache.run_sessions(pool, model.config.vocab_size)
    # Turn t (t >= 2) follows a 224 + 32 (t - 2) token sequence: its full blocks, 208 + 32 (t - 2) tokens.
    assert pool_blocks == 48
    assert unbounded_cached == [[0, 208, 240, 272, 304, 336]] * tiered_cache.SESSIONS
    assert pool_cached == [[0] * tiered_cache.TURNS] * tiered_cache.SESSIONS
    assert pool_tokens == unbounded_tokens


@pytest.mark.slow
def test_window_aware_eviction_keeps_every_session_of_a_sliding_model_in_a_quarter_pool(tiered_cache, patched):
    """Gemma 3's sliding groups: with plain LRU a quarter pool hits nothing; with window-aware eviction (what a
    window left behind goes first, a finished request's prefix end is kept) every turn hits as with every block."""
    from hybridkv.memory.coordinator import KVCacheCoordinator

    model = tiny_model("gemma3")
    unbounded = patched(model, block_size=16, num_blocks=10_000)
    pool_blocks = tiered_cache.SESSIONS * tiered_cache.history_blocks(unbounded, tiered_cache.FINAL_TOKENS) // 4
    unbounded_tokens, unbounded_cached, _ = tiered_cache.run_sessions(unbounded, model.config.vocab_size)
    hybridkv.unpatch(model)
    results = {}
    for window_aware in (False, True):
        KVCacheCoordinator.window_aware_eviction = window_aware
        try:
            pool = patched(model, block_size=16, num_blocks=pool_blocks)
            results[window_aware] = tiered_cache.run_sessions(pool, model.config.vocab_size)[:2]
            pool.core.coordinator.pool.check_integrity()
            hybridkv.unpatch(model)
        finally:
            KVCacheCoordinator.window_aware_eviction = True
    assert results[False][1] == [[0] * tiered_cache.TURNS] * tiered_cache.SESSIONS
    assert results[True][1] == unbounded_cached
    assert results[False][0] == results[True][0] == unbounded_tokens
