"""The async engine: callers from threads and event loops, streams, cancellation, faults, shutdown; and
chat through the tokenizer's template."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import hybridkv
from hybridkv import SamplingParams
from hybridkv.async_engine import AsyncLLMEngine
from hybridkv.tiny import tiny_model

from tiny_models import hf_greedy, prompts
from tiny_tokenizer import tiny_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def gemma3():
    model = tiny_model("gemma3")
    batch = prompts((9, 30, 41, 12, 25, 7, 33, 18))
    return model, batch, [hf_greedy(model, p, 8)[0] for p in batch]


@pytest.fixture
def served(gemma3, patched):
    model, _, _ = gemma3
    engine = AsyncLLMEngine(patched(model, max_model_len=128, max_num_seqs=4))
    yield engine
    engine.shutdown()


def blocks_in_use_reaches_zero(engine, seconds=10.0):
    deadline = time.monotonic() + seconds
    while engine.stats()["blocks_in_use"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.stats()["blocks_in_use"] == 0


def test_beam_searches_and_samples_share_the_engine_thread(gemma3, served):
    _, batch, expected = gemma3
    params = hybridkv.BeamSearchParams(beam_width=3, max_tokens=6)

    async def main():
        return await asyncio.gather(served.submit(batch[1], params), served.submit(batch[0], GREEDY))

    searched, greedy = asyncio.run(main())
    served.shutdown()
    alone = served.llm.beam_search([batch[1]], params, use_tqdm=False)[0]
    sequences = hybridkv.BeamSearchOutput.of(searched, params).sequences
    assert [s.tokens for s in sequences] == [s.tokens for s in alone.sequences]
    assert [s.cum_logprob for s in sequences] == pytest.approx([s.cum_logprob for s in alone.sequences], abs=1e-4)
    assert greedy.outputs[0].token_ids == expected[0]


def test_callers_in_many_threads_get_the_offline_tokens(gemma3, served):
    _, batch, expected = gemma3
    results = [None] * len(batch)

    def call(i):
        results[i] = served.submit(batch[i], GREEDY).result(60).outputs[0].token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(batch))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == expected
    assert blocks_in_use_reaches_zero(served)


def test_an_event_loop_awaits_and_streams_while_the_engine_runs_beside_it(gemma3, served):
    _, batch, expected = gemma3

    async def main():
        outputs = await asyncio.gather(*(served.submit(p, GREEDY) for p in batch[:4]))
        streamed = []
        async for delta in served.submit(batch[4], GREEDY).deltas():
            streamed.extend(delta.token_ids)
            last = delta
        return [o.outputs[0].token_ids for o in outputs], streamed, last.finish_reason

    tokens, streamed, finish_reason = asyncio.run(main())
    assert tokens == expected[:4] and streamed == expected[4] and finish_reason == "length"


def slow_steps(engine, monkeypatch, seconds=0.02):
    """Every forward takes at least `seconds`: a 100-token request then runs for seconds, not milliseconds."""
    execute = engine.llm.core.runner.execute

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.llm.core.runner, "execute", slow)


def test_cancelling_a_streaming_task_aborts_its_request(gemma3, served, monkeypatch):
    _, batch, _ = gemma3
    slow_steps(served, monkeypatch)

    async def main():
        handle = served.submit(batch[1], SamplingParams(temperature=0, max_tokens=100))
        first = asyncio.Event()

        async def consume():
            async for _ in handle.deltas():
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await handle

    output = asyncio.run(main())
    assert output.outputs[0].finish_reason == "abort" and len(output.outputs[0].token_ids) < 100
    assert blocks_in_use_reaches_zero(served)


def test_bad_input_raises_in_the_callers_thread_and_queues_nothing(gemma3, served):
    with pytest.raises(TypeError, match="token ids must be integers"):
        served.submit([1, "x"], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        served.submit([1, 10_000], GREEDY)
    _, batch, expected = gemma3
    assert served.submit(batch[0], GREEDY).result(60).outputs[0].token_ids == expected[0]


def test_a_refused_duplicates_abort_leaves_the_request_holding_the_id_running(gemma3, served, monkeypatch):
    """A second request with a running one's id is refused; aborting its handle (what a server does when the refusal
    reaches it) must not abort the first, which owns the id."""
    _, batch, _ = gemma3
    slow_steps(served, monkeypatch)
    first = served.submit(batch[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), "shared")
    duplicate = served.submit(batch[1], GREEDY, "shared")
    with pytest.raises(ValueError, match="request id 'shared' is already in use"):
        duplicate.result(60)
    duplicate.abort()
    output = first.result(60)
    assert (output.outputs[0].finish_reason, len(output.outputs[0].token_ids)) == ("length", 40)


def test_a_finished_handles_abort_leaves_a_later_request_with_its_id_running(gemma3, served, monkeypatch):
    _, batch, expected = gemma3
    earlier = served.submit(batch[0], GREEDY, "reused")
    assert earlier.result(60).outputs[0].token_ids == expected[0]
    slow_steps(served, monkeypatch)
    later = served.submit(batch[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), "reused")
    earlier.abort()
    output = later.result(60)
    assert (output.outputs[0].finish_reason, len(output.outputs[0].token_ids)) == ("length", 40)


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(gemma3, served, monkeypatch):
    _, batch, expected = gemma3
    execute = served.llm.core.runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return execute(*args, **kwargs)

    monkeypatch.setattr(served.llm.core.runner, "execute", flaky)
    failed = served.submit(batch[0], GREEDY).result(60)
    assert failed.error and "injected fault" in failed.error
    assert served.submit(batch[1], GREEDY).result(60).outputs[0].token_ids == expected[1]


def test_the_engine_refuses_direct_calls_from_other_threads_while_served(gemma3, served):
    _, batch, _ = gemma3
    with pytest.raises(RuntimeError, match="in use by another thread"):
        served.llm.generate([batch[0]], GREEDY, use_tqdm=False)


def test_shutdown_aborts_what_runs_and_stops_the_thread(gemma3, patched, monkeypatch):
    model, batch, _ = gemma3
    engine = AsyncLLMEngine(patched(model, max_model_len=128))
    slow_steps(engine, monkeypatch)
    handle = engine.submit(batch[1], SamplingParams(temperature=0, max_tokens=100))
    time.sleep(0.1)
    engine.shutdown()
    assert not engine._thread.is_alive()
    assert handle.result(10).outputs[0].finish_reason == "abort"
    assert engine.llm.stats()["blocks_in_use"] == 0
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(batch[0], GREEDY)


def test_unpatching_the_model_under_a_running_engine_fails_its_requests_and_stops_the_thread(gemma3, monkeypatch):
    model, batch, _ = gemma3
    engine = AsyncLLMEngine(hybridkv.patch(model, max_model_len=128))
    slow_steps(engine, monkeypatch)
    handle = engine.submit(batch[1], SamplingParams(temperature=0, max_tokens=100))
    time.sleep(0.1)
    hybridkv.unpatch(model)
    engine._thread.join(10)
    assert not engine._thread.is_alive()
    with pytest.raises(RuntimeError):
        handle.result(10)
    with pytest.raises(RuntimeError, match="unpatched"):
        engine.submit(batch[0], GREEDY)


def test_chat_renders_the_tokenizers_template_once_without_a_second_bos(patched):
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer))
    llm = patched(model, tokenizer=tokenizer, max_model_len=128)
    with pytest.raises(ValueError, match="has no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    try:
        conversation = [{"role": "user", "content": "The lazy dog"}]
        (output,) = llm.chat(conversation, GREEDY, use_tqdm=False)
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert output.prompt == text and output.prompt_token_ids == ids
        assert output.outputs[0].token_ids == hf_greedy(model, ids, 8)[0]
        two = llm.chat([conversation, [{"role": "user", "content": "Once upon"}]], GREEDY, use_tqdm=False)
        assert len(two) == 2 and two[0].outputs[0].token_ids == output.outputs[0].token_ids
    finally:
        tokenizer.chat_template = None
    assert hybridkv.is_patched(model)


def test_the_async_engine_sleeps_and_wakes_between_steps_with_vllms_coroutines(gemma3, served):
    _, batch, expected = gemma3

    async def run():
        assert await served.submit(batch[0], GREEDY) is not None
        await served.sleep()
        assert await served.is_sleeping()
        with pytest.raises(RuntimeError, match=r"asleep.*wake_up\(\)"):
            served.submit(batch[0], GREEDY)
        await served.wake_up()
        assert not await served.is_sleeping()
        return (await served.submit(batch[0], GREEDY)).outputs[0].token_ids

    assert asyncio.run(run()) == expected[0]
    held = served.submit(batch[1], SamplingParams(max_tokens=200, ignore_eos=True))
    with pytest.raises(RuntimeError, match="unfinished"):
        asyncio.run(served.sleep())
    held.abort()
    assert blocks_in_use_reaches_zero(served)


def test_the_async_engine_resets_the_prefix_cache_between_steps_with_vllms_coroutine(gemma3, served):
    _, batch, expected = gemma3

    async def run():
        first = await served.submit(batch[1], GREEDY)
        hit = await served.submit(batch[1], GREEDY)
        assert await served.reset_prefix_cache() is True
        after = await served.submit(batch[1], GREEDY)
        return first, hit, after

    first, hit, after = asyncio.run(run())
    assert [o.outputs[0].token_ids for o in (first, hit, after)] == [expected[1]] * 3
    assert hit.metrics.num_cached_tokens > 0 and after.metrics.num_cached_tokens == 0
