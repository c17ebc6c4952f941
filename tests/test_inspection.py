"""The patch-time probe: a model is served by what its attention layers do, not by its name."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
from transformers import masking_utils as mu

import hybridkv
from hybridkv import SamplingParams
from hybridkv.patches.inspection import inspect_model
from hybridkv.patches.visibility import visibility_of_function, visibility_of_tensor

from tiny_models import COMMON, FAMILIES, WINDOW, hf_greedy, new_request_id, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def greedy(model, batch, **settings):
    llm = hybridkv.patch(model, max_model_len=256, block_size=8, **settings)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    finally:
        hybridkv.unpatch(model)


# ---- reading masks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("function", "kind", "window"),
    [
        (mu.causal_mask_function, "causal", None),
        (mu.sliding_window_causal_mask_function(4096), "window", 4096),
        (mu.sliding_window_causal_mask_function(1), "window", 1),
        (mu.chunked_causal_mask_function(8192, torch.zeros(1, dtype=torch.long)), "chunked", None),
        (mu.bidirectional_mask_function, "bidirectional", None),
    ],
    ids=["causal", "window-4096", "window-1", "chunked", "bidirectional"],
)
def test_mask_functions_are_read_far_beyond_the_probe(function, kind, window):
    visibility = visibility_of_function(function, horizon=1 << 16)
    assert (visibility.kind, visibility.window, visibility.exact) == (kind, window, True)


def test_a_mask_function_that_reads_a_probe_sized_tensor_is_left_to_the_materialized_mask():
    padding = mu.padding_mask_function(torch.ones(1, 40, dtype=torch.bool))
    assert visibility_of_function(mu.and_masks(mu.causal_mask_function, padding), horizon=1 << 16) is None


def test_materialized_masks_show_windows_shorter_than_the_probe():
    sliding = mu.sdpa_mask(
        1, 12, 12, mask_function=mu.sliding_window_causal_mask_function(5), allow_is_causal_skip=False
    )
    causal = mu.eager_mask(1, 12, 12, mask_function=mu.causal_mask_function)  # float: 0 visible, min hidden
    assert visibility_of_tensor(sliding) == visibility_of_function(mu.sliding_window_causal_mask_function(5), 64)
    assert (visibility_of_tensor(causal).kind, visibility_of_tensor(causal).exact) == ("causal", False)


# ---- one source of truth for windows -----------------------------------------------------------


def qwen2_moe_sliding():
    config = Qwen2MoeConfig(
        **{**COMMON, "num_hidden_layers": 4},
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(config).eval()


def test_a_window_given_only_through_the_mask_is_the_layout_window():
    model = qwen2_moe_sliding()
    layout = inspect_model(model, torch.float32)
    assert [spec.sliding_window for spec in layout.specs] == [WINDOW, None, WINDOW, None]
    batch = prompts((40, 150))
    assert greedy(model, batch) == [hf_greedy(model, p, 12)[0] for p in batch]


def test_a_mask_without_the_declared_window_is_refused(monkeypatch):
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    model = qwen2_moe_sliding()
    monkeypatch.setattr(modeling_qwen2_moe, "create_sliding_window_causal_mask", mu.create_causal_mask)
    with pytest.raises(
        ValueError,
        match=r"layers 0, 2: the mask keeps every earlier key, but the config declares a sliding window of 16",
    ):
        hybridkv.patch(model)
    assert not hybridkv.is_patched(model)


def test_a_passed_window_that_disagrees_with_the_config_is_refused():
    model = FAMILIES["gemma3_text"]()
    model.config.sliding_window = 8  # the masks follow the config, the modules still pass 16
    with pytest.raises(
        ValueError,
        match=r"layers 0, 1, 2, 3, 4: the layer passes sliding_window=16 to attention, but its config declares "
        r"a sliding window of 8",
    ):
        hybridkv.patch(model)


def test_the_window_a_model_really_uses_is_served_exactly():
    model = FAMILIES["gemma3_text"]()
    model.config.sliding_window = 8
    for module in model.modules():
        if getattr(module, "sliding_window", None):
            module.sliding_window = 8
    assert [spec.sliding_window for spec in inspect_model(model, torch.float32).specs] == [8] * 5 + [None]
    batch = prompts((30, 100))
    assert greedy(model, batch) == [hf_greedy(model, p, 12)[0] for p in batch]


def test_a_window_changed_after_patching_fails_the_step_loudly(patched):
    model = FAMILIES["gemma3_text"]()
    llm = patched(model, max_model_len=256)
    for module in model.modules():
        if getattr(module, "sliding_window", None):
            module.sliding_window = 8
    (output,) = llm.generate([prompts((30,))[0]], GREEDY, use_tqdm=False)
    assert output.outputs[0].finish_reason == "error"
    assert "passes sliding_window=8 to attention, but hybridkv's layout gives it 16" in output.error
    assert llm.stats()["blocks_in_use"] == 0


# ---- layers that do not go through the attention interface -------------------------------------


def test_a_layer_that_bypasses_the_attention_interface_is_refused():
    model = FAMILIES["llama"]()
    attn = model.model.layers[1].self_attn

    def own_attention(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None

    attn.forward = types.MethodType(own_attention, attn)
    with pytest.raises(ValueError, match=r"layer 1: LlamaAttention never calls transformers' attention interface"):
        hybridkv.patch(model)


def test_a_layer_that_drops_the_forward_keyword_arguments_is_refused():
    model = FAMILIES["llama"]()
    attn = model.model.layers[0].self_attn
    original = attn.forward
    attn.forward = lambda hidden_states, position_embeddings, attention_mask, **kwargs: original(
        hidden_states, position_embeddings, attention_mask
    )
    with pytest.raises(ValueError, match=r"layer 0: LlamaAttention does not pass the forward's keyword arguments"):
        hybridkv.patch(model)


def test_an_attention_input_the_kernels_do_not_implement_is_refused_at_patch_time():
    model = FAMILIES["llama"]()
    attn = model.model.layers[0].self_attn
    original = attn.forward
    attn.forward = lambda *args, **kwargs: original(*args, **kwargs, rope_bias=1.0)
    with pytest.raises(ValueError, match=r"layer 0: LlamaAttention passes \['rope_bias'\].*does not implement"):
        hybridkv.patch(model)


def test_a_layer_whose_query_heads_are_not_a_multiple_of_its_kv_heads_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    # The kernels give q head h kv head h // (q_heads // kv_heads): with 4 q heads for 3 kv heads, q head 3
    # would read a fourth kv head that does not exist, which the Triton kernel does without an error.
    config = LlamaConfig(**{**COMMON, "num_key_value_heads": 3}, num_hidden_layers=2)
    torch.manual_seed(0)
    with pytest.raises(
        ValueError,
        match=r"layers 0, 1: 4 query heads for 3 kv heads; the kernels need a whole number of queries per kv head",
    ):
        inspect_model(LlamaForCausalLM(config).eval(), torch.float32)


def test_a_model_that_cannot_run_the_probe_says_what_a_model_needs():
    model = FAMILIES["llama"]()
    model.model.embed_tokens.forward = lambda ids: (_ for _ in ()).throw(RuntimeError("broken embedding"))
    with pytest.raises(ValueError, match=r"40-token forward.*broken embedding.*plain causal forward"):
        hybridkv.patch(model)


def test_the_probe_leaves_an_unpatched_model_as_it_was():
    model = FAMILIES["gemma2"]()
    before = model.config._attn_implementation
    inspect_model(model, torch.float32)
    assert model.config._attn_implementation == before
    batch = prompts((20,))
    assert greedy(model, batch) == [hf_greedy(model, batch[0], 12)[0]]


# ---- multimodal wrappers -----------------------------------------------------------------------


def test_a_multimodal_wrapper_serves_text_and_leaves_its_vision_tower_as_it_was(patched):
    from model_zoo import ZOO

    model = ZOO["gemma3"]()
    vision = model.config.vision_config
    pixels = torch.randn(
        1, vision.num_channels, vision.image_size, vision.image_size, generator=torch.Generator().manual_seed(0)
    )
    with torch.inference_mode():
        before = model.model.get_image_features(pixel_values=pixels).pooler_output
    model.config.image_token_index = 200  # the tiny vocabulary (256) does not hold Gemma 3's own id
    llm = patched(model, max_model_len=256)
    with torch.inference_mode():
        after = model.model.get_image_features(pixel_values=pixels).pooler_output
    assert torch.equal(before, after)
    placeholder = r"holds token 200, the model's image placeholder \(config.image_token_index\), with no image given"
    with pytest.raises(ValueError, match=placeholder):
        llm.add_request(new_request_id(), [5, 200, 7])
    batch = [[token for token in prompt if token != 200] for prompt in prompts((30, 120))]
    assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == [
        hf_greedy(model, p, 12)[0] for p in batch
    ]
    assert llm.stats()["blocks_in_use"] == 0


def test_a_sliding_layer_that_no_mask_reaches_is_refused(monkeypatch):
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    model = qwen2_moe_sliding()
    monkeypatch.setattr(modeling_qwen2_moe, "create_sliding_window_causal_mask", lambda **kwargs: None)
    with pytest.raises(
        ValueError,
        match=r"layers 0, 2: no mask reaches the layer, so the window of 16 its config declares cannot be confirmed",
    ):
        hybridkv.patch(model)


# ---- KV-sharing layers -------------------------------------------------------------------------


def test_kv_sharing_layers_read_their_source_pages_and_hold_none(patched):
    from model_zoo import ZOO

    model = ZOO["gemma3n_text"]()  # 6 layers; the last 3 reuse the K/V of the last layer of their kind
    specs = inspect_model(model, torch.float32).specs
    assert [spec.kv_source for spec in specs] == [None, None, None, 1, 1, 2]
    llm = patched(model, max_model_len=256, block_size=8)
    stats = llm.stats()
    assert stats["shared_kv_layers"] == {3: 1, 4: 1, 5: 2}
    assert sorted(layer for g in llm.kv_config.groups for layer in g.layer_indices) == [0, 1, 2]
    # 3 of 6 layers hold pages: 2 kv heads x (16 + 16) dims x 4 bytes each.
    assert stats["kv_bytes_per_token"] == 3 * 2 * 32 * 4
    shared, source = llm.core.runner.layers[4], llm.core.runner.layers[1]
    assert shared.key_cache.data_ptr() == source.key_cache.data_ptr() and not shared.writes_kv
    batch = prompts((40, 150))
    assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == [
        hf_greedy(model, p, 12)[0] for p in batch
    ]


# ---- chunked local attention -------------------------------------------------------------------


def test_chunked_masks_are_read_from_the_mask_function_and_from_a_materialized_mask():
    from transformers.masking_utils import chunked_causal_mask_function

    from hybridkv.patches.visibility import Visibility, visibility_of_function, visibility_of_tensor

    no_padding = torch.zeros(1, dtype=torch.long)
    for chunk in (16, 5000, 8192):  # 65,536 is a multiple of 16 and 8,192, not of 5,000
        assert visibility_of_function(chunked_causal_mask_function(chunk, no_padding), 65536) == Visibility(
            "chunked", chunk=chunk
        )
    queries, keys = torch.arange(40)[:, None], torch.arange(40)[None]
    assert visibility_of_tensor(((keys <= queries) & (keys // 16 == queries // 16))[None, None]).chunk == 16
    # Chunks longer than the mask cannot show: causal, not exact, and refused for a chunked layer.
    longer = visibility_of_tensor(((keys <= queries) & (keys // 64 == queries // 64))[None, None])
    assert (longer.kind, longer.exact) == ("causal", False)


def test_chunked_layers_get_the_configs_chunk_size():
    from model_zoo import ZOO

    specs = inspect_model(ZOO["llama4_text"](), torch.float32).specs
    assert [(spec.sliding_window, spec.attention_chunk_size) for spec in specs] == [(None, 16)] * 3 + [(None, None)]


def test_a_chunked_layer_whose_mask_shows_no_chunks_is_refused(monkeypatch):
    from transformers.models.llama4 import modeling_llama4

    from model_zoo import ZOO

    model = ZOO["llama4_text"]()
    monkeypatch.setattr(modeling_llama4, "create_chunked_causal_mask", modeling_llama4.create_causal_mask)
    with pytest.raises(
        ValueError,
        match=r"layers 0, 1, 2: the mask that reaches the layer does not show its chunks, so the chunked local "
        r"attention of 16 its config declares cannot be confirmed",
    ):
        hybridkv.patch(model)


def llama4_with_temperature_from(floor_scale: int):
    from transformers.models.llama4 import Llama4ForCausalLM

    from model_zoo import ZOO

    config = ZOO["llama4_text"]().config
    config.floor_scale, config.attn_scale = floor_scale, 0.5
    torch.manual_seed(0)
    return Llama4ForCausalLM(config).eval()


def test_llama4_temperature_tuning_bounds_max_model_len_and_the_step_rows(patched):
    """Its no-RoPE layers count positions from their own cache: past floor_scale - 1 tokens (or step rows)
    a step would give other tokens than generate (measured), so hybridkv caps or refuses."""
    model = llama4_with_temperature_from(64)
    with pytest.raises(ValueError, match=r"max_model_len=256 is beyond .*floor_scale=64.*Pass max_model_len <= 63"):
        hybridkv.patch(model, max_model_len=256)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=2048 .*Pass max_num_batched_tokens <= 63"):
        hybridkv.patch(model, max_model_len=63)
    assert not hybridkv.is_patched(model)
    with pytest.warns(UserWarning, match="up to 63 tokens"):
        llm = patched(model, max_num_batched_tokens=32, block_size=8)
    assert llm.max_model_len == 63
    batch = prompts((20, 40))
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 12)[0] for p in batch]


def test_a_model_that_does_not_generate_is_refused_as_not_a_causal_decoder():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    model = BertForMaskedLM(config).eval()
    with pytest.raises(ValueError, match=r"BertForMaskedLM is not a causal decoder: it does not generate text"):
        hybridkv.patch(model, max_model_len=128)
    assert not hybridkv.is_patched(model)
