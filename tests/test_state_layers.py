"""State layers (linear attention, SSM, short convolution): each request's state lives in a state slot, every
slot comes back whatever ends a request, the pool really carries the state from step to step, and a request's
state takes the same bytes as transformers' own cache, whatever its length.

Token-for-token equality with generate, for every state family, is in tests/test_patch_equivalence.py and
tests/test_beam_search.py; this file is about the slots and the pool.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv import BeamSearchParams, SamplingParams

from greedy_reference import family
from model_zoo import STATE, ZOO
from tiny_models import prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _all_returned(llm) -> None:
    slots = llm.coordinator.state_slots
    assert not slots.held and slots.num_free == slots.num_slots - 1
    slots.check_integrity()
    assert llm.stats()["blocks_in_use"] == 0


def test_every_state_slot_comes_back_on_finish_abort_fork_and_failure(patched, monkeypatch):
    model, batch, references = family("qwen3_5_text")
    llm = patched(model, block_size=8, max_model_len=256, max_num_seqs=3)
    slots = llm.coordinator.state_slots

    # Forks (n > 1) each take a slot of their own, and give it back.
    outputs = llm.generate(batch, SamplingParams(temperature=0.8, n=3, seed=1, max_tokens=6), use_tqdm=False)
    assert all(len(o.outputs) == 3 for o in outputs)
    _all_returned(llm)

    # An abort in the middle of decoding.
    ids = [llm.add_request(p, GREEDY) for p in batch[:3]]
    for _ in range(3):
        llm.step()
    assert len(slots.held) == 3
    llm.abort(ids[1])
    assert len(slots.held) == 2
    llm.abort_all()
    _all_returned(llm)

    # A failing step fails its requests; their slots come back and the engine keeps serving, exactly.
    execute, calls = llm.runner.execute, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return execute(*args, **kwargs)

    monkeypatch.setattr(llm.runner, "execute", flaky)
    failed = [o for o in llm.generate(batch, GREEDY, use_tqdm=False) if o.error]
    assert failed and all("injected fault" in o.error for o in failed)
    _all_returned(llm)
    monkeypatch.setattr(llm.runner, "execute", execute)
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

    llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=12))
    llm.step()  # the prompt: the slot now holds its state
    (slot,) = llm.coordinator.state_slots.held.values()
    pool = llm.runner.state_pool
    generator = torch.Generator().manual_seed(0)
    for tensors in (*pool.conv.values(), *pool.recurrent.values()):
        for tensor in tensors:
            noise = torch.randn(tensor[slot].shape, generator=generator) * 10
            tensor[slot] = noise.to(tensor.dtype)
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
    # One slot per request that may run at once, and the scratch slot.
    assert stats["state_pool_bytes"] == (4 + 1) * stats["state_bytes_per_request"]
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


@pytest.mark.parametrize("name", sorted(STATE))
def test_a_bf16_state_model_is_checked_on_an_fp32_copy_whose_states_are_fp32(name, patched):
    """The step check runs a 16-bit model's fp32 copy: the states the model keeps in its own dtype (conv states)
    must be fp32 there too, as the copy's own forward keeps them, or rounding between chunks refuses every bf16
    state model (it did: 0.0014-0.0059 of the largest logit). Served, the pool keeps them as the model does."""
    model = ZOO[name]().to(torch.bfloat16)
    llm = patched(model, block_size=8, max_model_len=256, max_num_seqs=2)
    assert llm.stats()["step_check"] == "fp32 copy"
    for spec in llm.runner.states:
        assert {dtype for _, dtype in spec.conv} <= {torch.bfloat16}
