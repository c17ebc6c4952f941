"""Every bad setting is a clear error when it is given, not later: SamplingParams, EngineConfig and the
model-dependent checks at patch time (max_model_len against the model's context, weights not loaded)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from accelerate import init_empty_weights

import hybridkv
from hybridkv import EngineConfig, SamplingParams
from hybridkv.execution import config as config_module
from hybridkv.sampling.sampler import SamplingRow, sample
from hybridkv.tiny import tiny_model

from tiny_models import prompts

# ---- SamplingParams: types --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(max_tokens=2.5), r"max_tokens must be an int, got 2\.5 \(float\)$"),
        (dict(n=2.0), r"n must be an int, got 2\.0 \(float\); pass n=2$"),
        (dict(min_tokens=1.0), r"min_tokens must be an int, got 1\.0 \(float\); pass min_tokens=1$"),
        (dict(top_k=5.0), r"top_k must be an int, got 5\.0 \(float\); pass top_k=5$"),
        (dict(logprobs=1.5), r"logprobs must be an int, got 1\.5 \(float\)$"),
        (dict(seed=1.5), r"seed must be an int, got 1\.5 \(float\)$"),
    ],
)
def test_a_count_given_as_a_float_is_a_type_error(params, message):
    with pytest.raises(TypeError, match=message):
        SamplingParams(**params)


@pytest.mark.parametrize("name", ["n", "max_tokens", "min_tokens", "top_k", "seed"])
def test_a_bool_is_not_a_count(name):
    with pytest.raises(TypeError, match=rf"^{name} must be an int, got True \(bool\)$"):
        SamplingParams(**{name: True})


def test_logprobs_true_means_one_and_seed_minus_one_none_as_in_vllm():
    params = SamplingParams(logprobs=True, prompt_logprobs=True, seed=-1)
    assert (params.logprobs, params.prompt_logprobs, params.seed) == (1, 1, None)


def test_a_string_seed_is_a_type_error():
    with pytest.raises(TypeError, match=r"^seed must be an int, got '7' \(str\)$"):
        SamplingParams(seed="7")


def test_a_seed_beyond_64_bits_is_a_value_error():
    with pytest.raises(ValueError, match=r"seed must be in \[-2\*\*63, 2\*\*64 - best_of\].*got 18446744073709551616$"):
        SamplingParams(seed=2**64)


def test_numpy_ints_are_stored_as_ints():
    params = SamplingParams(seed=np.int64(3), max_tokens=np.int32(5), stop_token_ids=np.array([4, 9]))
    assert (type(params.seed), params.seed, type(params.max_tokens), params.max_tokens) == (int, 3, int, 5)
    assert params.stop_token_ids == [4, 9] and all(type(t) is int for t in params.stop_token_ids)


def test_cache_salt_must_be_a_string():
    with pytest.raises(TypeError, match=r"^cache_salt must be a string or None, got 5 \(int\)$"):
        SamplingParams(cache_salt=5)


def test_ignore_eos_must_be_a_bool():
    with pytest.raises(TypeError, match=r"^ignore_eos must be True or False, got 'yes' \(str\)$"):
        SamplingParams(ignore_eos="yes")


def test_a_bare_stop_token_id_names_the_list_to_pass():
    with pytest.raises(TypeError, match=r"got 5; pass stop_token_ids=\[5\]$"):
        SamplingParams(stop_token_ids=5)


@pytest.mark.parametrize("stop_token_ids", [[1, "x"], [1.0, 2.0], [True], "ab"])
def test_stop_token_ids_must_be_ints(stop_token_ids):
    with pytest.raises(TypeError, match=r"^stop_token_ids must be a list of ints, got "):
        SamplingParams(stop_token_ids=stop_token_ids)


def test_a_negative_stop_token_id_is_a_value_error():
    with pytest.raises(ValueError, match=r"^stop_token_ids must be token ids >= 0, got \[3, -1\]$"):
        SamplingParams(stop_token_ids=[3, -1])


@pytest.mark.parametrize("stop", [5, [1], ["a", None], b"ab"])
def test_stop_must_be_a_string_or_strings(stop):
    with pytest.raises(TypeError, match=r"^stop must be a string or a list of strings, got "):
        SamplingParams(stop=stop)


@pytest.mark.parametrize(
    "name", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]
)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_non_finite_float_is_a_value_error(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be a finite number, got {value}$"):
        SamplingParams(**{name: value})


def test_a_float_setting_given_as_a_string_is_a_type_error():
    with pytest.raises(TypeError, match=r"^temperature must be a number, got '0.5' \(str\)$"):
        SamplingParams(temperature="0.5")


# ---- SamplingParams: meanings -----------------------------------------------------------------


def test_top_k_zero_or_minus_one_turns_top_k_off_as_in_vllm():
    assert SamplingParams().top_k == 0 and not SamplingParams().top_k_on and not SamplingParams(top_k=-1).top_k_on
    with pytest.raises(ValueError, match=r"^top_k must be 0 or -1 \(off\) or >= 1, got -2$"):
        SamplingParams(top_k=-2)


def test_a_temperature_below_1e_5_is_greedy():
    temperatures = (0, 1e-40, 9.99e-6, 1e-5, 0.5)
    assert [SamplingParams(temperature=t).greedy for t in temperatures] == [True, True, True, False, False]


def test_the_sampler_takes_the_argmax_at_a_tiny_temperature():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 2.9, 1.0]])
    rows = [SamplingRow(SamplingParams(temperature=1e-40), None, [], 0) for _ in range(2)]
    rows.append(SamplingRow(SamplingParams(seed=0), torch.Generator().manual_seed(0), [], 0))
    tokens, _ = sample(torch.cat([logits, logits[:1]]), rows)
    assert tokens[:2] == [1, 0]


def test_a_request_at_a_tiny_temperature_gives_exactly_the_greedy_tokens(patched):
    llm = patched(tiny_model("llama"), max_model_len=128)
    batch = prompts((30, 45))
    greedy = llm.generate(batch, SamplingParams(temperature=0, max_tokens=10))
    tiny = llm.generate(batch, SamplingParams(temperature=1e-40, max_tokens=10))
    assert [o.outputs[0].token_ids for o in tiny] == [o.outputs[0].token_ids for o in greedy]


# ---- EngineConfig -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        (dict(block_size=0), ValueError, r"^block_size must be >= 1, got 0$"),
        (dict(block_size=16.0), TypeError, r"^block_size must be an int, got 16\.0 \(float\); pass block_size=16$"),
        (dict(num_blocks=100.0), TypeError, r"^num_blocks must be an int, got 100\.0 \(float\); pass num_blocks=100$"),
        (dict(num_blocks=1), ValueError, r"^num_blocks must be >= 2 \(block 0 is the null block, never used\), got 1$"),
        (dict(kv_cache_memory=0), ValueError, r"^kv_cache_memory must be >= 1 \(bytes\), got 0$"),
        (dict(kv_cache_memory=1.5e9), TypeError, r"^kv_cache_memory must be an int, got 1500000000\.0 \(float\)"),
        (dict(max_model_len=0), ValueError, r"^max_model_len must be >= 1, got 0$"),
        (dict(max_model_len=-5), ValueError, r"^max_model_len must be >= 1, got -5$"),
        (dict(max_num_seqs=0), ValueError, r"^max_num_seqs must be >= 1, got 0$"),
        (dict(max_num_batched_tokens=0), ValueError, r"^max_num_batched_tokens must be >= 1, got 0$"),
        (
            dict(long_prefill_token_threshold=-1),
            ValueError,
            r"^long_prefill_token_threshold must be >= 0 \(0 turns the cap off\), got -1$",
        ),
        (
            dict(swap_space=-1),
            ValueError,
            r"^swap_space must be >= 0 \(GiB of CPU memory for swapped requests\), got -1.0$",
        ),
        (dict(swap_space=True), TypeError, r"^swap_space must be a number, got True \(bool\)$"),
    ],
)
def test_a_count_setting_out_of_range_or_of_the_wrong_type_names_the_rule(settings, error, message):
    with pytest.raises(error, match=message):
        EngineConfig(**settings)


@pytest.mark.parametrize("utilization", [0, -0.1, 1.01, 2])
def test_gpu_memory_utilization_must_be_a_share(utilization):
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=utilization)


def test_gpu_memory_utilization_must_be_finite():
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization must be a finite number, got nan$"):
        EngineConfig(gpu_memory_utilization=math.nan)


@pytest.fixture
def host_of_16_gib(monkeypatch):
    """A host with 16 GiB of memory, whatever this one has: 70% of it is 11.20 GiB."""
    monkeypatch.setattr(config_module, "host_memory_bytes", lambda: 16 << 30)


def test_swap_space_beyond_70_percent_of_the_hosts_memory_names_the_most_it_may_be(host_of_16_gib):
    message = (
        r"^swap_space=1e\+06 GiB asks for 1,073,741,824,000,000 bytes of CPU memory, more than 70% of the host's "
        r"17,179,869,184 bytes; lower swap_space to at most 11\.20 GiB$"
    )
    with pytest.raises(ValueError, match=message):
        EngineConfig(preemption_mode="swap", swap_space=10**6)


def test_swap_space_given_with_recompute_is_checked_too_and_the_error_says_it_is_not_taken(host_of_16_gib):
    message = (
        r"^swap_space=12 GiB asks for 12,884,901,888 bytes of CPU memory, more than 70% of the host's 17,179,869,184 "
        r"bytes; lower swap_space to at most 11\.20 GiB, or leave it out: preemption_mode='recompute' takes none$"
    )
    with pytest.raises(ValueError, match=message):
        EngineConfig(swap_space=12)


def test_swap_space_up_to_70_percent_of_the_hosts_memory_is_accepted(host_of_16_gib):
    assert EngineConfig(preemption_mode="swap", swap_space=11.2).swap_space_bytes == int(11.2 * (1 << 30))


def test_the_default_swap_space_passes_on_a_small_host_where_recompute_takes_none(monkeypatch):
    monkeypatch.setattr(config_module, "host_memory_bytes", lambda: 2 << 30)
    assert EngineConfig().swap_space_bytes == 0
    with pytest.raises(ValueError, match=r"^swap_space=4 GiB asks for .* lower swap_space to at most 1\.40 GiB$"):
        EngineConfig(preemption_mode="swap")


def test_hybridkv_patch_refuses_a_petabyte_of_swap_space_and_leaves_the_model_alone():
    model = tiny_model("gemma3")
    with pytest.raises(ValueError, match=r"^swap_space=1e\+06 GiB asks for .* more than 70% of the host's"):
        hybridkv.patch(model, swap_space=10**6)
    assert not hybridkv.is_patched(model)


def test_preemption_mode_must_be_recompute_or_swap():
    with pytest.raises(ValueError, match=r"^preemption_mode must be one of \('recompute', 'swap'\), got 'Swap'$"):
        EngineConfig(preemption_mode="Swap")


def test_attention_backend_must_be_none_torch_or_triton():
    with pytest.raises(ValueError, match=r"^attention_backend must be one of \(None, 'torch', 'triton'\), got 'cuda'$"):
        EngineConfig(attention_backend="cuda")


def test_kv_cache_dtype_must_be_a_dtype_its_name_or_a_dict_of_them():
    with pytest.raises(TypeError, match=r"^kv_cache_dtype must be None \(the model's dtype\), a torch dtype"):
        EngineConfig(kv_cache_dtype=8)


@pytest.mark.parametrize(
    ("dtype", "error"),
    [
        (torch.int8, r"^kv_cache_dtype=torch.int8 is not a KV page dtype; use torch.float32, .*float8_e5m2$"),
        (torch.float64, r"^kv_cache_dtype=torch.float64 is not a KV page dtype"),
        ("fp4", r"^kv_cache_dtype='fp4' is not a dtype; use torch.float32, .* \(or 'fp8', 'fp8_e5m2'\)$"),
        ({"global": torch.bfloat16}, r"^kv_cache_dtype names layer kinds 'full', 'sliding', 'chunked', got 'global'$"),
        ({"sliding": "int8"}, r"^kv_cache_dtype\['sliding'\]=torch.int8 is not a KV page dtype"),
    ],
)
def test_kv_cache_dtype_must_be_one_pages_can_hold(dtype, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig(kv_cache_dtype=dtype)


def test_enable_prefix_caching_must_be_a_bool():
    with pytest.raises(TypeError, match=r"^enable_prefix_caching must be True or False, got 1 \(int\)$"):
        EngineConfig(enable_prefix_caching=1)


def test_an_unknown_setting_names_the_closest_valid_ones():
    with pytest.raises(TypeError, match=r"^unknown hybridkv setting 'blok_size' \(did you mean block_size\?\); the "):
        EngineConfig.from_kwargs(blok_size=8)


def test_min_num_blocks_names_the_closest_setting_to_an_unknown_one():
    with pytest.raises(TypeError, match=r"'max_len' \(did you mean max_model_len[ ?]"):  # the closest first
        hybridkv.min_num_blocks(tiny_model("llama"), max_len=64)


def test_patch_names_the_closest_setting_to_an_unknown_one():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match=r"'blok_size' \(did you mean block_size\?\)"):
        hybridkv.patch(model, blok_size=8)
    assert not hybridkv.is_patched(model)


# ---- at patch time ----------------------------------------------------------------------------


def test_max_model_len_beyond_max_position_embeddings_is_refused():
    model = tiny_model("llama", max_position_embeddings=256)
    with pytest.raises(
        ValueError,
        match=r"^max_model_len=257 is beyond the model's max_position_embeddings=256; pass max_model_len <= 256$",
    ):
        hybridkv.patch(model, max_model_len=257)
    assert not hybridkv.is_patched(model)


def test_a_config_without_max_position_embeddings_needs_max_model_len(monkeypatch, patched):
    model = tiny_model("llama")
    # As a remote-code config that never declares it (transformers' own configs always do).
    monkeypatch.delattr(model.config, "max_position_embeddings")
    monkeypatch.delattr(type(model.config), "max_position_embeddings")
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM's config has no max_position_embeddings; pass max_model"):
        hybridkv.patch(model)
    assert patched(model, max_model_len=96).max_model_len == 96


def test_yarn_rope_scaling_stretches_the_context_beyond_max_position_embeddings(patched):
    rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0}
    model = tiny_model("llama", max_position_embeddings=128, rope_parameters=rope)
    assert patched(model, max_model_len=256, num_blocks=64).max_model_len == 256
    with pytest.raises(ValueError, match=r"beyond the model's YaRN context of factor 2\.0 x original_max_position"):
        hybridkv.patch(model, max_model_len=257, num_blocks=64)


def test_a_model_built_on_the_meta_device_is_refused_at_patch_time():
    with torch.device("meta"):
        model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"weights on the meta device.*Load the weights first, or use accelerate's"):
        hybridkv.patch(model, max_model_len=128)


def test_a_model_built_under_init_empty_weights_is_refused_at_patch_time():
    with init_empty_weights():
        model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"weights on the meta device that nothing loads \(model\.embed_tokens, "):
        hybridkv.patch(model, max_model_len=128)


def test_one_layer_left_on_the_meta_device_is_refused_at_patch_time():
    model = tiny_model("llama")
    model.model.layers[1].mlp.to("meta")
    message = (
        r"^LlamaForCausalLM has weights on the meta device that nothing loads \(model\.layers\.1\.mlp\.gate_proj, "
        r"model\.layers\.1\.mlp\.up_proj, model\.layers\.1\.mlp\.down_proj\)"
    )
    with pytest.raises(ValueError, match=message):
        hybridkv.patch(model, max_model_len=128)
    assert not hybridkv.is_patched(model)
