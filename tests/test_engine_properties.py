"""Stateful property test: random add (n samples, best_of, beam searches) / step / abort / stream and
close / bad input / Ctrl-C inside a step against a tiny hybrid model, in both preemption modes and tiny
pools, with async scheduling on and off, checking after every rule the memory manager's integrity, that no
step writes a shared block, that no block leaks and that no output is orphaned: every request is reported
finished exactly once."""

from __future__ import annotations

import gc

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import hybridkv
from hybridkv import BeamSearchParams, SamplingParams
from hybridkv.memory.integrity import check_coordinator
from hybridkv.tiny import tiny_model

from tiny_models import new_request_id

MODEL = tiny_model(
    "ministral",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    sliding_window=6,
    max_position_embeddings=128,
    layer_types=["sliding_attention", "full_attention"],
)


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = None
        self.ids: list[str] = []
        self.finished: dict[str, int] = {}  # request id -> times reported finished (by step or abort)

    @precondition(lambda self: self.engine is None)
    @rule(
        mode=st.sampled_from(["recompute", "swap"]),
        extra_blocks=st.integers(0, 12),
        caching=st.booleans(),
        ahead=st.booleans(),
    )
    def build(self, mode, extra_blocks, caching, ahead):
        settings_ = dict(block_size=4, max_model_len=48, max_num_batched_tokens=16, enable_prefix_caching=caching)
        minimum = hybridkv.min_num_blocks(MODEL, **settings_)
        self.engine = hybridkv.patch(
            MODEL,
            **settings_,
            num_blocks=minimum + extra_blocks,
            preemption_mode=mode,
            swap_space=1 / 1024,
            async_scheduling=ahead,  # a step planned before the last one's tokens are read
            # (hybridkv/engine/async_steps.py)
        )
        scheduler = self.engine.core.scheduler
        schedule = scheduler.schedule

        def checked_schedule():
            plan = schedule()
            scheduler.check_plan(plan)
            return plan

        scheduler.schedule = checked_schedule

    @precondition(lambda self: self.engine is not None)
    @rule(
        length=st.integers(1, 40),
        shared=st.booleans(),
        max_tokens=st.integers(1, 8),
        n=st.integers(1, 3),
        kind=st.sampled_from(["sample", "sample", "best_of", "beam"]),
        temperature=st.sampled_from([0.0, 1.0]),
    )
    def add(self, length, shared, max_tokens, n, kind, temperature):
        prompt = ([7] * 12 + list(range(length)))[:40] if shared else [(3 * i + length) % 64 for i in range(length)]
        if kind == "beam":
            params = BeamSearchParams(beam_width=n, max_tokens=max_tokens)
        else:
            best_of = n + 1 if kind == "best_of" else None
            params = SamplingParams(n=n, best_of=best_of, temperature=temperature, seed=length, max_tokens=max_tokens)
        self.ids.append(self.engine.add_request(new_request_id(), prompt, params))

    @precondition(lambda self: self.engine is not None)
    @rule()
    def step(self):
        self.report(self.engine.step())

    @precondition(lambda self: self.engine is not None and self.ids)
    @rule(index=st.integers(0, 50))
    def abort(self, index):
        self.report([self.engine.abort(self.ids[index % len(self.ids)])])

    @precondition(lambda self: self.engine is not None)
    @rule(length=st.integers(1, 30), reads=st.integers(0, 3), drop=st.booleans())
    def stream_then_close_or_drop(self, length, reads, drop):
        stream = self.engine.stream(
            [(5 * i + 1) % 64 for i in range(length)], SamplingParams(max_tokens=6, seed=length)
        )
        request_id = stream.request_id
        for _ in zip(range(reads), stream, strict=False):
            pass
        if drop:
            del stream
            gc.collect()
        else:
            stream.close()
        assert request_id not in self.engine.outputs.states

    @precondition(lambda self: self.engine is not None)
    @rule(bad=st.sampled_from([[], [1, 64], [1, "x"], None, [1.5], "text without a tokenizer"]))
    def bad_input(self, bad):
        before = set(self.engine.outputs.states)
        with pytest.raises((ValueError, TypeError)):
            self.engine.add_request(new_request_id(), bad, SamplingParams(max_tokens=2))
        with pytest.raises((ValueError, TypeError)):
            self.engine.generate([[1, 2, 3], bad], SamplingParams(max_tokens=2), use_tqdm=False)
        assert set(self.engine.outputs.states) == before

    @precondition(lambda self: self.engine is not None)
    @rule()
    def ctrl_c_inside_a_step(self):
        runner = self.engine.core.runner

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        runner.execute = interrupted
        try:
            self.report(self.engine.step())  # nothing to compute: no forward to interrupt
        except KeyboardInterrupt:
            pass
        finally:
            del runner.execute

    def report(self, outputs):
        for output in outputs:
            if output is not None and output.finished:
                self.finished[output.request_id] = self.finished.get(output.request_id, 0) + 1
                assert self.finished[output.request_id] == 1, f"{output.request_id} reported finished twice"

    @invariant()
    def memory_manager_is_consistent(self):
        if self.engine is None:
            return
        scheduler = self.engine.core.scheduler
        holding = {r.request_id: r for r in scheduler.running}
        check_coordinator(self.engine.core.coordinator, holding)
        for request in [*scheduler.waiting, *scheduler.swapped]:
            assert self.engine.core.coordinator.block_ids(request.request_id) == [[], []]
        in_swap = len({b for record in scheduler.swap_records.values() for b in record.cpu_block_ids})
        assert scheduler.swap_space.num_free_blocks + in_swap == scheduler.swap_space.num_blocks
        # No orphan: a request whose samples all ended is either reported already or queued for the next step.
        unreported = {id(state) for state in self.engine.outputs.unreported}
        for state in self.engine.outputs.states.values():
            assert not state.group.finished or id(state) in unreported
        if not self.engine.has_unfinished_requests():
            assert self.engine.stats()["blocks_in_use"] == 0

    def teardown(self):
        if self.engine is None:
            return
        for _ in range(500):
            if not self.engine.has_unfinished_requests() and not self.engine.unclaimed:
                break
            self.report(self.engine.step())
        assert not self.engine.has_unfinished_requests()
        assert set(self.finished) == set(self.ids), "a request never reported its end"
        assert self.engine.stats()["blocks_in_use"] == 0
        swap = self.engine.core.scheduler.swap_space
        assert swap.num_free_blocks == swap.num_blocks
        hybridkv.unpatch(MODEL)


EngineMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestEngineMachine = pytest.mark.slow(EngineMachine.TestCase)
