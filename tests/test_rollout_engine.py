"""What RL rollouts from a policy being trained need of the engine (README, "RL rollouts with TRL"): a model in
training mode served with eval semantics and left in its mode; `sleep` giving the pages, states and graphs back
(measured) and `wake_up` restoring service, with the prefix cache dropped; more samples of one request than
max_num_seqs queued and run as seats free; a request with more samples than vLLM's cap refused up front."""

from __future__ import annotations

import psutil
import pytest

from hybridkv import SamplingParams
from hybridkv.tiny import tiny_model

from model_zoo import STATE
from tiny_models import hf_greedy, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


# ---- training mode ------------------------------------------------------------------------------------------


def test_a_model_in_training_mode_is_patched_and_served_with_eval_semantics_and_left_in_its_modes(patched):
    """Dropout at 0.5 would change every logit: patch's step check would refuse the model and the tokens would not
    be generate's in eval mode. A submodule its owner put in eval mode stays there; every other stays in training."""
    model = tiny_model("llama", attention_dropout=0.5)
    batch = prompts((9, 30))
    model.eval()
    expected = [hf_greedy(model, prompt, 8)[0] for prompt in batch]
    model.train()
    model.model.layers[0].eval()
    modes = {name: module.training for name, module in model.named_modules()}
    llm = patched(model, block_size=8, max_model_len=128)
    assert {name: module.training for name, module in model.named_modules()} == modes
    assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == expected
    streamed = []
    for delta in llm.stream(batch[0], GREEDY):  # a step at a time, each an engine call of its own
        assert model.training
        streamed += delta.token_ids
    assert streamed == expected[0]
    assert {name: module.training for name, module in model.named_modules()} == modes


def test_the_modes_come_back_when_a_call_fails(patched):
    model = tiny_model("llama")
    llm = patched(model, block_size=8, max_model_len=64)
    model.train()
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate(prompts((9,)), {"max_tokens": 4}, use_tqdm=False)
    assert all(module.training for module in model.modules())


# ---- sleep and wake -----------------------------------------------------------------------------------------


def test_sleep_gives_the_pool_back_and_wake_up_restores_service(patched):
    model = tiny_model("llama")
    llm = patched(model, block_size=8, max_model_len=128, kv_cache_memory=256 << 20)
    batch = prompts((9, 30, 50), shared_prefix=16)
    expected = token_ids(llm.generate(batch, GREEDY, use_tqdm=False))
    assert token_ids(llm.generate(batch, GREEDY, use_tqdm=False)) == expected
    assert llm.stats()["prefix_cache_hits"] > 0
    pool_bytes = llm.stats()["kv_cache_bytes"]
    process = psutil.Process()
    before = process.memory_info().rss
    llm.sleep()
    released = before - process.memory_info().rss
    assert llm.is_sleeping()
    assert released >= 0.9 * pool_bytes, f"sleep gave back {released:,} bytes of a {pool_bytes:,}-byte pool"
    with pytest.raises(RuntimeError, match=r"asleep.*llm.wake_up\(\)"):
        llm.generate(batch, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["weights"])  # TRL's colocate mode wakes the weights first: they never left
    assert llm.is_sleeping()
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert process.memory_info().rss - (before - released) >= 0.9 * pool_bytes  # zeroed: touched, resident again
    hits = llm.stats()["prefix_cache_hits"]
    outputs = llm.generate(batch[:1], GREEDY, use_tqdm=False)
    assert token_ids(outputs) == expected[:1]
    assert outputs[0].metrics.num_cached_tokens == 0 and llm.stats()["prefix_cache_hits"] == hits  # dropped
    assert token_ids(llm.generate(batch, GREEDY, use_tqdm=False)) == expected
    assert llm.stats()["blocks_in_use"] == 0
    llm.core.coordinator.pool.check_integrity()


def test_a_state_layer_hybrid_sleeps_and_wakes_with_its_states_and_checkpoints(patched):
    model = STATE["qwen3_next"]()
    llm = patched(model, block_size=8, max_model_len=256, state_checkpoint_interval=16)
    batch = prompts((40, 70), shared_prefix=32)
    expected = token_ids(llm.generate(batch, GREEDY, use_tqdm=False))
    assert llm.core.coordinator.state_checkpoints.num_kept > 0
    state_storage = next(iter(llm.core.runner.state_pool.recurrent.values()))[0].untyped_storage()
    llm.sleep(level=2)
    assert state_storage.nbytes() == 0 and llm.core.coordinator.state_checkpoints.num_kept == 0
    llm.wake_up()
    assert state_storage.nbytes() > 0
    assert token_ids(llm.generate(batch, GREEDY, use_tqdm=False)) == expected
    llm.core.coordinator.state_checkpoints.check_integrity()


def test_sleep_refuses_while_requests_hold_pages_and_loses_nothing(patched):
    llm = patched(tiny_model("llama"), block_size=8, max_model_len=128)
    llm.add_request("held", prompts((20,))[0], SamplingParams(max_tokens=20))
    llm.step()
    with pytest.raises(RuntimeError, match=r"1 requests are unfinished.*abort_all\(\)"):
        llm.sleep()
    assert not llm.is_sleeping()
    while llm.has_unfinished_requests():
        llm.step()
    llm.sleep()
    llm.sleep()  # asleep already: nothing to do
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="'weights' and 'kv_cache'"):
        llm.wake_up(tags=["kv"])
    llm.wake_up()
    llm.wake_up()
    assert llm.stats()["blocks_in_use"] == 0


# ---- many samples -------------------------------------------------------------------------------------------


def test_more_samples_than_max_num_seqs_queue_and_run_as_seats_free(patched):
    model = tiny_model("llama")
    llm = patched(model, block_size=8, max_model_len=128, max_num_seqs=4)
    batch = prompts((9, 30))
    greedy = [hf_greedy(model, prompt, 8)[0] for prompt in batch]
    outputs = llm.generate(batch, SamplingParams(n=10, temperature=0, max_tokens=8), use_tqdm=False)
    assert token_ids(outputs) == [[tokens] * 10 for tokens in greedy]
    sampled = SamplingParams(n=10, temperature=1.0, seed=5, max_tokens=8, logprobs=0)
    for prompt in batch:
        llm.add_request(f"sampled-{len(prompt)}", prompt, sampled)
    finished = {}
    while llm.has_unfinished_requests():
        finished.update({o.request_id: o for o in llm.step() if o.finished})
        assert len(llm.core.scheduler.running) <= 4
    for output in finished.values():
        assert [c.index for c in output.outputs] == list(range(10)) and output.error is None
        assert all(len(c.token_ids) == len(c.logprobs) == 8 for c in output.outputs)
    again = llm.generate(batch, sampled, use_tqdm=False)  # seeded: sample i draws from seed + i, in any part
    assert token_ids(again) == [[c.token_ids for c in finished[f"sampled-{len(p)}"].outputs] for p in batch]
    assert llm.stats()["blocks_in_use"] == 0


def test_an_aborted_request_of_many_parts_returns_every_block(patched):
    llm = patched(tiny_model("llama"), block_size=8, max_model_len=128, max_num_seqs=3)
    llm.add_request("many", prompts((30,))[0], SamplingParams(n=8, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        llm.step()
    output = llm.abort("many")
    assert output.finished and len(output.outputs) == 8
    assert llm.stats()["blocks_in_use"] == 0 and not llm.core.scheduler.waiting and not llm.core.scheduler.running


def test_more_samples_than_vllms_cap_are_refused_before_anything_is_queued(patched, monkeypatch):
    llm = patched(tiny_model("llama"), block_size=8, max_model_len=128)
    with pytest.raises(ValueError, match=r"n must be at most 16384 .*VLLM_MAX_N_SEQUENCES.*got 1000000"):
        llm.generate(prompts((9,)), SamplingParams(n=10**6), use_tqdm=False)
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "4")
    with pytest.raises(ValueError, match="best_of must be at most 4"):
        SamplingParams(n=2, best_of=5)
    assert not llm.has_unfinished_requests()
