"""The engine and what the model is set to after `hybridkv.patch`, beside its weights (tests/test_model_changes.py).

hybridkv builds its KV layout and installs its attention once, at patch time, from the model's attention
implementation and its config; a later edit of either is never followed silently: the next engine call raises an
error naming `hybridkv.patch(model)` again, and patching again serves the model as it now is, token for token
what `generate` gives (or says why it cannot). The generation config and the tokenizer are read again whenever they
change: a request added after `model.generation_config.eos_token_id = X` stops at X, as `generate` does.
"""

from __future__ import annotations

import pytest

import hybridkv
from hybridkv.scheduling.sampling_params import SamplingParams

from model_zoo import FAST_FAMILIES, slow_except
from tiny_models import FAMILIES, hf_greedy, new_request_id

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
PROMPTS = [list(range(3, 40)), list(range(3, 30)) + [7, 9, 11]]
PATCH_AGAIN = r"hybridkv\.patch\(model\) again"


def references(model, max_new=MAX_NEW):
    return [hf_greedy(model, prompt, max_new)[0] for prompt in PROMPTS]


def tokens(outputs):
    return [output.outputs[0].token_ids for output in outputs]


def served(patched, family):
    """A patched tiny model whose first generation equals transformers' own."""
    model = FAMILIES[family]()
    llm = patched(model, max_model_len=128, block_size=8)
    before = references(model)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == before
    return model, llm, before


def assert_refused_and_clean(llm, match=PATCH_AGAIN):
    with pytest.raises(RuntimeError, match=match):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.stats()["blocks_in_use"] == 0 and not llm.has_unfinished_requests()


# ---- the attention implementation ---------------------------------------------------------------------------


@pytest.mark.fast_if(lambda implementation, family, **_: family == "llama" or implementation == "sdpa")
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_switching_the_attention_implementation_is_refused_and_patching_again_serves_it(
    family, implementation, patched
):
    model, llm, _ = served(patched, family)
    model.set_attn_implementation(implementation)
    assert_refused_and_clean(llm, match=rf"'{implementation}'.*{PATCH_AGAIN}")
    again = patched(model, max_model_len=128, block_size=8)
    assert again is not llm
    assert tokens(again.generate(PROMPTS, GREEDY, use_tqdm=False)) == references(model)
    hybridkv.unpatch(model)
    assert model.config._attn_implementation == implementation  # the model keeps what it was switched to


def test_a_running_request_is_refused_its_next_step_after_a_switch(patched):
    model, llm, _ = served(patched, "llama")
    llm.add_request(new_request_id(), PROMPTS[0], GREEDY)
    llm.step()
    model.set_attn_implementation("eager")
    with pytest.raises(RuntimeError, match=PATCH_AGAIN):
        llm.step()
    model.set_attn_implementation("hybridkv")  # switched back: served as before
    done = {}
    while llm.has_unfinished_requests():
        done.update((output.request_id, output) for output in llm.step())
    (output,) = done.values()
    assert output.outputs[0].token_ids == references(model)[0]


# ---- the config that shapes attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", slow_except(sorted(FAMILIES), fast=(*FAST_FAMILIES, "gemma3_text")))
def test_a_sliding_window_edit_is_refused_naming_the_fix(family, patched):
    model, llm, _ = served(patched, family)
    model.config.get_text_config().sliding_window = 6
    llm.reset_prefix_cache()  # no help: the layout is the patched one
    assert_refused_and_clean(llm, match=rf"sliding_window is 6.*{PATCH_AGAIN}")


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_patching_again_serves_the_new_window(family, patched):
    model, llm, before = served(patched, family)
    model.config.sliding_window = 6
    with pytest.raises(RuntimeError, match=PATCH_AGAIN):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    expected = references(model)
    assert expected != before, "the window changes nothing: blind"
    assert tokens(patched(model, max_model_len=128, block_size=8).generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


@pytest.mark.parametrize(
    "edit",
    [
        ("num_hidden_layers", 1),
        ("layer_types", ["full_attention"] * 6),
        ("rope_parameters", None),
    ],
    ids=lambda edit: edit[0],
)
def test_other_attention_config_edits_are_refused(edit, patched):
    name, value = edit
    model, llm, _ = served(patched, "gemma3_text")
    config = model.config.get_text_config()
    if name == "rope_parameters":
        value = {**config.rope_parameters, "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
    setattr(config, name, value)
    assert_refused_and_clean(llm, match=rf"config\.{name} is .*{PATCH_AGAIN}")


def test_a_field_set_or_deleted_after_patch_is_refused(patched):
    # The watch reads the fields set at patch time in one call and tests the unset ones for appearing.
    model, llm, _ = served(patched, "gemma3_text")
    config = model.config.get_text_config()
    assert "attention_chunk_size" not in vars(config)
    config.attention_chunk_size = 8
    assert_refused_and_clean(llm, match=rf"config\.attention_chunk_size is 8 but was unset.*{PATCH_AGAIN}")
    model, llm, _ = served(patched, "gemma3_text")
    del model.config.get_text_config().__dict__["sliding_window"]
    assert_refused_and_clean(llm, match=rf"config\.sliding_window is unset but was .*{PATCH_AGAIN}")


def test_an_in_place_edit_of_a_config_list_is_refused(patched):
    model, llm, _ = served(patched, "ministral")
    model.config.layer_types[1] = "sliding_attention"
    assert_refused_and_clean(llm, match=rf"config\.layer_types.*{PATCH_AGAIN}")


def test_an_untouched_config_is_served_call_after_call(patched):
    model, llm, before = served(patched, "gemma3_text")
    model.config.use_cache = False  # a setting that shapes no attention
    model.generation_config.max_length = 99
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == before
    assert hybridkv.patch(model, max_model_len=128, block_size=8) is llm  # nothing to build again


# ---- the generation config and the tokenizer ---------------------------------------------------------------------


def test_an_eos_set_after_patch_stops_the_next_requests(patched):
    model, llm, before = served(patched, "llama")
    eos = before[0][3]
    model.generation_config.eos_token_id = eos
    expected = references(model)
    assert expected != before, "the EOS changes nothing: blind"
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected
    assert outputs[0].outputs[0].finish_reason == "stop"
    model.generation_config.eos_token_id = [before[1][2], 999]  # a list, as chat models' configs hold
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == references(model)


def test_generation_config_defaults_are_read_per_call(patched):
    model, llm, _ = served(patched, "llama")
    assert llm.get_default_sampling_params().max_tokens == SamplingParams().max_tokens
    model.generation_config.max_new_tokens = 3
    model.generation_config.top_k = 5
    assert llm.default_sampling == {"max_tokens": 3, "top_k": 5}
    params = llm.get_default_sampling_params()
    assert (params.max_tokens, params.top_k) == (3, 5)
    (output,) = llm.generate(PROMPTS[:1], use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3


# ---- the vocabulary ----------------------------------------------------------------------------------------------


def test_a_new_token_id_after_resize_token_embeddings_is_refused_naming_the_fix(patched):
    model, llm, _ = served(patched, "llama")
    model.resize_token_embeddings(260)
    prompt = [*PROMPTS[0], 258]
    with pytest.raises(ValueError, match=rf"it has 260 tokens now.*{PATCH_AGAIN}"):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    again = patched(model, max_model_len=128, block_size=8)
    assert again is not llm
    (output,) = again.generate([prompt], GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == hf_greedy(model, prompt, MAX_NEW)[0]
