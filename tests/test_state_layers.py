"""State layers (linear attention, SSM, short convolution): each request's state lives in a state slot, every
slot comes back whatever ends a request, the pool really carries the state from step to step, a request's
state takes the same bytes as transformers' own cache, whatever its length, and prefix-cache hits restore the
state kept at their end (a checkpoint), which really is what the next tokens come from.

Token-for-token equality with generate, for every state family, is in tests/test_patch_equivalence.py and
tests/test_beam_search.py; this file is about the slots and the pool.
"""

from __future__ import annotations

import sys

import pytest
import torch

import hybridkv
from hybridkv import BeamSearchParams, SamplingParams
from hybridkv.execution import state_continuations
from hybridkv.memory.integrity import check_coordinator
from hybridkv.scheduling.output import ScheduledRequest, SchedulerOutput
from hybridkv.scheduling.request import Request

from greedy_reference import MAX_NEW, family
from model_zoo import STATE, ZOO, slow_except
from tiny_models import hf_greedy, new_request_id, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _noise(pool, slots, generator) -> None:
    """Overwrite the slots' states in every layer of a state pool with large noise."""
    for slot in slots:
        for layer_idx in pool.conv:
            for tensor in pool.tensors(layer_idx):
                tensor[slot] = (torch.randn(tensor[slot].shape, generator=generator) * 10).to(tensor.dtype)


def _all_returned(llm) -> None:
    slots = llm.core.coordinator.state_slots
    assert not slots.held and slots.num_free == slots.num_slots - 1
    slots.check_integrity()
    assert llm.stats()["blocks_in_use"] == 0


def test_every_state_slot_comes_back_on_finish_abort_fork_and_failure(patched, monkeypatch):
    model, batch, references = family("qwen3_5_text")
    llm = patched(model, block_size=8, max_model_len=256, max_num_seqs=3)
    slots = llm.core.coordinator.state_slots

    # Forks (n > 1) each take a slot of their own, and give it back.
    outputs = llm.generate(batch, SamplingParams(temperature=0.8, n=3, seed=1, max_tokens=6), use_tqdm=False)
    assert all(len(o.outputs) == 3 for o in outputs)
    _all_returned(llm)

    # An abort in the middle of decoding.
    ids = [llm.add_request(new_request_id(), p, GREEDY) for p in batch[:3]]
    for _ in range(3):
        llm.step()
    assert len(slots.held) == 3
    llm.abort(ids[1])
    assert len(slots.held) == 2
    llm.abort_all()
    _all_returned(llm)

    # A failing step fails its requests; their slots come back and the engine keeps serving, exactly.
    execute, calls = llm.core.runner.execute, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return execute(*args, **kwargs)

    monkeypatch.setattr(llm.core.runner, "execute", flaky)
    failed = [o for o in llm.generate(batch, GREEDY, use_tqdm=False) if o.error]
    assert failed and all("injected fault" in o.error for o in failed)
    _all_returned(llm)
    monkeypatch.setattr(llm.core.runner, "execute", execute)
    out = llm.generate(batch[:2], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [r[0] for r in references[:2]]
    _all_returned(llm)


def test_more_requests_than_slots_wait_for_one(patched):
    model, batch, references = family("lfm2")
    llm = patched(model, block_size=8, max_model_len=256, max_num_seqs=1)
    out = llm.generate(batch, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [r[0] for r in references]
    _all_returned(llm)


def test_a_beam_search_fills_every_seat_with_a_slot_and_gives_them_back(patched):
    """Beams that end give their slots back before the survivors fork: a beam search of width max_num_seqs
    never asks for a slot more than its seats, however its survivors fall among the parents."""
    model, batch, _ = family("qwen3_5_text")
    params = BeamSearchParams(beam_width=4, max_tokens=10)
    wide = patched(model, block_size=8, max_model_len=256, max_num_seqs=16)
    expected = [[s.output_token_ids for s in o.sequences] for o in wide.beam_search(batch, params, use_tqdm=False)]
    llm = patched(model, block_size=8, max_model_len=256, max_num_seqs=4)
    got = [[s.output_token_ids for s in o.sequences] for o in llm.beam_search(batch, params, use_tqdm=False)]
    assert got == expected
    _all_returned(llm)


@pytest.mark.parametrize("name", ["qwen3_5_text", "lfm2", "bamba"])
def test_the_pool_carries_the_state_between_steps(name, patched):
    """Overwrite a running request's slot with noise after its prompt: its next tokens change. (Were the state
    recomputed, or read from anywhere but the pool, they would not.)"""
    model, _, _ = family(name)
    (prompt,) = prompts((40,), seed=5)
    llm = patched(model, block_size=8, max_model_len=256)
    (clean,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)

    llm.add_request(new_request_id(), prompt, SamplingParams(temperature=0, max_tokens=12))
    llm.step()  # the prompt: the slot now holds its state
    (slot,) = llm.core.coordinator.state_slots.held.values()
    _noise(llm.core.runner.state_pool, [slot], torch.Generator().manual_seed(0))
    tokens = []
    while llm.has_unfinished_requests():
        tokens = next((o.outputs[0].token_ids for o in llm.step() if o.finished), tokens)
    assert tokens[0] == clean.outputs[0].token_ids[0]  # sampled from the prompt's logits, before the noise
    assert tokens != clean.outputs[0].token_ids
    _all_returned(llm)


@pytest.mark.parametrize("name", ["qwen3_5_text", "lfm2", "nemotron_h", "falcon_h1"])
def test_a_request_state_takes_what_transformers_cache_holds_whatever_its_length(name, patched):
    model, _, _ = family(name)
    llm = patched(model, block_size=8, max_model_len=256, max_num_seqs=4)
    stats = llm.stats()
    assert stats["state_layers"] > 0
    # One slot per request that may run at once, the scratch slot, and as many checkpoints (the default).
    assert stats["state_checkpoints"] == 4
    assert stats["state_checkpoint_bytes"] == 4 * stats["state_bytes_per_request"]
    assert stats["state_pool_bytes"] == (4 + 1 + 4) * stats["state_bytes_per_request"]
    for length in (9, 120):
        (prompt,) = prompts((length,), seed=3)
        with torch.inference_mode():
            cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
        held = sum(
            t.numel() * t.element_size()
            for layer in cache.layers
            for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {}))
            for t in states.values()
            if t is not None
        )
        assert held == stats["state_bytes_per_request"], length


@pytest.mark.parametrize("name", slow_except(sorted(STATE), fast=("lfm2", "qwen3_next")))
def test_a_bf16_state_model_is_checked_on_an_fp32_copy_whose_states_are_fp32(name, patched):
    """The step check runs a 16-bit model's fp32 copy: the states the model keeps in its own dtype (conv states)
    must be fp32 there too, as the copy's own forward keeps them, or rounding between chunks refuses every bf16
    state model (it did: 0.0014-0.0059 of the largest logit). Served, the pool keeps them as the model does."""
    model = ZOO[name]().to(torch.bfloat16)
    llm = patched(model, block_size=8, max_model_len=256, max_num_seqs=2)
    assert llm.stats()["step_check"] == "fp32 copy"
    for spec in llm.core.runner.states:
        assert {dtype for _, dtype in spec.conv} <= {torch.bfloat16}


def _fill_kept_checkpoints_with_noise(llm) -> None:
    slots = list(llm.core.coordinator.state_checkpoints._kept.values())
    _noise(llm.core.runner.state_pool, slots, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", slow_except(sorted(STATE)))
def test_a_hit_restores_the_state_kept_at_its_end(name, patched):
    """A prompt sharing a prefix with an earlier one hits up to the last checkpoint of the prefix (a multiple of
    the interval), with generate's tokens; with noise in the kept checkpoints the tokens change, so the state
    they come from is the restored one (a state recomputed, or left empty, would not change them)."""
    model, _, _ = family(name)
    llm = patched(model, block_size=8, max_model_len=512, max_num_seqs=2)
    interval = llm.stats()["state_checkpoint_interval"]
    # The second prompt is the shared prefix and one token: every token it computes comes from the hit's state.
    first, second = prompts((10, 1), seed=7, shared_prefix=2 * interval)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    expected = hf_greedy(model, second, 8)[0]
    (cold,) = llm.generate([first], greedy, use_tqdm=False)
    assert cold.metrics.num_cached_tokens == 0
    assert llm.stats()["state_checkpoints_kept"] >= 2  # at interval and 2 x interval (and beyond, its own)
    (warm,) = llm.generate([second], greedy, use_tqdm=False)
    assert warm.metrics.num_cached_tokens == 2 * interval
    assert warm.outputs[0].token_ids == expected
    _all_returned(llm)
    check_coordinator(llm.core.coordinator)

    _fill_kept_checkpoints_with_noise(llm)
    (noisy,) = llm.generate([second], greedy, use_tqdm=False)
    assert noisy.metrics.num_cached_tokens > 0 and noisy.outputs[0].token_ids != expected
    _all_returned(llm)


def test_checkpoints_are_bounded_and_the_least_recently_used_goes(patched):
    model, _, _ = family("qwen3_5_text")
    llm = patched(model, block_size=8, max_model_len=512, max_num_seqs=2, num_state_checkpoints=2)
    checkpoints = llm.core.coordinator.state_checkpoints
    interval = checkpoints.interval
    greedy = SamplingParams(temperature=0, max_tokens=2)
    shared = prompts((3,), seed=8, shared_prefix=interval + 1)[0]
    llm.generate([shared], greedy, use_tqdm=False)  # one checkpoint, at the interval
    for seed in range(9, 12):  # three other prompts: each a checkpoint, the shared one used between them
        llm.generate(prompts((interval + 3,), seed=seed), greedy, use_tqdm=False)
        (hit,) = llm.generate([shared], greedy, use_tqdm=False)
        assert hit.metrics.num_cached_tokens == interval  # kept: the most recently used each time
        assert checkpoints.num_kept == 2
        checkpoints.check_integrity()
    assert llm.stats()["state_checkpoint_bytes"] == 2 * llm.stats()["state_bytes_per_request"]


def test_no_checkpoints_no_hit_and_an_interval_must_fit_the_blocks(patched):
    model, _, _ = family("qwen3_5_text")
    llm = patched(model, block_size=8, max_model_len=512, num_state_checkpoints=0)
    batch = prompts((5, 9), seed=2, shared_prefix=100)
    llm.generate(batch, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] == 0 and llm.stats()["state_checkpoints"] == 0
    with pytest.raises(ValueError, match="must be a multiple of every group's block size"):
        patched(model, block_size=8, max_model_len=512, state_checkpoint_interval=12)


def test_a_failed_step_keeps_none_of_its_checkpoints(patched, monkeypatch):
    """A step that raises may not have written its checkpoints: none of them may be hit afterwards."""
    model, _, _ = family("qwen3_5_text")
    llm = patched(model, block_size=8, max_model_len=512, max_num_seqs=2)
    interval = llm.stats()["state_checkpoint_interval"]
    prompt = prompts((interval + 9,), seed=4)[0]
    original = llm.core.runner.forward
    monkeypatch.setattr(llm.core.runner, "forward", lambda prepared: 1 / 0)
    (failed,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error"
    assert llm.stats()["state_checkpoints_kept"] == 0
    check_coordinator(llm.core.coordinator)
    monkeypatch.setattr(llm.core.runner, "forward", original)
    (again,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert again.metrics.num_cached_tokens == 0 and again.outputs[0].token_ids == hf_greedy(model, prompt, 2)[0]
    _all_returned(llm)


def _swapping(model, patched, **settings):
    """An engine whose pool holds the longest request alone, preempting by swap, with room in swap space."""
    base = dict(block_size=8, max_model_len=176, max_num_batched_tokens=32)
    num_blocks = hybridkv.min_num_blocks(model, **base) + 1
    llm = patched(model, **base, num_blocks=num_blocks, preemption_mode="swap", **settings)
    llm.core.runner.verify_tables = llm.core.coordinator.block_tables
    return llm


@pytest.mark.parametrize("name", slow_except(sorted(STATE)))
def test_preemption_by_swap_carries_the_state_out_and_back(name, patched):
    """A tight pool preempts by swap: every swapped request's state goes to a CPU state slot and comes back, the
    tokens stay generate's, and every device and CPU slot comes back."""
    model, batch, references = family(name)
    probe = patched(model, block_size=8, max_model_len=176)
    swap_space = (64 * probe.stats()["kv_bytes_per_token"] * 8 + 8 * probe.stats()["state_bytes_per_request"]) / (
        1 << 30
    )
    llm = _swapping(model, patched, swap_space=swap_space)
    assert llm.stats()["state_swap_slots"] >= len(batch)
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [tokens for tokens, _ in references]
    assert llm.stats()["num_swaps"] > 0
    _all_returned(llm)
    swap_states = llm.core.scheduler.swap_states
    assert not swap_states.held and swap_states.num_free == swap_states.num_slots - 1


def test_a_swapped_state_is_the_one_that_comes_back(patched):
    """Noise written into a decoding request's CPU state slot while it is swapped out changes its next tokens:
    the state it continues from is the one swapped out (were it recomputed, or left in the device slot, they
    would not change). Short prompts and long outputs, so that requests are swapped while decoding."""
    model, _, _ = family("qwen3_5_text")
    batch = prompts((12, 15, 18, 20), seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=60)
    references = [hf_greedy(model, p, 60)[0] for p in batch]
    probe = patched(model, block_size=8, max_model_len=176)
    swap_space = (64 * probe.stats()["kv_bytes_per_token"] * 8 + 8 * probe.stats()["state_bytes_per_request"]) / (
        1 << 30
    )
    llm = _swapping(model, patched, swap_space=swap_space)
    ids = [llm.add_request(new_request_id(), p, greedy) for p in batch]
    done, noised = {}, set()
    generator = torch.Generator().manual_seed(0)
    cpu = llm.core.runner._swap_states
    while llm.has_unfinished_requests():
        for output in llm.step():
            done[output.request_id] = output
        for request in llm.core.scheduler.swapped:  # decoding: its next token comes from this state
            request_id = request.group.request_id
            if request.num_computed_tokens > request.num_prompt_tokens and request_id not in noised:
                noised.add(request_id)
                _noise(cpu, [llm.core.scheduler.swap_states.held[request.request_id]], generator)
    assert noised, "no decoding request was swapped: the pool is not tight enough for this test"
    changed = {
        request_id
        for request_id, tokens in zip(ids, references, strict=True)
        if done[request_id].outputs[0].token_ids != tokens
    }
    assert changed == noised
    _all_returned(llm)


def test_without_room_for_states_a_swap_falls_back_to_recompute(patched):
    """swap_space too small for a state: nothing is swapped, preemption recomputes, the tokens are the same."""
    model, batch, references = family("bamba")
    probe = patched(model, block_size=8, max_model_len=176)
    llm = _swapping(model, patched, swap_space=probe.stats()["state_bytes_per_request"] / (1 << 30))  # blocks only
    assert llm.stats()["state_swap_slots"] == 0
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [tokens for tokens, _ in references]
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["num_swaps"] == 0
    _all_returned(llm)


class _PositionalCacheLayer(torch.nn.Module):
    """A state layer that takes the cache second, by position (as Zaya's q/k/v projection does), a per-row tensor
    third, and returns a tuple: each row's running sum over its sequence (the recurrent state) times the row's
    scale, and that sum's negation."""

    layer_idx = 0

    def forward(self, hidden_states, cache, scale, extra=None):
        state = cache.get_recurrent_state(self.layer_idx) if cache is not None else None
        sums = hidden_states.cumsum(dim=1)
        if state is not None:
            sums = sums + state.unsqueeze(1)
        if cache is not None:
            cache.update_recurrent_state(sums[:, -1], self.layer_idx)
        return sums * scale, -sums


def test_a_state_layer_taking_its_cache_by_position_runs_per_segment():
    """`segmented_forward` binds the layer's arguments by its signature, cuts the per-row tensors to each segment and
    puts a tuple's tensors back together: two decode rows (each continuing the state in its slot) and a prompt's
    segment (from no state) give what each sequence alone gives."""
    from hybridkv.execution.state_layers import StatePlan, StatePool, StepStateCache, segmented_forward
    from hybridkv.memory.kv_spec import StateSpec
    from hybridkv.tiny import tiny_config

    layer = _PositionalCacheLayer()
    spec = StateSpec(0, "layer", (), (((4,), torch.float32),))
    pool = StatePool([spec], 4, {0: torch.device("cpu")})
    cache = StepStateCache(tiny_config("llama"), pool)
    generator = torch.Generator().manual_seed(0)
    before = torch.randn(2, 4, generator=generator)  # slots 1 and 2: two sequences' running sums so far
    pool.recurrent[0][0][1:3] = before
    hidden = torch.randn(1, 5, 4, generator=generator)  # rows 0 and 1: decodes of slots 1, 2; rows 2-4: a prompt
    scale = torch.arange(1.0, 6.0).view(1, 5, 1)
    cache.plan = StatePlan(torch.tensor([0, 1]), torch.tensor([1, 2]), [(2, 5, 3, False, (), 0, 3)])
    layer.forward = segmented_forward(layer.forward, 0)
    sums, negated = layer(hidden, cache, scale, extra="kept")
    expected = torch.cat([before[0] + hidden[0, 0], before[1] + hidden[0, 1]]).view(2, 4)
    prompt = hidden[0, 2:].cumsum(dim=0)
    assert torch.allclose(sums[0, :2], expected * scale[0, :2]) and torch.allclose(sums[0, 2:], prompt * scale[0, 2:])
    assert torch.allclose(negated[0], -torch.cat([expected, prompt]))
    assert torch.allclose(pool.recurrent[0][0][1:4], torch.cat([expected, prompt[-1:]]))
    cache.plan = None
    assert torch.equal(layer(hidden, None, 1.0)[0], hidden.cumsum(dim=1))  # outside a step: the layer's own forward


@pytest.mark.parametrize("name", ["jamba", "zamba2", "minimax", "recurrent_gemma"])
def test_unpatch_leaves_the_last_hybrids_as_they_were(name):
    """Served, these run code of hybridkv's beside their own (a scan continued from its state, a layer index for a
    shared attention block, a forward keeping a block's state in the cache); unpatched, the model and its
    transformers module are as they were, and generate gives what it gave."""
    model = ZOO[name]()
    namespace = vars(sys.modules[type(model).__module__])
    functions = {key: value for key, value in namespace.items() if callable(value)}
    missing = object()

    def attributes():
        return [(set(module.__dict__), getattr(module, "layer_idx", missing)) for module in model.modules()]

    before = attributes()
    prompt = prompts((40,), seed=3)[0]
    expected = hf_greedy(model, prompt, 8)[0]
    llm = hybridkv.patch(model, block_size=8, max_model_len=256)
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids == expected
    hybridkv.unpatch(model)
    assert {key: value for key, value in namespace.items() if callable(value)} == functions
    assert attributes() == before
    assert hf_greedy(model, prompt, 8)[0] == expected


@pytest.mark.parametrize("name", ["zamba2", "jamba", "minimax", "recurrent_gemma"])
def test_a_prompts_one_token_piece_gives_its_prompt_forwards_logits(name):
    """A prompt's last token computed alone, after its state (a chunk of one: chunked prefill, a checkpoint's
    piece), is a prompt token: the layer computes it as generate's prompt forward does, not as a decode. Zamba2's
    Mamba2 decode form skips the time step's floor that its prompt form applies (0.001): that token's logits were
    4e-3 off."""
    model, batch, _ = family(name)
    prompt = batch[-1][:65]
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0, -1].float()
    llm = hybridkv.patch(model, block_size=8, max_model_len=256)
    try:
        request = Request("piece", prompt, SamplingParams(), block_size=8)
        coordinator, runner = llm.core.coordinator, llm.core.runner
        for num_new in (64, 1):
            assert coordinator.allocate_slots(request, num_new)
            scheduled = [ScheduledRequest(request, num_new, samples=())]
            plan = SchedulerOutput(scheduled, table_updates=coordinator.take_table_updates())
            logits = runner.execute(plan, logits_rows=[num_new - 1])
            request.num_computed_tokens += num_new
            coordinator.update_computed(request)
        coordinator.free("piece")
    finally:
        hybridkv.unpatch(model)
    assert (logits[-1].float() - expected).abs().max() < 2e-5 * expected.abs().max()


@pytest.mark.parametrize("name", slow_except(sorted(STATE)))
def test_n_greedy_samples_each_give_generates_tokens(name, patched):
    """n > 1: the samples fork from the leader when it samples its first token (the state slot copied), and each
    continues from its own copy: greedy, every sample is generate's."""
    model, batch, references = family(name)
    llm = patched(model, block_size=8, max_model_len=256, max_num_seqs=6)
    outputs = llm.generate(batch[:2], SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    for output, (expected, _) in zip(outputs, references[:2], strict=True):
        assert [sample.token_ids for sample in output.outputs] == [expected] * 3
    _all_returned(llm)


def test_without_its_continuation_jambas_scan_is_refused_by_the_check(monkeypatch):
    """transformers' Mamba-1 scan starts several tokens from zero whatever state it is given: without hybridkv's
    continuation (hybridkv/execution/state_continuations.py) the end-to-end check refuses Jamba, naming why."""
    monkeypatch.delitem(state_continuations._FIXES, "mamba_scan_forward")
    with pytest.raises(ValueError, match="does not continue from the state it is given"):
        hybridkv.patch(ZOO["jamba"](), block_size=8, max_model_len=256)


def _zamba2_with_a_binding_floor():
    """The zoo's Zamba2 with a time-step floor its random weights reach often (0.05; published: 0.001): its Mamba2
    decode form, which skips the floor, and its prompt form compute other numbers wherever the floor binds."""
    model = ZOO["zamba2"]()
    for module in model.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = (0.05, float("inf"))
    return model


def test_a_state_layer_whose_decode_form_differs_gives_generates_tokens_in_every_mode(patched):
    """Prompts are computed as generate computes them, generated tokens as it decoded them, in every mode; a state
    checkpoint is kept within prompts only (a state reached through generated tokens is not a prompt's), so a
    conversation's next turn, whose prompt holds the last answer, hits only where generate's prompt form gives the
    same state (restoring the one the answer's decoding left, at 160, gave other tokens)."""
    model = _zamba2_with_a_binding_floor()
    batch = prompts((9, 40, 70, 150), seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    references = [hf_greedy(model, prompt, MAX_NEW) for prompt in batch]
    for extra in ({}, {"max_num_batched_tokens": 24}):
        llm = patched(model, block_size=8, max_model_len=256, **extra)
        for _ in range(2):  # the second time from the prefix cache
            outputs = llm.generate(batch, greedy, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == [tokens for tokens, _ in references]
        assert llm.stats()["prefix_cache_hits"] > 0
        # 150 + 16 + 9 tokens: the first turn passed checkpoint 160 in its answer, which the next may not restore
        next_turn = batch[3] + references[3][0] + batch[0]
        (output,) = llm.generate([next_turn], greedy, use_tqdm=False)
        assert output.outputs[0].token_ids == hf_greedy(model, next_turn, MAX_NEW)[0]
        assert 0 < output.metrics.num_cached_tokens <= len(batch[3])
        hybridkv.unpatch(model)
    settings = dict(block_size=8, max_model_len=176, max_num_batched_tokens=32)
    tight = hybridkv.min_num_blocks(model, **settings) + 1
    for preemption in ({}, {"preemption_mode": "swap", "swap_space": 0.05}):
        llm = patched(model, **settings, num_blocks=tight, **preemption)
        outputs = llm.generate(batch, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [tokens for tokens, _ in references]
        assert llm.stats()["num_preemptions"] > 0
        _all_returned(llm)
        hybridkv.unpatch(model)


def test_a_recomputed_requests_generated_tokens_run_as_generate_decoded_them(patched):
    """Preempted by recompute after 10 tokens, a request computes its prompt and those tokens again in one chunk:
    its state layers run the generated ones in the decode form, as generate did (in the prompt form, with Zamba2's
    floor binding, the state that comes out differs and the tokens after it change)."""
    model = _zamba2_with_a_binding_floor()
    prompt = prompts((40,), seed=4)[0]
    expected = hf_greedy(model, prompt, MAX_NEW)[0]
    llm = patched(model, block_size=8, max_model_len=256, enable_prefix_caching=False)
    request_id = llm.add_request(new_request_id(), prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    scheduler = llm.core.scheduler
    while not scheduler.running or scheduler.running[0].num_output_tokens < 10:
        llm.step()
    (request,) = scheduler.running
    scheduler._preempt(request, SchedulerOutput([]), recompute=True)
    finished = {}
    while llm.has_unfinished_requests():
        finished.update({output.request_id: output for output in llm.step() if output.finished})
    assert request.num_preemptions == 1
    assert finished[request_id].outputs[0].token_ids == expected
