"""A decode step's two fast paths change nothing but speed: the scheduler planning the last decode batch again
(`Scheduler._schedule_decode_batch`, with `KVCacheCoordinator.decode_needs` saying which requests start a block),
and the engine updating a step of `greedy_alone` requests in one pass (`OutputProcessor.record_alone`). Two engines on
two copies of one model, one with both turned off, take the same seeded random operations (greedy and sampled
requests, n > 1, stop tokens, stop strings, min_tokens, aborts, requests arriving mid-batch, a pool small enough
to preempt, both preemption modes) and must agree after every step on what it reports, the queues, every block
table and the pool's free queue and cached hashes; the fast paths must have been taken."""

from __future__ import annotations

import random

import pytest

import hybridkv
from hybridkv import SamplingParams

from alloc_helpers import free_order
from tiny_models import FAMILIES, new_request_id
from tiny_tokenizer import tiny_tokenizer


def _without_fast_paths(engine) -> None:
    scheduler = engine.core.scheduler
    scheduler._schedule_decode_batch = lambda out: False
    schedule = scheduler.schedule

    def general_plan():
        plan = schedule()
        plan.greedy_alone = False  # the engine's general update, and sampling through sample_each
        return plan

    scheduler.schedule = general_plan


def _report(outputs) -> list[tuple | None]:
    return [
        None
        if o is None
        else (
            o.request_id,
            o.finished,
            o.error,
            o.metrics.num_cached_tokens,
            o.metrics.first_token_time is None,
            [(c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs],
        )
        for o in outputs
    ]


def _state(engine) -> tuple:
    scheduler, coordinator = engine.core.scheduler, engine.core.coordinator
    running = [r.request_id for r in scheduler.running]
    return (
        running,
        [r.request_id for r in scheduler.waiting],
        [r.request_id for r in scheduler.swapped],
        {r: [list(row) for row in coordinator.block_ids(r)] for r in running},
        {r.request_id: (r.num_computed_tokens, list(r.token_ids)) for r in scheduler.running},
        free_order(coordinator),
        [sorted((h, b.block_id) for h, b in group.items()) for group in coordinator.pool.cached],
    )


def _params(rng: random.Random) -> SamplingParams:
    kind = rng.random()
    max_tokens = rng.randint(1, 24)
    if kind < 0.55:  # plain greedy: what the fast paths serve
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=rng.random() < 0.5)
    if kind < 0.7:  # greedy with stop rules
        return SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            min_tokens=rng.randint(0, 3),
            stop_token_ids=[rng.randrange(256) for _ in range(3)],
            stop=[" the", "e"] if rng.random() < 0.5 else None,
        )
    if kind < 0.85:  # sampled, seeded
        return SamplingParams(temperature=1.0, seed=rng.randrange(100), max_tokens=max_tokens)
    if kind < 0.93:  # n samples of one prompt
        return SamplingParams(n=2, temperature=1.0, seed=rng.randrange(100), max_tokens=max_tokens)
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)  # greedy, but with logprobs


@pytest.mark.parametrize(
    ("seed", "mode", "caching", "chunk"),
    [(0, "recompute", True, 0), (1, "swap", True, 0),
     pytest.param(2, "recompute", False, 0, marks=pytest.mark.slow),
     pytest.param(3, "swap", False, 0, marks=pytest.mark.slow),
     (4, "recompute", True, 1),
     pytest.param(5, "swap", True, 2, marks=pytest.mark.slow)],
)  # fmt: skip
def test_decode_fast_paths_change_nothing(seed: int, mode: str, caching: bool, chunk: int) -> None:
    """`chunk` caps every prefill chunk (1: a prompt is computed a token a step, as a decode is, but samples nothing
    until its last one)."""
    rng = random.Random(seed)
    settings = dict(
        block_size=4, max_model_len=96, max_num_batched_tokens=24, enable_prefix_caching=caching,
        long_prefill_token_threshold=chunk,
    )  # fmt: skip
    models = [FAMILIES["ministral"]() for _ in range(2)]  # sliding and full layers, the same weights
    num_blocks = hybridkv.min_num_blocks(models[0], **settings) + 10
    engine_settings = dict(settings, num_blocks=num_blocks, preemption_mode=mode, swap_space=1 / 1024, max_num_seqs=8)
    fast, reference = (hybridkv.patch(model, tokenizer=tiny_tokenizer(), **engine_settings) for model in models)
    _without_fast_paths(reference)
    taken = {"batch": 0, "alone": 0}
    batch_again, update_alone = fast.core.scheduler._schedule_decode_batch, fast._finish_alone

    def counted_batch(out):
        done = batch_again(out)
        taken["batch"] += done
        return done

    def counted_alone(plan, tokens):
        taken["alone"] += 1
        return update_alone(plan, tokens)

    fast.core.scheduler._schedule_decode_batch = counted_batch
    fast._finish_alone = counted_alone
    ids: list[str] = []
    prefix = [rng.randrange(1, 256) for _ in range(10)]
    for _ in range(160):
        action = rng.random()
        if action < 0.12 or not ids:
            prompt = (prefix if rng.random() < 0.5 else [])[: rng.randint(0, 10)]
            prompt += [rng.randrange(1, 256) for _ in range(rng.randint(1, 20))]
            params = _params(rng)
            ids.append(fast.add_request(new_request_id(), prompt, params))
            assert reference.add_request(ids[-1], prompt, params) == ids[-1]
        elif action < 0.15:
            request_id = rng.choice(ids)
            assert _report([fast.abort(request_id)]) == _report([reference.abort(request_id)])
        else:
            assert _report(fast.step()) == _report(reference.step())
        assert _state(fast) == _state(reference)
    while reference.has_unfinished_requests():
        assert _report(fast.step()) == _report(reference.step())
        assert _state(fast) == _state(reference)
    assert not fast.has_unfinished_requests()
    assert taken["batch"] > 5 and taken["alone"] > 10, taken
