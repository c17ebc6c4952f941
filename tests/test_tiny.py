"""hybridkv.tiny: tiny random models from configs, the same weights for the same arguments."""

from __future__ import annotations

import pytest
import torch

from hybridkv.tiny import FAMILIES, tiny_config, tiny_model

S, F = "sliding_attention", "full_attention"


def test_every_family_is_its_transformers_model_type():
    assert {family: tiny_config(family).model_type for family in FAMILIES} == {
        "llama": "llama",
        "mistral": "mistral",
        "ministral": "ministral",
        "qwen2": "qwen2",
        "qwen3": "qwen3",
        "gemma2": "gemma2",
        "gemma3": "gemma3_text",
        "gpt_oss": "gpt_oss",
        "cohere2": "cohere2",
        "phi3": "phi3",
        "qwen3_5": "qwen3_5_text",
        "bamba": "bamba",
    }


def test_overrides_replace_the_family_values_and_keep_the_rest():
    config = tiny_config("gemma3", num_hidden_layers=12, vocab_size=100)
    assert (config.num_hidden_layers, config.vocab_size) == (12, 100)
    assert (config.hidden_size, config.head_dim, config.sliding_window, config.pad_token_id) == (64, 16, 16, None)
    assert config.layer_types == ([S] * 5 + [F]) * 2


def test_the_same_arguments_give_the_same_weights_and_another_seed_others():
    first, again, reseeded = tiny_model("llama"), tiny_model("llama"), tiny_model("llama", seed=1)
    assert not first.training
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters(), strict=True))
    assert not torch.equal(first.lm_head.weight, reseeded.lm_head.weight)


def test_an_unknown_family_names_the_known_ones():
    with pytest.raises(
        ValueError, match=r"no tiny model family 'gemma9'; choose one of: llama, mistral, .*, phi3, qwen3_5, bamba"
    ):
        tiny_model("gemma9")


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_the_state_layer_families_are_served_token_exact(family, patched):
    import hybridkv

    model = tiny_model(family)
    prompt = list(range(3, 43))
    with torch.inference_mode():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 40:].tolist()
    llm = patched(model, max_model_len=128)
    assert llm.stats()["state_layers"] == 3
    (out,) = llm.generate([prompt], hybridkv.SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out.outputs[0].token_ids == expected
