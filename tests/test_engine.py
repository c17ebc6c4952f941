"""The engine's behaviours: preemption modes, parallel sampling, seeds, stop strings, abort, faults,
streaming, logprobs and bad input."""

from __future__ import annotations

import pytest
import torch

import hybridkv
from hybridkv import SamplingParams
from hybridkv.tiny import tiny_model

from tiny_models import FAMILIES, hf_greedy, hf_greedy_min_new_tokens, new_request_id, prompts, with_early_eos
from tiny_tokenizer import tiny_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def gemma3():
    model = FAMILIES["gemma3_text"]()
    batch = prompts((7, 33, 70, 150))
    return model, batch, [hf_greedy(model, p, 16)[0] for p in batch]


@pytest.fixture(scope="module")
def text_model():
    tokenizer = tiny_tokenizer()
    return tiny_model("llama", vocab_size=len(tokenizer)), tokenizer


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def tight_pool(model):
    return hybridkv.min_num_blocks(model, block_size=8, max_model_len=176, max_num_batched_tokens=32) + 1


MIN_TOKENS = 6


@pytest.fixture(scope="module")
def early_eos():
    model = FAMILIES["llama"]()
    batch = prompts((9, 30, 17), seed=4)
    return model, batch, with_early_eos(model, batch[0])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_min_tokens_masks_eos_as_generates_min_new_tokens_does(early_eos, async_scheduling, patched):
    model, batch, continuation = early_eos
    eos = model.generation_config.eos_token_id
    llm = patched(model, block_size=8, max_model_len=128, async_scheduling=async_scheduling)
    assert tokens(llm.generate(batch[:1], GREEDY, use_tqdm=False)) == [continuation[:2]]  # the EOS comes early
    expected = [hf_greedy_min_new_tokens(model, prompt, 16, MIN_TOKENS) for prompt in batch]
    assert eos not in expected[0][:MIN_TOKENS] and expected[0][: MIN_TOKENS - 1] != continuation[: MIN_TOKENS - 1]
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=MIN_TOKENS)
    assert tokens(llm.generate(batch, params, use_tqdm=False)) == expected
    assert llm.stats()["blocks_in_use"] == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sampled_min_tokens_never_draws_eos_or_a_stop_id_before_it(early_eos, async_scheduling, patched):
    """Seeded samples at a low temperature follow the greedy continuation, which would end at its second token."""
    model, batch, continuation = early_eos
    eos, stop = model.generation_config.eos_token_id, continuation[3]
    llm = patched(model, block_size=8, max_model_len=128, async_scheduling=async_scheduling)
    settings = dict(n=8, temperature=0.3, seed=3, max_tokens=16, stop_token_ids=[stop])
    free = llm.generate(batch[:1], SamplingParams(**settings), use_tqdm=False)[0].outputs
    assert sum(len(sample.token_ids) < MIN_TOKENS for sample in free) >= 4  # without min_tokens most stop early
    held = llm.generate(batch[:1], SamplingParams(**settings, min_tokens=MIN_TOKENS), use_tqdm=False)[0].outputs
    for sample in held:
        assert not {eos, stop} & set(sample.token_ids[:MIN_TOKENS])
        assert len(sample.token_ids) == 16 or (sample.token_ids[-1] in (eos, stop) and sample.finish_reason == "stop")
    assert llm.stats()["blocks_in_use"] == 0


@pytest.mark.parametrize("swap_space_blocks", [64, 1])
def test_swap_preemption_gives_the_same_greedy_tokens_as_a_large_pool(gemma3, swap_space_blocks, patched):
    model, batch, expected = gemma3
    num_blocks = tight_pool(model)
    probe = patched(model, block_size=8, max_model_len=176)
    llm = patched(
        model,
        block_size=8,
        max_model_len=176,
        max_num_batched_tokens=32,
        num_blocks=num_blocks,
        preemption_mode="swap",
        swap_space=swap_space_blocks * probe.bytes_per_block / (1 << 30),  # GiB
    )
    assert tokens(llm.generate(batch, GREEDY, use_tqdm=False)) == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    if swap_space_blocks == 64:
        assert stats["num_swaps"] > 0  # room in swap space: preempted requests were swapped
    else:
        assert stats["num_swaps"] == 0  # no room: it fell back to recompute
    swap = llm.core.scheduler.swap_space
    assert swap.num_blocks == min(swap_space_blocks, num_blocks - 1)  # never more than the device pool
    assert stats["blocks_in_use"] == 0 and swap.num_free_blocks == swap.num_blocks


def test_swap_without_swap_space_is_a_clear_error(gemma3):
    with pytest.raises(ValueError, match="needs swap space: set swap_space"):
        hybridkv.patch(gemma3[0], max_model_len=176, preemption_mode="swap", swap_space=0)
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        hybridkv.patch(gemma3[0], max_model_len=176, preemption_mode="drop")


@pytest.mark.parametrize("caching", [True, False])
def test_parallel_greedy_samples_compute_the_prompt_once(gemma3, patched, caching):
    model, batch, expected = gemma3
    llm = patched(model, block_size=8, max_model_len=256, enable_prefix_caching=caching)
    (out,) = llm.generate([batch[3]], SamplingParams(n=3, temperature=0, max_tokens=16), use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [expected[3]] * 3
    assert [c.index for c in out.outputs] == [0, 1, 2]
    # Samples 1 and 2 were forked from the leader when it sampled: the prompt ran through the model once,
    # then each sample computed its own 15 tokens after the first; nothing came from the prefix cache.
    stats = llm.stats()
    assert stats["num_forward_tokens"] == len(batch[3]) + 3 * 15
    assert stats["prefix_cache_hits"] == 0 and stats["blocks_in_use"] == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_samples_that_cannot_all_fit_at_once_still_finish(patched, mode):
    """n samples that outgrow a pool holding one of them: they are preempted alone and take turns (a
    group preempted and swapped as a whole went out and back in forever)."""
    model = tiny_model("ministral", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    settings = dict(block_size=4, max_model_len=48, max_num_batched_tokens=16)
    llm = patched(model, **settings, num_blocks=hybridkv.min_num_blocks(model, **settings), preemption_mode=mode,
                  swap_space=1 / 1024)  # fmt: skip
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=16, ignore_eos=True)
    llm.add_request(new_request_id(), list(range(30)), params)
    for _ in range(200):  # bounded: a livelock fails instead of hanging
        (output,) = llm.step() or (None,)
        if output is not None and output.finished:
            break
    assert output.finished and [len(c.token_ids) for c in output.outputs] == [16] * 3
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["blocks_in_use"] == 0


def test_parallel_seeded_samples_differ_and_repeat(gemma3, patched):
    model, batch, _ = gemma3
    llm = patched(model, block_size=8, max_model_len=256)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12)
    first = llm.generate([batch[1]], params, use_tqdm=False)[0]
    again = llm.generate([batch[1]], params, use_tqdm=False)[0]
    samples = [c.token_ids for c in first.outputs]
    assert len({tuple(s) for s in samples}) == 3
    assert [c.token_ids for c in again.outputs] == samples


def test_seeded_request_is_batch_invariant(gemma3, patched):
    model, batch, _ = gemma3
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)
    llm = patched(model, block_size=8, max_model_len=256)
    alone = tokens(llm.generate([batch[2]], seeded, use_tqdm=False))[0]
    others = SamplingParams(temperature=1.0, max_tokens=16)
    mixed = llm.generate([batch[0], batch[2], batch[3]], [others, seeded, others], use_tqdm=False)
    assert tokens(mixed)[1] == alone


def test_stop_string_cuts_the_text_exactly(text_model, patched):
    model, tokenizer = text_model
    llm = patched(model, tokenizer=tokenizer, max_model_len=128)
    prompt = "Once upon a time"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert full.text == tokenizer.decode(full.token_ids)
    stop = full.text[10:13]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)
    completion = cut[0].outputs[0]
    assert completion.text == full.text[: full.text.index(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.token_ids == full.token_ids[: len(completion.token_ids)]


def test_stream_yields_the_same_tokens_and_text_as_generate(text_model, patched):
    model, tokenizer = text_model
    llm = patched(model, tokenizer=tokenizer, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = llm.generate("The quick brown", params, use_tqdm=False)[0].outputs[0]
    deltas = list(llm.stream("The quick brown", params))
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert "".join(d.text for d in deltas) == expected.text
    assert deltas[-1].finish_reason == "length" and len(deltas) > 5


def test_stream_keeps_other_requests_results(text_model, patched):
    model, tokenizer = text_model
    llm = patched(model, tokenizer=tokenizer, max_model_len=128)
    other = llm.add_request(new_request_id(), "lazy dog", SamplingParams(temperature=0, max_tokens=3))
    list(llm.stream("The quick", SamplingParams(temperature=0, max_tokens=10)))
    finished = [o for o in llm.step() if o.finished]
    assert [o.request_id for o in finished] == [other]


def test_logprobs_are_the_models_own(gemma3, patched):
    model, batch, _ = gemma3
    expected_tokens, hf_logits = hf_greedy(model, batch[1], 8)
    llm = patched(model, block_size=8, max_model_len=256)
    out = llm.generate([batch[1]], SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.token_ids == expected_tokens
    for step, logprobs in enumerate(completion.logprobs):
        reference = torch.log_softmax(hf_logits[step], dim=-1)
        token = expected_tokens[step]
        assert logprobs[token].logprob == pytest.approx(reference[token].item(), abs=1e-4)
        assert logprobs[token].rank == 1  # greedy
        top = sorted(logprobs, key=lambda t: logprobs[t].rank)
        assert top == reference.topk(3).indices.tolist()
        assert [logprobs[t].logprob for t in top] == pytest.approx(reference.topk(3).values.tolist(), abs=1e-4)


def test_abort_returns_every_block_and_the_rest_finish(gemma3, patched):
    model, batch, expected = gemma3
    llm = patched(model, block_size=8, max_model_len=256, max_num_batched_tokens=32)
    ids = [llm.add_request(new_request_id(), p, GREEDY) for p in batch]
    for _ in range(4):
        llm.step()
    aborted = llm.abort(ids[3])
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    done = {}
    while llm.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    assert [done[i].outputs[0].token_ids for i in ids[:3]] == expected[:3]
    assert llm.stats()["blocks_in_use"] == 0
    assert llm.abort("no-such-request") is None


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(gemma3, monkeypatch, patched):
    model, batch, expected = gemma3
    llm = patched(model, block_size=8, max_model_len=256, max_num_seqs=2)
    execute = llm.core.runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return execute(*args, **kwargs)

    monkeypatch.setattr(llm.core.runner, "execute", flaky)
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    failed = [o for o in outputs if o.error]
    assert len(failed) == 2 and all("injected fault" in o.error for o in failed)
    assert all(o.outputs[0].finish_reason == "error" for o in failed)
    survivors = [o.outputs[0].token_ids for o in outputs if not o.error]
    assert survivors == expected[2:]
    assert llm.stats()["blocks_in_use"] == 0
    assert tokens(llm.generate(batch[:1], GREEDY, use_tqdm=False)) == expected[:1]


def test_bad_input_gets_errors_that_name_the_fix(gemma3, text_model, patched):
    model, _, _ = gemma3
    llm = patched(model, max_model_len=256)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.add_request(new_request_id(), "hello")
    with pytest.raises(ValueError, match="token id 999 is outside the vocabulary"):
        llm.add_request(new_request_id(), [1, 999])
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.add_request(new_request_id(), [1, 2], SamplingParams(stop=["x"]))
    llm.add_request("same", [1, 2])
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request("same", [3])
    with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
        llm.generate([[1], [2]], [GREEDY] * 3)


def test_generate_accepts_text_and_single_prompts(text_model, patched):
    model, tokenizer = text_model
    llm = patched(model, tokenizer=tokenizer, max_model_len=128)
    (single,) = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert single.prompt == "The quick" and single.prompt_token_ids == tokenizer.encode("The quick")
    (ids,) = llm.generate(tokenizer.encode("The quick"), SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert ids.outputs[0].token_ids == single.outputs[0].token_ids
    assert single.metrics.time_to_first_token is not None and single.metrics.finished_time is not None


def test_metrics_count_the_prompt_tokens_taken_from_the_prefix_cache(gemma3, patched):
    model, batch, _ = gemma3
    llm = patched(model, block_size=8, max_model_len=256)
    first = llm.generate([batch[3]], GREEDY, use_tqdm=False)[0]
    again = llm.generate([batch[3]], GREEDY, use_tqdm=False)[0]
    assert first.metrics.num_cached_tokens == 0
    assert again.metrics.num_cached_tokens == 144  # 18 full blocks; the last prompt token is computed


def test_unpatch_closes_the_engine_and_frees_its_blocks_without_the_cycle_collector(gemma3):
    import gc

    from hybridkv.memory.block_pool import KVBlock

    def live_blocks():
        return sum(type(o) is KVBlock for o in gc.get_objects())

    model, batch, _ = gemma3
    gc.collect()
    gc.disable()
    try:
        before = live_blocks()
        llm = hybridkv.patch(model, block_size=8, max_model_len=256)
        llm.generate([batch[0]], GREEDY, use_tqdm=False)
        num_blocks = llm.stats()["num_blocks"]
        assert live_blocks() >= before + num_blocks
        hybridkv.unpatch(model)
        del llm
        assert live_blocks() == before  # freed by reference counting alone, with the collector off
    finally:
        gc.enable()


def test_unpatch_frees_the_pages_while_the_caller_still_holds_the_engine(gemma3):
    """A benchmark or notebook that unpatches and patches again must find the device memory free: the pages,
    views of them and the captured graphs go with `unpatch`, not when the last reference to the engine does."""
    import weakref

    model, batch, _ = gemma3
    llm = hybridkv.patch(model, block_size=8, max_model_len=256)
    llm.generate([batch[0]], GREEDY, use_tqdm=False)
    pages = [weakref.ref(p) for p in llm.core.runner._pages.values()]
    assert pages and all(ref() is not None for ref in pages)
    hybridkv.unpatch(model)
    assert all(ref() is None for ref in pages)  # `llm` is still alive here


def test_an_engine_closed_by_unpatch_says_how_to_get_a_new_one(gemma3):
    model, batch, _ = gemma3
    llm = hybridkv.patch(model, max_model_len=256)
    hybridkv.unpatch(model)
    with pytest.raises(RuntimeError, match=r"call hybridkv\.patch\(model\) again"):
        llm.generate([batch[0]], GREEDY, use_tqdm=False)


def test_a_request_output_is_its_live_record_extended_by_each_step(gemma3, patched):
    model, batch, expected = gemma3
    llm = patched(model, block_size=8, max_model_len=256)
    request_id = llm.add_request(new_request_id(), batch[0], GREEDY)
    (first,) = llm.step()
    tokens_list = first.outputs[0].token_ids
    assert tokens_list == expected[0][:1] and not first.finished
    while llm.has_unfinished_requests():
        for output in llm.step():
            assert output is first  # the same record, not a copy per step
    assert first.finished and first.request_id == request_id
    assert first.outputs[0].token_ids is tokens_list and tokens_list == expected[0]


def test_a_stop_string_completed_before_min_tokens_is_passed_over(text_model, patched):
    """vLLM's rule: stop strings are looked for once a sample has more than min_tokens output tokens."""
    model, tokenizer = text_model
    llm = patched(model, tokenizer=tokenizer, max_model_len=128)
    prompt = "Once upon a time"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    early = tokenizer.decode(full.token_ids[1:2])  # the text of the second token: completed by it, under min_tokens
    assert early.strip() and early in tokenizer.decode(full.token_ids[:2])
    params = SamplingParams(temperature=0, max_tokens=24, stop=[early], min_tokens=4, ignore_eos=True)
    completion = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) > 4 and completion.token_ids == full.token_ids[: len(completion.token_ids)]
    assert completion.stop_reason in (early, None)
    unbounded = SamplingParams(temperature=0, max_tokens=24, stop=[early], ignore_eos=True)
    assert len(llm.generate(prompt, unbounded, use_tqdm=False)[0].outputs[0].token_ids) <= 2
