"""Images in prompts: the tokens of tiny random multimodal wrappers equal `model.generate(input_ids,
pixel_values=...)`'s, with one and two images, an image first, chunked prefill, prefix-cache hits and
preemption; the encoder cache skips the vision tower for an image seen again; bad inputs are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import models as hf

import hybridkv
from hybridkv import SamplingParams

from model_zoo import ZOO, _tiny, slow_except
from tiny_models import new_request_id

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def gemma3():
    """Gemma 3 with SigLIP: a 28-pixel image is 4 tokens, which attend to each other both ways."""
    model = ZOO["gemma3"]()
    # transformers starts the projector at zero (every image the same); random weights make images matter.
    torch.manual_seed(1)
    model.model.multi_modal_projector.mm_input_projection_weight.data.normal_(0, 1.0)
    return model, model.config.image_token_id, 4, {"token_type_ids"}


def mistral3():
    """Mistral 3 with Pixtral: a 56-pixel image is 2 x 2 tokens with a row break ([IMG_BREAK], here 250)
    after each row; causal."""
    text = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=56,
        patch_size=14, head_dim=16,
    )  # fmt: skip
    config = hf.mistral3.Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=255, spatial_merge_size=2, initializer_range=0.2
    )
    return _tiny(hf.mistral3.Mistral3ForConditionalGeneration, config), 255, 4, set()


def gemma4():
    """Gemma 4 with its vision tower (patches given as rows: a 4 x 4-patch image is 4 tokens), and
    `use_bidirectional_attention="vision"`: an image's tokens attend both ways on the sliding layers only."""
    from model_zoo import GEMMA4_TEXT, VOCAB, F, S

    text = dict(
        GEMMA4_TEXT, num_hidden_layers=6, layer_types=[S, S, F, S, S, F], num_kv_shared_layers=2,
        use_bidirectional_attention="vision", initializer_range=0.2,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=64,
    )  # fmt: skip
    special = ("image_token_id", "video_token_id", "audio_token_id", "boi_token_id", "eoi_token_id", "boa_token_id")
    config = hf.gemma4.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        tie_word_embeddings=False,
        eoa_token_index=VOCAB + len(special),
        **{field: VOCAB + i for i, field in enumerate(special)},
    )
    model = _tiny(hf.gemma4.Gemma4ForConditionalGeneration, config)
    model.config.text_config.pad_token_id = 0  # its forward embeds the pad id where placeholders sit
    return model, VOCAB, 4, {"mm_token_type_ids"}


FAMILIES = {"gemma3": gemma3, "gemma4": gemma4, "mistral3": mistral3}


def image_tokens(family, placeholder, count):
    if family == "mistral3":
        return [placeholder, placeholder, 250, placeholder, placeholder, 251]
    return [1] + [placeholder] * count + [2]


def image_inputs(family, seed, num_images):
    generator = torch.Generator().manual_seed(seed)
    if family == "gemma4":  # 16 patches of 4 x 4 x 3 values, on a 4 x 4 grid
        grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(1, 16, 2)
        return {
            "pixel_values": torch.randn(num_images, 16, 48, generator=generator),
            "image_position_ids": grid.repeat(num_images, 1, 1),
        }
    size = 56 if family == "mistral3" else 28
    data = {"pixel_values": torch.randn(num_images, 3, size, size, generator=generator)}
    if family == "mistral3":
        data["image_sizes"] = torch.tensor([[size, size]] * num_images)
    return data


def prompt_ids(family, placeholder, count, layout, seed=3):
    text = torch.randint(3, 200, (60,), generator=torch.Generator().manual_seed(seed)).tolist()
    image = image_tokens(family, placeholder, count)
    if layout == "first":
        return image + text[:20]
    if layout == "two":
        return text[:5] + image + text[5:25] + image + text[25:31]
    return text[:9] + image + text[9:30]


def reference(model, ids, data, type_fields, placeholder):
    extra = {name: (torch.tensor([ids]) == placeholder).long() for name in type_fields}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), **data, **extra, max_new_tokens=10, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module", params=slow_except(sorted(FAMILIES), fast=("mistral3",)))
def family(request):
    model, placeholder, count, type_fields = FAMILIES[request.param]()
    return request.param, model, placeholder, count, type_fields


@pytest.mark.parametrize("layout", ["middle", "first", "two"])
@pytest.mark.parametrize("chunk", [None, 8])
def test_tokens_equal_generate_with_images(family, layout, chunk, patched):
    name, model, placeholder, count, type_fields = family
    num_images = 2 if layout == "two" else 1
    data = image_inputs(name, 7, num_images)
    ids = prompt_ids(name, placeholder, count, layout)
    expected = reference(model, ids, data, type_fields, placeholder)
    settings = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = patched(model, max_model_len=128, block_size=4, **settings)
    (output,) = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": data}], GREEDY, use_tqdm=False)
    assert output.error is None and output.outputs[0].token_ids == expected
    # Another image changes the answer (so the images are really used).
    other = reference(model, ids, image_inputs(name, 8, num_images), type_fields, placeholder)
    assert other != expected
    assert llm.stats()["images_encoded"] == num_images


def test_gemma3s_images_attend_both_ways_and_that_changes_the_tokens(patched):
    model, placeholder, count, type_fields = gemma3()
    data = image_inputs("gemma3", 7, 1)
    ids = prompt_ids("gemma3", placeholder, count, "middle")
    expected = reference(model, ids, data, type_fields, placeholder)
    llm = patched(model, max_model_len=128, block_size=4, enable_prefix_caching=False)  # each run computes all
    assert llm.core.runner.context.image_layers == frozenset(range(6))
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": data}
    (both_ways,) = llm.generate([prompt], params, use_tqdm=False)
    assert both_ways.outputs[0].token_ids == expected[:1]
    llm.core.runner.context.image_layers = frozenset()  # as if causal: another distribution
    (causal,) = llm.generate([prompt], params, use_tqdm=False)
    difference = abs(both_ways.outputs[0].cumulative_logprob - causal.outputs[0].cumulative_logprob)
    assert difference > 1e-3


def test_prefix_cache_hits_the_same_image_only_and_the_encoder_cache_skips_the_tower(family, patched):
    name, model, placeholder, count, type_fields = family
    ids = prompt_ids(name, placeholder, count, "first")
    data, other = image_inputs(name, 7, 1), image_inputs(name, 8, 1)
    llm = patched(model, max_model_len=128, block_size=4)
    run = lambda d: llm.generate([{"prompt_token_ids": ids, "multi_modal_data": d}], GREEDY, use_tqdm=False)[0]  # noqa: E731
    first = run(data)
    hits = llm.stats()["prefix_cache_hits"]
    second = run({k: v.clone() for k, v in data.items()})  # equal content, another tensor
    stats = llm.stats()
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert stats["prefix_cache_hits"] - hits >= len(ids) // 4 * 4 - 4 and second.metrics.num_cached_tokens > 0
    assert (stats["images_encoded"], stats["image_cache_hits"]) == (1, 1)
    third = run(other)  # another image: the prompt starts with it, so nothing is hit
    assert third.metrics.num_cached_tokens == 0
    assert third.outputs[0].token_ids == reference(model, ids, other, type_fields, placeholder)
    assert llm.stats()["encoder_cache_bytes"] <= llm.config.encoder_cache_bytes


def test_the_encoder_cache_keeps_within_its_bytes(patched):
    model, placeholder, count, _ = gemma3()
    ids = prompt_ids("gemma3", placeholder, count, "middle")
    one_image = count * model.config.text_config.hidden_size * 4
    llm = patched(model, max_model_len=128, block_size=4, encoder_cache_bytes=2 * one_image)
    for seed in range(4):
        llm.generate(
            [{"prompt_token_ids": ids, "multi_modal_data": image_inputs("gemma3", seed, 1)}], GREEDY, use_tqdm=False
        )
        assert llm.stats()["encoder_cache_bytes"] <= 2 * one_image
    assert llm.stats()["images_encoded"] == 4


def test_after_the_vision_tower_changes_images_are_encoded_again_and_older_encodings_refused(patched):
    """The encoder cache and the prefix cache follow the model (hybridkv/execution/model_watch.py): after the
    projector's weights change the same image is encoded again and the tokens are the new model's; a request whose image
    was encoded before the change, not yet admitted, fails with an error naming the fix rather than use it."""
    model, placeholder, count, type_fields = gemma3()
    ids = prompt_ids("gemma3", placeholder, count, "middle")
    data = image_inputs("gemma3", 7, 1)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": data}
    llm = patched(model, max_model_len=128, block_size=4)
    before = reference(model, ids, data, type_fields, placeholder)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before
    projector = model.model.multi_modal_projector.mm_input_projection_weight
    projector.data.mul_(-1.0)  # through .data: only the content sample sees it
    expected = reference(model, ids, data, type_fields, placeholder)
    assert expected != before
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert (llm.stats()["images_encoded"], llm.stats()["image_cache_hits"]) == (2, 0)
    stale = llm.add_request(
        new_request_id(), prompt, GREEDY
    )  # encoded now (a cache hit), admitted after the next change
    projector.data.mul_(2.0)
    (output,) = [o for o in llm.step() if o.request_id == stale]
    assert output.finished and "images were encoded" in output.error
    assert llm.stats()["blocks_in_use"] == 0 and not llm.has_unfinished_requests()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_with_images_keep_their_tokens(family, mode, patched):
    name, model, placeholder, count, type_fields = family
    prompts, expected = [], []
    for seed in range(8):
        ids = prompt_ids(name, placeholder, count, "middle", seed=seed)
        data = image_inputs(name, seed, 1)
        prompts.append({"prompt_token_ids": ids, "multi_modal_data": data})
        expected.append(reference(model, ids, data, type_fields, placeholder))
    # Room for the first chunks of two requests, not for both whole: they preempt each other.
    num_blocks = hybridkv.min_num_blocks(model, block_size=4, max_model_len=48, max_num_batched_tokens=16) + 24
    swap = {"preemption_mode": "swap", "swap_space": 1 / 256} if mode == "swap" else {}
    llm = patched(model, max_model_len=48, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=16, **swap)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and (stats["num_swaps"] > 0) == (mode == "swap")


def test_bad_image_inputs_are_refused_before_anything_runs(patched):
    model, placeholder, count, _ = gemma3()
    llm = patched(model, max_model_len=128, block_size=4)
    ids = prompt_ids("gemma3", placeholder, count, "middle")
    data = image_inputs("gemma3", 7, 1)
    with pytest.raises(ValueError, match="with no image given for it"):
        llm.add_request(new_request_id(), ids)
    with pytest.raises(ValueError, match="holds 4 image placeholder tokens"):
        llm.add_request(new_request_id(), {"prompt_token_ids": ids, "multi_modal_data": image_inputs("gemma3", 7, 2)})
    with pytest.raises(ValueError, match="images need the model's processor"):
        llm.add_request(new_request_id(), {"prompt": "a text", "multi_modal_data": {"image": torch.zeros(3, 28, 28)}})
    with pytest.raises(ValueError, match="images only"):
        llm.add_request(new_request_id(), {"prompt_token_ids": ids, "multi_modal_data": {"audio": [0.0]}})
    assert not llm.has_unfinished_requests()
    small = patched(ZOO["gemma3"](), max_model_len=128, block_size=4, max_num_batched_tokens=3)
    with pytest.raises(ValueError, match="one prefill chunk"):
        small.add_request(new_request_id(), {"prompt_token_ids": ids, "multi_modal_data": data})
    text_only = patched(ZOO["llama"](), max_model_len=64, block_size=4)
    with pytest.raises(ValueError, match="takes no images"):
        text_only.add_request(new_request_id(), {"prompt_token_ids": [1, 2, 3], "multi_modal_data": data})


@pytest.fixture(scope="module")
def vision():
    """A tiny Gemma 3 with its processor (PIL image processor, BPE tokenizer with Gemma 3's image tokens)."""
    from hybridkv.tiny import tiny_vision_model

    return tiny_vision_model()


def picture(seed):
    import numpy as np

    return (np.random.default_rng(seed).random((40, 60, 3)) * 255).astype("uint8")


def processed_reference(model, inputs, max_new_tokens=10):
    with torch.no_grad():
        kept = {k: v for k, v in inputs.items() if k != "attention_mask"}
        out = model.generate(**kept, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_raw_images_through_the_processor_and_chat_parts_equal_generate(vision, patched):
    model, processor = vision
    text = "Look: <start_of_image> and <start_of_image> what?"
    images = [picture(0), picture(1)]
    expected = processed_reference(model, processor(text=text, images=images, return_tensors="pt"))
    llm = patched(model, processor=processor, max_model_len=128, block_size=4)
    (output,) = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == expected and output.prompt == text
    conversation = [
        {"role": "user", "content": [{"type": "image", "image": images[0]}, {"type": "text", "text": "Hi"}]}
    ]
    rendered = processor.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=rendered, images=images[:1], add_special_tokens=False, return_tensors="pt")
    (chat,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert chat.outputs[0].token_ids == processed_reference(model, inputs)
    # stream and n > 1 take the same prompts
    streamed = [t for delta in llm.stream({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)
                for t in delta.token_ids]  # fmt: skip
    assert streamed == expected
    both = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, SamplingParams(
        n=2, temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]  # fmt: skip
    assert [c.token_ids for c in both.outputs] == [expected, expected]
    # Two images through the tower; the chat's, the stream's and the samples' from the encoder cache.
    assert llm.stats()["images_encoded"] == 2 and llm.stats()["image_cache_hits"] == 5


def test_async_engine_takes_image_prompts(vision, patched):
    import asyncio

    from hybridkv.async_engine import AsyncLLMEngine

    model, processor = vision
    text = "Look: <start_of_image> what?"
    expected = processed_reference(model, processor(text=text, images=[picture(2)], return_tensors="pt"))
    llm = patched(model, processor=processor, max_model_len=128, block_size=4)
    engine = AsyncLLMEngine(llm)
    try:
        outputs = engine.generate({"prompt": text, "multi_modal_data": {"image": picture(2)}}, GREEDY)
        output = asyncio.run(_last(outputs))
    finally:
        engine.shutdown()
    assert output.outputs[0].token_ids == expected


def test_beam_search_takes_images_and_equals_transformers(patched):
    from test_beam_search import K, assert_same_beams, hf_beam_search

    model, placeholder, count, type_fields = gemma3()
    data = image_inputs("gemma3", 7, 1)
    ids = prompt_ids("gemma3", placeholder, count, "middle")
    types = {name: (torch.tensor([ids]) == placeholder).long() for name in type_fields}
    expected = hf_beam_search(model, ids, **data, **types)
    llm = patched(model, max_model_len=128, block_size=4)
    (output,) = llm.beam_search([{"prompt_token_ids": ids, "multi_modal_data": data}], hybridkv.BeamSearchParams(
        beam_width=K, max_tokens=8, ignore_eos=True))  # fmt: skip
    assert_same_beams(output, expected)


def test_a_model_that_places_images_otherwise_is_refused_for_images(patched):
    """Qwen2-VL gives image tokens 3-D positions (M-RoPE): hybridkv's placement at 1-D positions would give
    other logits, so the first image prompt's check refuses images (text is still served)."""
    text = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    )  # fmt: skip
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3, mlp_ratio=2)  # fmt: skip
    config = hf.qwen2_vl.Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=250, vision_start_token_id=251, vision_end_token_id=252
    )
    model = _tiny(hf.qwen2_vl.Qwen2VLForConditionalGeneration, config)
    llm = patched(model, max_model_len=128, block_size=4)
    data = {"pixel_values": torch.randn(1, 16, 3 * 2 * 14 * 14), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    ids = [5, 6, 7, 251] + [250] * 4 + [252, 8, 9, 10]
    for _ in range(2):  # the verdict is kept
        with pytest.raises(ValueError, match="does not place images the way hybridkv does"):
            llm.add_request(new_request_id(), {"prompt_token_ids": ids, "multi_modal_data": data})
    assert llm.images.num_encoded == 1 and not llm.has_unfinished_requests()  # refused at once the second time
    assert llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0].error is None


async def _last(outputs):
    """The last of an async iterator's items (AsyncLLMEngine.generate's finished output)."""
    return [output async for output in outputs][-1]
