"""Phi-3-style longrope (Phi-3/3.5 128k, Phi-3.5-MoE, Phi-4-mini) past `original_max_position_embeddings`.

transformers picks the rotary factors by the length its forward sees (`max(position_ids) + 1`): short_factor up
to original_max_position_embeddings, long_factor beyond, for every row of the forward. In `generate` that is the
request's own length, and when a request's length first passes the switch, Phi-3's `prepare_inputs_for_generation`
drops its cache and recomputes the whole sequence with the long factors. A packed step of several requests sees
the step's largest position instead, and keeps its pages: hybridkv serves these models up to the switch length.

The tiny model switches at 64 tokens (real ones at 4,096), with long factors far from the short ones.
"""

from __future__ import annotations

import re

import pytest

import hybridkv
from hybridkv.scheduling.sampling_params import SamplingParams
from hybridkv.tiny import tiny_model

from tiny_models import hf_greedy, prompts

SWITCH = 64
REFUSAL = rf"max_model_len=128 is beyond .*original_max_position_embeddings={SWITCH}.*Pass max_model_len <= {SWITCH}"


def longrope_phi3():
    rotary_pairs = 8  # head_dim 16
    return tiny_model(
        "phi3",
        sliding_window=None,
        max_position_embeddings=512,
        original_max_position_embeddings=SWITCH,
        rope_parameters=dict(
            rope_type="longrope",
            rope_theta=10000.0,
            original_max_position_embeddings=SWITCH,
            short_factor=[1.0] * rotary_pairs,
            long_factor=[1.0 + 3 * i for i in range(rotary_pairs)],
        ),
    )


def greedy(llm, batch, max_tokens):
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def assert_generate_tokens_or_refused(model, batch, max_tokens, **settings):
    """The engine with `settings` gives each prompt of `batch` generate's own tokens, or is refused at patch time
    with an error naming the fix: never other tokens."""
    references = [hf_greedy(model, prompt, max_tokens)[0] for prompt in batch]
    try:
        llm = hybridkv.patch(model, block_size=8, **settings)
    except ValueError as refusal:
        assert re.search(REFUSAL, str(refusal)), str(refusal)
        assert not hybridkv.is_patched(model)
        return
    try:
        assert greedy(llm, batch, max_tokens) == references
    finally:
        hybridkv.unpatch(model)


def test_a_prompt_decoding_past_the_switch_gets_generate_tokens_or_a_refusal():
    """A 58-token prompt decoding to 74 tokens: generate recomputes it with the long factors at token 65."""
    assert_generate_tokens_or_refused(longrope_phi3(), prompts((58,), seed=3), 16, max_model_len=128)


def test_a_short_prompt_beside_a_long_one_gets_generate_tokens_or_a_refusal():
    """A 10-token prompt keeps the short factors in generate, whatever the 100-token prompt in its steps."""
    assert_generate_tokens_or_refused(longrope_phi3(), prompts((10, 100), seed=3), 16, max_model_len=128)


def test_a_prompt_chunked_across_the_switch_gets_generate_tokens_or_a_refusal():
    """An 80-token prompt in chunks of 24: generate computes all of it with the long factors."""
    settings = dict(max_model_len=128, max_num_batched_tokens=24)
    assert_generate_tokens_or_refused(longrope_phi3(), prompts((80,), seed=3), 16, **settings)


def test_max_model_len_defaults_to_the_switch_length(patched):
    with pytest.warns(UserWarning, match=rf"up to {SWITCH} tokens .*original_max_position_embeddings={SWITCH}"):
        llm = patched(longrope_phi3(), block_size=8)
    assert llm.max_model_len == SWITCH


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 24])
def test_up_to_the_switch_a_batch_gets_generate_tokens(patched, max_num_batched_tokens):
    """A short prompt beside one that decodes to the switch, whole or in chunks of 24: every step's rows are short
    factor rows, as in generate, however many rows a step has."""
    model = longrope_phi3()
    batch = prompts((10, 58), seed=3)
    llm = patched(model, block_size=8, max_model_len=SWITCH, max_num_batched_tokens=max_num_batched_tokens)
    short, long = (hf_greedy(model, prompt, 16)[0] for prompt in batch)
    assert greedy(llm, batch, 16) == [short, long[: SWITCH - 58]]


def test_up_to_the_switch_preemption_and_prefix_hits_change_nothing(patched):
    """Pages recomputed after a preemption, or found in the prefix cache, hold the short factors' K/V, as first
    computed."""
    model = longrope_phi3()
    batch = prompts((9, 20, 30), seed=4, shared_prefix=24)
    references = [hf_greedy(model, prompt, SWITCH - len(prompt))[0] for prompt in batch]
    settings = dict(block_size=8, max_model_len=SWITCH, max_num_batched_tokens=16)
    llm = patched(model, **settings, num_blocks=hybridkv.min_num_blocks(model, **settings) + 2)
    assert greedy(llm, batch, SWITCH) == references
    assert greedy(llm, batch, SWITCH) == references
    assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["prefix_cache_hits"] > 0
