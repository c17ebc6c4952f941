"""The coordinator's fast paths change nothing but speed: `_append_one_block` (one block size, a step that needs one
more block in every group), `_cache_one_block` (one block size, an update that caches one more block in every
group) and `update_computed`'s parts run only where they can change something (caching where a block filled,
returning blocks where a window or chunk start passed one or a step is pending). Two coordinators, one with all of
them turned off (every update caches group by group and returns in every group), take the same random engine-like
operations and must agree on every result, block table, free-queue order, cached hash and eviction count after
each."""

from __future__ import annotations

import random

import pytest

from hybridkv.memory.integrity import check_coordinator
from hybridkv.memory.kv_request import KVRequest

from alloc_helpers import free_order, make_coordinator, run_prefill

LAYOUTS = [
    ([None, 8, 8], 2),
    ([None, 6, 6, 6], 4),
    (["c8", None, 12], 4),
    ([5, 5], 2),
    ([None, 3], 4),  # a window within a block: the step's own block may be the first it needs
]


def _without_fast_paths(coordinator) -> None:
    coordinator._append_one_block = lambda request_id, num_total: False
    coordinator._cache_one_block = lambda request_id, block_hashes, num_computed: False
    update = coordinator.update_computed

    def update_everything(request) -> None:  # as if the request had never been updated: both parts run
        coordinator._next_change.pop(request.request_id, None)
        update(request)

    coordinator.update_computed = update_everything
    coordinator.update_computed_many = lambda requests: [update_everything(request) for request in requests]


def _state(coordinator, request_ids) -> tuple:
    pool = coordinator.pool
    return (
        {r: [list(row) for row in coordinator.block_ids(r)] for r in request_ids},
        free_order(coordinator),
        [sorted((h, b.block_id) for h, b in group.items()) for group in pool.cached],
        pool.num_evictions,
        [dict(m.num_cached_blocks) for m in coordinator.managers],
    )


def _run(seed: int, windows, block_size: int, caching: bool) -> tuple[int, int, int]:
    rng = random.Random(seed)
    num_blocks = rng.randint(14, 40)
    twins = [make_coordinator(windows, num_blocks, block_size, caching) for _ in range(2)]
    _without_fast_paths(twins[1])
    requests: list[dict[str, KVRequest]] = [{}, {}]
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 7, 7, 7, 7]]
    num_fast = num_cached_fast = num_ops = 0
    original = type(twins[0])._append_one_block
    original_cache = type(twins[0])._cache_one_block

    def counted(self, request_id, num_total):
        nonlocal num_fast
        done = original(self, request_id, num_total)
        num_fast += done
        return done

    def counted_cache(self, request_id, block_hashes, num_computed):
        nonlocal num_cached_fast
        done = original_cache(self, request_id, block_hashes, num_computed)
        num_cached_fast += done
        return done

    twins[0]._append_one_block = counted.__get__(twins[0])
    twins[0]._cache_one_block = counted_cache.__get__(twins[0])
    for index in range(220):
        action = rng.random()
        if action < 0.15 or not requests[0]:
            prompt = rng.choice(prefixes)[: rng.randint(0, 9)] + [rng.randint(0, 6) for _ in range(rng.randint(1, 12))]
            request_id = f"r{index}"
            share = rng.random()
            results = []
            for coordinator, held in zip(twins, requests, strict=True):
                request = KVRequest(request_id, list(prompt), block_size if caching else None)
                hit = coordinator.find_longest_cache_hit(request)
                chunk = max(1, round(share * (request.num_tokens - hit.num_tokens)))
                ok = coordinator.allocate_slots(request, chunk, hit)
                if ok:
                    coordinator.use_slack_for_caching()
                    request.num_computed_tokens = hit.num_tokens + chunk
                    coordinator.update_computed(request)
                    held[request_id] = request
                results.append((ok, hit.num_tokens))
            assert results[0] == results[1]
        elif action < 0.25:
            request_id = rng.choice(sorted(requests[0]))
            for coordinator, held in zip(twins, requests, strict=True):
                coordinator.free(request_id)
                del held[request_id]
        else:  # a step of a few running requests: prompt chunks or one decoded token each
            chosen = rng.sample(sorted(requests[0]), min(len(requests[0]), rng.randint(1, 4)))
            sizes = {r: rng.randint(1, 5) for r in chosen}
            tokens = {r: rng.randint(0, 6) for r in chosen}
            outcomes = []
            for coordinator, held in zip(twins, requests, strict=True):
                ran = []
                for request_id in chosen:
                    request = held[request_id]
                    num_new = min(sizes[request_id], request.num_tokens - request.num_computed_tokens) or 1
                    if request.num_computed_tokens == request.num_tokens:
                        request.append_token(tokens[request_id])
                    if coordinator.allocate_slots(request, num_new):
                        ran.append((request, num_new))
                coordinator.use_slack_for_caching()
                for request, num_new in ran:
                    request.num_computed_tokens += num_new
                coordinator.update_computed_many([request for request, _ in ran])
                coordinator.take_table_updates()
                outcomes.append([(request.request_id, num_new) for request, num_new in ran])
            assert outcomes[0] == outcomes[1]
        num_ops += 1
        for coordinator in twins:
            check_coordinator(coordinator)
        assert _state(twins[0], sorted(requests[0])) == _state(twins[1], sorted(requests[1])), f"op {index}"
    return num_fast, num_cached_fast, num_ops


@pytest.mark.parametrize(("windows", "block_size"), LAYOUTS)
@pytest.mark.parametrize("caching", [True, False])
def test_fast_path_gives_the_general_paths_blocks(windows, block_size, caching):
    num_fast = num_cached_fast = 0
    for seed in range(6):
        fast, cached_fast, _ = _run(seed, windows, block_size, caching)
        num_fast += fast
        num_cached_fast += cached_fast
    assert num_fast > 20  # the fast paths were taken, often
    assert num_cached_fast > 20 if caching else num_cached_fast == 0


@pytest.mark.parametrize(
    ("windows", "kv_heads"),
    [([None, 8, 8], None), ([5, None, 5, 3, None], [2, 1, 2, 4, 1])],  # one block size; three (2, 4 and 8 tokens)
)
def test_decode_needs_names_the_requests_allocate_slots_would_not_pass_at_its_first_test(windows, kv_heads):
    """`decode_needs` asks each group once for the whole batch; it must name exactly the requests whose one token
    `_needs_nothing` does not pass, in order, with one block size or several (the group reaching least decides)."""
    rng = random.Random(0)
    coordinator = make_coordinator(windows, 200, 2, kv_heads=kv_heads)
    assert coordinator._one_block_size == (kv_heads is None)
    requests = []
    for index in range(6):
        request = KVRequest(f"r{index}", [rng.randint(0, 6) for _ in range(rng.randint(1, 20))], 2)
        assert run_prefill(coordinator, request)
        requests.append(request)
    num_named = 0
    for _ in range(40):
        for request in requests:
            request.append_token(rng.randint(0, 6))
        needs = coordinator.decode_needs(requests)
        expected = [r for r in requests if not coordinator._needs_nothing(r.request_id, r.num_computed_tokens + 1)]
        assert needs == expected
        num_named += len(needs)
        for request in requests:
            assert coordinator.allocate_slots(request, 1)
            request.num_computed_tokens += 1
        coordinator.update_computed_many(requests)
    assert 0 < num_named < 40 * len(requests)  # some steps start a block, most do not
    requests[0].append_token(1)
    requests[0].append_token(1)  # two tokens short: not a decode step of one token
    assert coordinator.decode_needs(requests) is None
