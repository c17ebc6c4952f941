"""Async scheduling (hybridkv/engine/async_steps.py) changes when the host works, never a token. Two engines on two
copies of one model, one with `async_scheduling=True`, take the same seeded random requests (greedy and seeded sampled
rows, stop tokens, stop strings, min_tokens, logit biases, penalties, logprobs, n > 1, beam searches, grammars,
requests arriving mid-run, aborts at a token count, a pool small enough to preempt in both modes, chunked prefill,
prefix caching, a model with state layers, one with latent attention) and must give every request the same tokens,
text, logprobs and finish; both keep their memory accounting whole after every step and hold nothing at the end, and
the async engine must have planned steps ahead of their tokens."""

from __future__ import annotations

import random

import pytest

import hybridkv
from hybridkv import BeamSearchParams, SamplingParams, StructuredOutputsParams
from hybridkv.async_engine import AsyncLLMEngine
from hybridkv.memory.integrity import check_coordinator
from hybridkv.tiny import tiny_model

from model_zoo import LATENT, STATE
from tiny_models import DEVICE, new_request_id
from tiny_tokenizer import tiny_tokenizer


def _params(rng: random.Random, grammars: bool) -> SamplingParams | BeamSearchParams:
    max_tokens = rng.randint(1, 20)
    kind = rng.random()
    if kind < 0.4:  # plain greedy: every step overlaps
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=rng.random() < 0.5)
    if kind < 0.55:  # stop rules, read one step behind
        return SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            min_tokens=rng.randint(0, min(3, max_tokens)),
            stop_token_ids=[rng.randrange(256) for _ in range(4)],
            stop=[" the", "e", "o"] if rng.random() < 0.7 else None,
        )
    if kind < 0.7:  # seeded draws on the device, with a bias that stays
        bias = {rng.randrange(256): 3.0} if rng.random() < 0.5 else None
        return SamplingParams(
            temperature=0.8, top_p=0.9, seed=rng.randrange(100), max_tokens=max_tokens, logit_bias=bias
        )
    if kind < 0.76:  # penalties read the tokens so far: the host samples, nothing overlaps
        return SamplingParams(temperature=0, max_tokens=max_tokens, repetition_penalty=1.3, presence_penalty=0.5)
    if kind < 0.82:
        return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)
    if kind < 0.88:
        return SamplingParams(n=2, temperature=1.0, seed=rng.randrange(100), max_tokens=max_tokens)
    if kind < 0.93 or not grammars:
        return BeamSearchParams(beam_width=2, max_tokens=min(max_tokens, 6))
    return SamplingParams(
        temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])
    )


def _final(output) -> tuple:
    return (
        output.finished,
        output.error,
        [
            (
                list(c.token_ids),
                c.text,
                c.finish_reason,
                c.stop_reason,
                None if c.logprobs is None else [sorted(p) for p in c.logprobs],
            )
            for c in output.outputs
        ],
    )


def _run(engine, script: list[tuple], abort_at: dict[str, int]) -> dict[str, tuple]:
    """Play the script (("add", id, prompt, params) or ("step",)) and step until done; a request whose first
    sample reached its `abort_at` token count is aborted right after the step that reported it."""
    finals = {}

    def take(reports):
        for output in reports:
            finals[output.request_id] = output
            limit = abort_at.get(output.request_id)
            if limit is not None and not output.finished and len(output.outputs[0].token_ids) >= limit:
                finals[output.request_id] = engine.abort(output.request_id)

    def check():
        scheduler = engine.core.scheduler
        live = {r.request_id: r for r in (*scheduler.running, *scheduler.waiting)}
        check_coordinator(engine.core.coordinator, live)

    for action in script:
        if action[0] == "add":
            engine.add_request(*action[1:])
        else:
            take(engine.step())
            check()
    while engine.has_unfinished_requests():
        take(engine.step())
        check()
    take(engine.step())  # a step launched ahead, every token of it taken back, finishes with nothing to report
    assert engine.core.coordinator.pool.num_free_blocks == engine.core.coordinator.pool.num_blocks - 1, (
        "blocks held at the end"
    )
    if engine.core.coordinator.state_slots is not None:
        assert not engine.core.coordinator.state_slots.held, "state slots held at the end"
    return {request_id: _final(output) for request_id, output in finals.items()}


def _script(rng: random.Random, grammars: bool, length: int) -> tuple[list[tuple], dict[str, int]]:
    script, abort_at = [], {}
    prefix = [rng.randrange(1, 256) for _ in range(12)]
    for _ in range(length):
        if rng.random() < 0.25 or not script:
            prompt = (prefix if rng.random() < 0.5 else [])[: rng.randint(0, 12)]
            prompt += [rng.randrange(1, 256) for _ in range(rng.randint(1, 20))]
            params = _params(rng, grammars)
            request_id = new_request_id()
            if isinstance(params, SamplingParams) and rng.random() < 0.15:
                abort_at[request_id] = rng.randint(1, 6)
            script.append(("add", request_id, {"prompt_token_ids": prompt}, params))
        else:
            script.append(("step",))
    return script, abort_at


@pytest.mark.parametrize(
    ("seed", "family", "mode", "caching", "chunk", "spare"),
    [(0, "ministral", "recompute", True, 0, 40), (1, "ministral", "swap", True, 3, 8),
     (2, "ministral", "recompute", False, 0, 8),
     pytest.param(3, "gemma3", "recompute", True, 5, 12, marks=pytest.mark.slow),  # case 1's windows and chunks
     pytest.param(4, "qwen3_next", "recompute", True, 0, 40, marks=pytest.mark.slow),
     pytest.param(5, "qwen3_next", "swap", True, 4, 10, marks=pytest.mark.slow),
     (9, "deepseek_v3", "swap", True, 4, 10)],
)  # fmt: skip
def test_async_scheduling_gives_the_synchronous_engines_tokens(
    seed: int, family: str, mode: str, caching: bool, chunk: int, spare: int
) -> None:
    """`spare`: blocks over the least a request needs (few: preemptions, some of requests whose token is pending)."""
    rng = random.Random(seed)
    tokenizer = tiny_tokenizer()
    zoo = family in STATE or family in LATENT  # the zoo's builders (state layers, latent attention)
    build = {**STATE, **LATENT}[family] if zoo else lambda: tiny_model(family, vocab_size=len(tokenizer))
    models = [build().to(DEVICE) for _ in range(2)]  # on the GPU under benchmarks/gpu_check.sh: graphs, pinned copies
    settings = dict(
        block_size=4, max_model_len=96, max_num_batched_tokens=32, enable_prefix_caching=caching,
        long_prefill_token_threshold=chunk, max_num_seqs=6, compile=False,
    )  # fmt: skip
    if family == "gemma3":  # decode steps padded to buckets, as a GPU's graphs replay them
        settings["enforce_eager"] = False
    num_blocks = hybridkv.min_num_blocks(models[0], **settings) + spare
    settings.update(num_blocks=num_blocks, preemption_mode=mode, swap_space=1 / 256)
    sync, ahead = (
        hybridkv.patch(model, tokenizer=tokenizer, async_scheduling=flag, **settings)
        for model, flag in zip(models, (False, True), strict=True)
    )
    try:
        assert sync.async_steps is None and ahead.async_steps is not None
        for engine in (sync, ahead):
            engine.core.runner.verify_tables = engine.core.coordinator.block_tables
        script, abort_at = _script(rng, grammars=not zoo, length=90)
        expected = _run(sync, script, abort_at)
        assert _run(ahead, script, abort_at) == expected
        assert ahead.async_steps.num_overlapped > 10, ahead.async_steps.num_overlapped
        assert any(output[2][0][2] == "stop" for output in expected.values()), "no request stopped on a rule"
    finally:
        for model in models:
            hybridkv.unpatch(model)


@pytest.mark.parametrize("family", ["ministral", "qwen3_next"])
def test_blocks_filled_by_a_pending_token_are_hit_as_the_synchronous_engines_are(family: str) -> None:
    """A decode fills blocks (and, on a model with state layers, reaches checkpoints) with tokens the host has not
    read yet: the next turn of a conversation hits the same prefix with async scheduling as without."""
    tokenizer = tiny_tokenizer()
    state = family in STATE
    build = STATE[family] if state else lambda: tiny_model(family, vocab_size=len(tokenizer))
    settings = dict(
        block_size=4, max_model_len=128, num_state_checkpoints=8, state_checkpoint_interval=8, compile=False,
        num_blocks=512,
    )  # fmt: skip
    if not state:
        del settings["num_state_checkpoints"], settings["state_checkpoint_interval"]
    hits = []
    for flag in (False, True):
        model = build().to(DEVICE)
        llm = hybridkv.patch(model, tokenizer=tokenizer, async_scheduling=flag, **settings)
        try:
            prompt = list(range(5, 16))
            turns = []
            for turn in range(3):
                params = SamplingParams(temperature=0, max_tokens=13 + turn, ignore_eos=True)
                (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                turns.append((output.num_cached_tokens, list(output.outputs[0].token_ids)))
                prompt = prompt + list(output.outputs[0].token_ids) + [7, 8, 9]
            hits.append(turns)
            if flag:
                assert llm.async_steps.num_overlapped > 20
        finally:
            hybridkv.unpatch(model)
    assert hits[0] == hits[1]
    assert hits[0][2][0] > 11 + 13 + 3, hits  # past the first turn's prompt: blocks its decode filled


def test_async_scheduling_is_on_by_default_on_one_cuda_device_only(patched):
    tokenizer = tiny_tokenizer()
    llm = patched(tiny_model("llama", vocab_size=len(tokenizer)).to(DEVICE), tokenizer)
    assert (llm.async_steps is not None) == (DEVICE.type == "cuda")
    assert llm.stats()["async_scheduling"] == (DEVICE.type == "cuda")
    with pytest.raises(TypeError, match="async_scheduling"):
        patched(tiny_model("llama", vocab_size=len(tokenizer)), tokenizer, async_scheduling="yes")


def _engine(flag: bool, **settings):
    tokenizer = tiny_tokenizer()
    model = tiny_model("gemma3", vocab_size=len(tokenizer), sliding_window=8).to(DEVICE)
    # A pool of its own size: on a GPU the default takes 0.9 of the device, which the test workers share.
    return hybridkv.patch(
        model, tokenizer=tokenizer, async_scheduling=flag, block_size=4, max_model_len=128, compile=False,
        num_blocks=512, **settings,
    )  # fmt: skip


def test_streams_the_async_engine_and_a_reset_see_the_synchronous_engines_tokens():
    """Outside `generate`: a stream's deltas, the threaded AsyncLLMEngine, a reset of the prefix cache while a step
    is in flight (it is finished first), and unpatching with one in flight."""
    prompts = ["The quick brown fox", "Once upon a time", "Sliding windows forget"]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop=["e "])
    seen = []
    for flag in (False, True):
        llm = _engine(flag)
        model = llm.model
        try:
            deltas = [(d.index, d.token_ids, d.text, d.finish_reason) for d in llm.stream(prompts[0], params)]
            llm.add_request("a", prompts[1], params)
            llm.add_request("b", prompts[2], params)
            for _ in range(4):
                llm.step()
            if flag:
                assert llm.async_steps.in_flight is not None
            llm.reset_prefix_cache(reset_running_requests=True)  # drains the step in flight, then recomputes
            assert llm.async_steps is None or llm.async_steps.in_flight is None
            finished = {}
            while llm.has_unfinished_requests():
                for output in llm.step():
                    finished[output.request_id] = [list(c.token_ids) for c in output.outputs]
            served = AsyncLLMEngine(llm)
            try:
                handles = [served.submit(prompt, params) for prompt in prompts]
                threaded = [[list(c.token_ids) for c in h.result(timeout=120).outputs] for h in handles]
            finally:
                served.shutdown()
            llm.add_request("c", prompts[0], params)
            llm.step()
            llm.step()  # with async scheduling a step is in flight now
            seen.append((deltas, finished, threaded))
        finally:
            hybridkv.unpatch(model)
        assert not hybridkv.is_patched(model)
    assert seen[0] == seen[1]


def test_each_request_is_reported_once_when_a_step_in_flight_meets_a_synchronous_plan_or_an_interrupt():
    """Found by tests/test_engine_properties.py: a plan with forks runs synchronously right after the step in
    flight finishes, and an interrupted launch fails its plan after the step in flight finished; either way one
    call reports a request once, and a request is reported finished once."""
    llm = _engine(True, max_num_batched_tokens=16, enable_prefix_caching=False)
    try:
        prompt = [(3 * i + 17) % 64 for i in range(17)]  # a first chunk of 16, then the fork's step
        llm.add_request("forks", {"prompt_token_ids": prompt}, SamplingParams(n=2, temperature=0, max_tokens=1))
        reports = llm.step()
        assert [r.request_id for r in reports] == ["forks"] and reports[0].finished
        llm.add_request("cut", {"prompt_token_ids": [1]}, SamplingParams(temperature=0, max_tokens=3))
        assert not llm.step()[0].finished  # its first token; the next step is in flight
        assert llm.async_steps.in_flight is not None

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        llm.core.runner.execute = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.step()
        del llm.core.runner.execute
        finished = [r for r in llm.step() if r.finished]
        assert [(r.request_id, r.outputs[0].finish_reason) for r in finished] == [("cut", "error")]
        assert "interrupted" in finished[0].error and not llm.has_unfinished_requests()
        assert llm.stats()["blocks_in_use"] == 0
    finally:
        hybridkv.unpatch(llm.model)


def test_a_full_batch_with_requests_waiting_keeps_overlapping() -> None:
    """While max_num_seqs sequences run, a waiting request cannot be admitted, so no step checks the model
    (`Scheduler.may_admit`) and none finishes the step in flight for it: every step but those after a seat frees
    is planned ahead of its tokens, and the tokens are the synchronous engine's. Eager: a captured graph's replay is
    checked at every step (`EngineCore.model_check_due`)."""
    tokenizer = tiny_tokenizer()
    settings = dict(block_size=4, max_model_len=64, max_num_seqs=2, compile=False, enforce_eager=True)  # no graphs
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5 + i, 9, 11 + i, 3] for i in range(6)]
    results = []
    for flag in (False, True):
        model = tiny_model("llama", vocab_size=len(tokenizer)).to(DEVICE)
        llm = hybridkv.patch(model, tokenizer=tokenizer, async_scheduling=flag, **settings)
        try:
            ids = [llm.add_request(new_request_id(), prompt, params) for prompt in prompts]
            done = {}
            while llm.has_unfinished_requests():
                for output in llm.step():
                    done[output.request_id] = output.outputs[0].token_ids
            results.append([done[request_id] for request_id in ids])
            assert llm.core.model_watch.num_checks == 3  # one per pair of seats freed: the three admissions
            if flag:
                # 6 requests, two at a time, 12 tokens each: 39 steps, 36 of them overlapped here (24 when every step
                # with a request waiting checked the model and finished the step in flight first).
                assert llm.async_steps.num_overlapped >= 30, llm.async_steps.num_overlapped
            assert llm.stats()["blocks_in_use"] == 0
        finally:
            hybridkv.unpatch(model)
    assert results[0] == results[1]
