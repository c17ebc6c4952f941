import pytest
import torch
from transformers import AutoModelForCausalLM

import hybridkv
from hybridkv import SamplingParams

from tiny_models import FAMILIES, hf_greedy, prompts

GREEDY_12 = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture
def gemma3():
    return FAMILIES["gemma3_text"]()


def test_from_pretrained_round_trip_through_safetensors(tmp_path, gemma3):
    batch = prompts((20, 90))
    expected = [hf_greedy(gemma3, p, 12)[0] for p in batch]
    gemma3.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    llm = hybridkv.patch(loaded, max_model_len=256)
    assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY_12)] == expected


def test_model_placed_with_accelerate_offload(tmp_path, gemma3):
    batch = prompts((20, 90))
    expected = [hf_greedy(gemma3, p, 12)[0] for p in batch]
    gemma3.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" if i % 2 else "cpu" for i in range(6)})
    placed = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", dtype=torch.float32, device_map=device_map, offload_folder=tmp_path / "offload"
    )
    offloaded = placed.model.layers[1].self_attn
    assert next(offloaded.parameters()).device.type == "meta"  # weights come in through accelerate's hooks
    llm = hybridkv.patch(placed, max_model_len=256)
    assert llm.core.runner.layers[1].key_cache.device.type == "cpu"
    assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY_12)] == expected


def test_unpatch_restores_the_model_exactly(gemma3):
    batch = prompts((20, 90))
    before = [hf_greedy(gemma3, p, 12)[0] for p in batch]
    implementation = gemma3.config._attn_implementation
    state = {k: v.clone() for k, v in gemma3.state_dict().items()}
    llm = hybridkv.patch(gemma3, max_model_len=256)
    llm.generate(batch, SamplingParams(temperature=0, max_tokens=4))
    hybridkv.unpatch(gemma3)
    assert gemma3.config._attn_implementation == implementation
    assert not hybridkv.is_patched(gemma3)
    assert all(torch.equal(v, state[k]) for k, v in gemma3.state_dict().items())
    assert [hf_greedy(gemma3, p, 12)[0] for p in batch] == before
    hybridkv.unpatch(gemma3)  # a second unpatch is harmless


def test_patched_model_called_directly_behaves_like_the_original(gemma3, patched):
    batch = prompts((20, 90))
    expected = [hf_greedy(gemma3, p, 12) for p in batch]
    patched(gemma3, max_model_len=256)
    for prompt, (tokens, logits) in zip(batch, expected, strict=True):
        got_tokens, got_logits = hf_greedy(gemma3, prompt, 12)
        assert got_tokens == tokens
        assert torch.allclose(torch.stack(got_logits), torch.stack(logits), atol=1e-6)


def test_patching_twice_returns_the_same_engine_and_new_settings_rebuild_it(gemma3):
    first = hybridkv.patch(gemma3, max_model_len=256)
    assert hybridkv.patch(gemma3, max_model_len=256) is first
    second = hybridkv.patch(gemma3, max_model_len=128)
    assert second is not first and second.max_model_len == 128
    out = second.generate(prompts((30,)), SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    hybridkv.unpatch(gemma3)


def test_budget_too_small_for_one_request_is_a_clear_error(gemma3):
    with pytest.raises(ValueError, match=r"cannot hold one request at max_model_len=256.*raise num_blocks"):
        hybridkv.patch(gemma3, max_model_len=256, num_blocks=10)
    with pytest.raises(ValueError, match="raise the KV cache budget"):
        hybridkv.patch(gemma3, max_model_len=256, kv_cache_memory=1000)
    assert not hybridkv.is_patched(gemma3)


def test_prompt_over_max_model_len_returns_an_error_output(gemma3, patched):
    llm = patched(gemma3, max_model_len=64)
    out = llm.generate([list(range(65)), list(range(10))], SamplingParams(temperature=0, max_tokens=3))
    assert out[0].outputs[0].finish_reason == "error" and "max_model_len is 64" in out[0].error
    assert out[1].outputs[0].finish_reason == "length" and len(out[1].outputs[0].token_ids) == 3
    assert llm.stats()["blocks_in_use"] == 0


def test_unpatch_leaves_no_attribute_and_a_dropped_model_is_collected():
    import gc
    import weakref

    model = FAMILIES["llama"]()
    attributes = set(model.__dict__)
    hybridkv.patch(model, max_model_len=64)
    hybridkv.unpatch(model)
    assert set(model.__dict__) == attributes
    hybridkv.patch(model, max_model_len=64)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_model_dropped_without_unpatch_leaves_no_entry_a_new_config_could_inherit():
    # The attention registry is keyed by id(config): a dropped model's entries go with its config, so a later config
    # given the same id is not taken for one that another patched model still reads (its unpatch would not restore it).
    import gc

    from hybridkv.patches import attention

    model = FAMILIES["llama"]()
    hybridkv.patch(model, max_model_len=64)
    key = id(model.config)
    assert attention._num_patched_models[key] == 1
    del model
    gc.collect()
    assert key not in attention._num_patched_models and key not in attention._original_implementation
