"""Many LoRA adapters at once (issue 65): requests naming PEFT adapters (`lora_request`, vLLM's API) run mixed in one
step, each with its own adapter, and their tokens equal PEFT's own generate with that adapter loaded, on a Llama, a
Gemma 3 (sliding and full layers), a Qwen3.5 (Gated DeltaNet state layers), a Nemotron-H (Mamba2 state layers) and a
MiniCPM3 (latent attention); in every mode; with the prefix cache keyed per adapter; and bad requests refused."""

from __future__ import annotations

import json
import random

import pytest
import torch
from lora_adapters import make_adapters, peft_greedy

import hybridkv
from hybridkv.tiny import tiny_model

from model_zoo import ZOO, slow_except
from tiny_models import DEVICE

NEW = 6
GREEDY = hybridkv.SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)

MODELS = {
    "llama": lambda: tiny_model("llama", vocab_size=500, max_position_embeddings=1024),
    "gemma3": lambda: tiny_model("gemma3", vocab_size=500, sliding_window=8, max_position_embeddings=1024),
    "qwen3_5": lambda: tiny_model("qwen3_5", vocab_size=500, max_position_embeddings=1024),
    "nemotron_h": ZOO["nemotron_h"],
    "minicpm3": ZOO["minicpm3"],
}
# PEFT itself refuses a Mamba layer's out_proj and conv1d (a fused kernel reads their weights).
TARGETS = {"nemotron_h": ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]}


# Their hits land on state checkpoints, every 64 tokens by default: these prompts are shorter.
MODELS_WITH_STATES = {"qwen3_5", "nemotron_h"}


def prompts(count: int, seed: int = 0, vocab: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(12, 40))] for _ in range(count)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Per model: the model, three adapters and PEFT's tokens for eight prompts (the model alone for two)."""
    cache = {}

    def build(name: str):
        if name not in cache:
            model = MODELS[name]()
            folder = tmp_path_factory.mktemp(f"lora-{name}")
            adapters = make_adapters(model, folder, 3, TARGETS.get(name, "all-linear"))
            batch = prompts(8, seed=1)
            which = [None, adapters[0], adapters[1], adapters[2], adapters[0], None, adapters[2], adapters[1]]
            expected = [peft_greedy(model, a, p, NEW) for a, p in zip(which, batch, strict=True)]
            cache[name] = model, adapters, batch, which, expected
        return cache[name]

    return build


def tokens(outputs) -> list[list[int]]:
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", slow_except(list(MODELS), fast=("llama", "qwen3_5", "minicpm3")))
def test_mixed_adapters_in_one_batch_equal_peft_per_adapter(name, built):
    model, _, batch, which, expected = built(name)
    assert len({tuple(t) for t in expected}) == len(expected)  # every adapter changes the tokens
    llm = hybridkv.patch(model, enable_lora=True, max_loras=3, max_lora_rank=16)
    try:
        got = tokens(llm.generate(batch, GREEDY, lora_request=which, use_tqdm=False))
        stats = llm.stats()["lora"]
    finally:
        hybridkv.unpatch(model)
    assert got == expected
    assert stats["loads"] == 3 and sorted(stats["slots"]) == ["a0", "a1", "a2"]
    # unpatch removes every hook: the model computes as it did.
    assert not any(m._forward_hooks for m in model.modules())


def patch_on_kernels(model, **settings):
    """`model` patched with LoRA's Triton kernels (hybridkv/kernels/triton_lora.py) for rows on several adapters: moved
    to the GPU on a HYBRIDKV_TEST_ON_GPU=1 run (the kernels compiled), else forced on the CPU (interpreted). The caller
    unpatches it and moves it back to the CPU."""
    if DEVICE.type == "cuda":
        model.to(DEVICE)
        settings["kv_cache_memory"] = 1 << 30  # not 0.9 of the GPU: millions of a tiny model's blocks
    llm = hybridkv.patch(model, **settings)
    llm.core.lora.backend = "triton"
    return llm


# Slow: the fast tier checks the kernels themselves (tests/test_triton_lora.py) and the torch path's tokens.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_the_triton_kernels_give_each_adapters_tokens(name, built, monkeypatch):
    """The linear hook's CUDA path: the tokens of a batch over the three adapters and the model alone equal PEFT's, as
    the torch path's do (a prefill step and a decode step). Qwen3.5's state layers run per request segment, each its own
    set of rows. Four prompts, two tokens: the interpreter takes ~10 ms a program."""
    from hybridkv.kernels import triton_lora

    model, adapters, batch, which, expected = built(name)
    assert which[:4] == [None, *adapters]
    launches = []
    expand = triton_lora.lora_expand
    monkeypatch.setattr(triton_lora, "lora_expand", lambda *args: launches.append(1) or expand(*args))
    few = hybridkv.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    try:
        llm = patch_on_kernels(model, enable_lora=True, max_loras=3, max_lora_rank=16)
        got = tokens(llm.generate(batch[:4], few, lora_request=which[:4], use_tqdm=False))
    finally:
        if hybridkv.is_patched(model):
            hybridkv.unpatch(model)
        model.to("cpu")
    assert got == [t[:2] for t in expected[:4]]
    assert launches


MODES = {
    "chunked prefill": dict(max_num_batched_tokens=16),
    "recompute, tiny pool": dict(block_size=4, max_model_len=64),
    "swap, tiny pool": dict(block_size=4, max_model_len=64, preemption_mode="swap", swap_space=0.01),
    "ngram speculation": dict(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    ),
    "async scheduling": dict(async_scheduling=True),
}


# The fast tier: every mode on Llama; on Qwen3.5's state layers, swapped states and speculation's rolled-back states.
@pytest.mark.fast_if(lambda name, mode, **_: name == "llama" or mode in ("swap, tiny pool", "ngram speculation"))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", slow_except(list(MODELS), fast=("llama", "qwen3_5")))
def test_every_mode_keeps_each_adapters_tokens(name, mode, built):
    model, _, batch, which, expected = built(name)
    settings = dict(MODES[mode])
    if "tiny pool" in mode:  # room for one request at max_model_len and a few blocks more: eight preempt each other
        settings["num_blocks"] = hybridkv.min_num_blocks(model, block_size=4, max_model_len=64) + 3
    llm = hybridkv.patch(model, enable_lora=True, max_loras=2, max_lora_rank=16, **settings)
    try:
        first = tokens(llm.generate(batch, GREEDY, lora_request=which, use_tqdm=False))
        again = llm.generate(batch, GREEDY, lora_request=which, use_tqdm=False)  # prefix hits where the pool kept them
        stats = llm.stats()
    finally:
        hybridkv.unpatch(model)
    assert first == expected and tokens(again) == expected, mode
    if "tiny pool" in mode:
        assert stats["num_preemptions"] > 0
    elif not MODELS_WITH_STATES.intersection([name]):  # every prompt of more than a block hits its adapter's blocks
        assert all(o.num_cached_tokens > 0 for o, p in zip(again, batch, strict=True) if len(p) > 16)


def test_prefix_cache_is_keyed_per_adapter(built):
    model, adapters, batch, _, _ = built("llama")
    prompt = batch[0] + batch[1]
    llm = hybridkv.patch(model, enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4)
    try:
        run = lambda adapter: llm.generate([prompt], GREEDY, lora_request=adapter, use_tqdm=False)[0]  # noqa: E731
        first = run(adapters[0])
        assert first.num_cached_tokens == 0
        same = run(adapters[0])
        other = run(adapters[1])
        base = run(None)
        base_again = run(None)
    finally:
        hybridkv.unpatch(model)
    assert same.num_cached_tokens == (len(prompt) - 1) // 4 * 4  # every full block before the last token
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0 and base_again.num_cached_tokens > 0
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids == peft_greedy(model, adapters[1], prompt, NEW)
    assert base.outputs[0].token_ids == peft_greedy(model, None, prompt, NEW)


def test_twelve_prompts_over_six_adapters_with_max_loras_2(tmp_path):
    model = MODELS["llama"]()
    adapters = make_adapters(model, tmp_path, 6)
    batch = prompts(12, seed=5)
    which = [adapters[i % 6] for i in range(12)]
    expected = [peft_greedy(model, a, p, NEW) for a, p in zip(which, batch, strict=True)]
    llm = hybridkv.patch(model, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3)
    seen = []
    original = llm.core.lora.slots_for

    def counting(refs):
        seen.append({ref.request.lora_name for ref in refs if ref is not None})
        return original(refs)

    llm.core.lora.slots_for = counting
    try:
        got = tokens(llm.generate(batch, GREEDY, lora_request=which, use_tqdm=False))
        stats = llm.core.lora.stats()
        pool = llm.core.coordinator.pool
        assert pool.num_free_blocks == pool.num_blocks - 1  # every block back
    finally:
        hybridkv.unpatch(model)
    assert got == expected
    assert max(len(names) for names in seen) == 2  # never more than max_loras in a step
    assert stats["loads"] >= 6 and len(stats["cached"]) <= 3


@pytest.mark.parametrize("name", slow_except(list(MODELS), fast=("gemma3",)))
def test_n_samples_and_beam_search_with_mixed_adapters(name, built):
    """Seeded samples (n=2) and beams under mixed adapters equal those of each request run alone."""
    model, _, batch, which, _ = built(name)
    sampled = hybridkv.SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=NEW, ignore_eos=True)
    beams = hybridkv.BeamSearchParams(beam_width=2, max_tokens=4)
    llm = hybridkv.patch(model, enable_lora=True, max_loras=3, max_lora_rank=16)
    try:
        mixed = [
            [c.token_ids for c in o.outputs] for o in llm.generate(batch, sampled, lora_request=which, use_tqdm=False)
        ]
        alone = [
            [c.token_ids for c in llm.generate([p], sampled, lora_request=a, use_tqdm=False)[0].outputs]
            for p, a in zip(batch, which, strict=True)
        ]
        as_dicts = [{"prompt_token_ids": p} for p in batch[:4]]
        mixed_beams = llm.beam_search(as_dicts, beams, lora_request=which[:4])
        alone_beams = [llm.beam_search([d], beams, lora_request=a)[0] for d, a in zip(as_dicts, which[:4], strict=True)]
    finally:
        hybridkv.unpatch(model)
    assert mixed == alone
    assert [[s.tokens for s in o.sequences] for o in mixed_beams] == [
        [s.tokens for s in o.sequences] for o in alone_beams
    ]
    assert len({tuple(o.sequences[0].tokens) for o in mixed_beams}) == 4


@pytest.mark.parametrize(
    "kernels", [pytest.param(False, id="torch"), pytest.param(True, marks=pytest.mark.slow, id="kernels")]
)
def test_embeddings_and_output_layer_as_targets(tmp_path, kernels):
    """Adapters on the input embeddings (Gemma 3's are scaled: PEFT scales the delta too) and the output layer; with the
    Triton kernels forced, the embeddings' mask is built for them and the output layer's rows go to the kernels."""
    for name, targets in (
        ("gemma3", ["embed_tokens", "q_proj", "down_proj"]),
        ("llama", ["embed_tokens", "lm_head", "v_proj"]),
    ):
        model = MODELS[name]()
        model.config.tie_word_embeddings = False
        adapters = make_adapters(model, tmp_path / name, 2, targets)
        batch = prompts(4, seed=3)
        which = [adapters[0], None, adapters[1], adapters[0]]
        expected = [peft_greedy(model, a, p, NEW) for a, p in zip(which, batch, strict=True)]
        settings = dict(enable_lora=True, max_loras=2, max_lora_rank=16)
        try:
            llm = patch_on_kernels(model, **settings) if kernels else hybridkv.patch(model, **settings)
            got = tokens(llm.generate(batch, GREEDY, lora_request=which, use_tqdm=False))
        finally:
            if hybridkv.is_patched(model):
                hybridkv.unpatch(model)
            model.to("cpu")
        assert got == expected, name


def test_async_engine_and_the_adapter_calls(built):
    from hybridkv.async_engine import AsyncLLMEngine

    model, adapters, batch, which, expected = built("llama")
    llm = hybridkv.patch(model, enable_lora=True, max_loras=3, max_lora_rank=16)
    try:
        assert llm.add_lora(adapters[0]) and llm.list_loras() == {1}
        engine = AsyncLLMEngine(llm)
        try:
            handles = [engine.submit(p, GREEDY, lora_request=a) for p, a in zip(batch, which, strict=True)]
            outputs = [handle.result(timeout=120) for handle in handles]
        finally:
            engine.shutdown()
        assert tokens(outputs) == expected
        assert llm.list_loras() == {1, 2, 3}
        assert llm.remove_lora(2) and not llm.remove_lora(2) and llm.list_loras() == {1, 3}
        # vLLM's own class, by its fields, works too.
        from hybridkv.lora.request import LoRARequest

        again = llm.generate(
            [batch[2]], GREEDY, lora_request=LoRARequest("a1", 2, adapters[1].lora_path), use_tqdm=False
        )
        assert tokens(again) == [expected[2]]
    finally:
        hybridkv.unpatch(model)


def test_bad_requests_are_clear_errors_and_the_engine_keeps_serving(tmp_path, built):
    model, adapters, batch, which, expected = built("llama")
    big = make_adapters(model, tmp_path / "big", 1, ranks=[32])[0]
    dora = make_adapters(model, tmp_path / "dora", 1, ["q_proj"], use_dora=True)[0]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((tmp_path / "big" / "a0" / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    save_file({"base_model.model.model.layers.0.mlp.w9.lora_A.weight": torch.zeros(4, 8),
               "base_model.model.model.layers.0.mlp.w9.lora_B.weight": torch.zeros(8, 4)},
              str(other / "adapter_model.safetensors"))  # fmt: skip

    plain = hybridkv.patch(model)
    try:
        with pytest.raises(ValueError, match="enable_lora=True"):
            plain.generate(batch[:1], GREEDY, lora_request=adapters[0], use_tqdm=False)
    finally:
        hybridkv.unpatch(model)
    llm = hybridkv.patch(model, enable_lora=True, max_loras=2, max_lora_rank=16)
    try:
        cases = [
            (big, "rank 32 .* above max_lora_rank=16; patch with max_lora_rank=32"),
            (dora, "DoRA"),
            (hybridkv.LoRARequest("gone", 9, str(tmp_path / "nowhere")), "is not a folder"),
            (hybridkv.LoRARequest("broken", 10, str(broken)), "cannot be read as JSON"),
            (hybridkv.LoRARequest("other", 11, str(other)), "model.layers.0.mlp.w9.* another base model"),
        ]
        for adapter, message in cases:
            with pytest.raises(ValueError, match=message):
                llm.generate(batch[:1], GREEDY, lora_request=adapter, use_tqdm=False)
            with pytest.raises(ValueError, match=message):
                llm.add_request("bad", batch[0], GREEDY, lora_request=adapter)
        with pytest.raises(ValueError, match="lora_requests"):
            llm.generate(batch[:2], GREEDY, lora_request=which[:3], use_tqdm=False)
        with pytest.raises(ValueError, match="lora_int_id"):
            hybridkv.LoRARequest("zero", 0, "x")
        # Nothing was queued or held; the engine serves on.
        assert not llm.has_unfinished_requests()
        assert tokens(llm.generate(batch, GREEDY, lora_request=which, use_tqdm=False)) == expected
    finally:
        hybridkv.unpatch(model)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        hybridkv.patch(model, enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(TypeError, match="max_lora_rank"):
        hybridkv.patch(model, enable_lora=True, max_lora_rank=8.0)


def test_latent_up_projection_adapters_expand_each_sequence_with_its_own_adapter(tmp_path):
    """An adapter on a latent attention layer's up-projection (kv_b_proj, applied inside attention to each sequence's
    context, not to the step's rows): mixed with others and the model alone, prefills and decodes, PEFT's tokens."""
    model = MODELS["minicpm3"]()
    adapters = make_adapters(model, tmp_path, 2, ["kv_b_proj", "q_b_proj"])
    batch = prompts(6, seed=4)
    which = [adapters[0], None, adapters[1], adapters[0], adapters[1], None]
    expected = [peft_greedy(model, a, p, NEW) for a, p in zip(which, batch, strict=True)]
    llm = hybridkv.patch(model, enable_lora=True, max_loras=2, max_lora_rank=16, max_num_batched_tokens=32)
    try:
        assert tokens(llm.generate(batch, GREEDY, lora_request=which, use_tqdm=False)) == expected
    finally:
        hybridkv.unpatch(model)


def test_an_adapter_on_a_layer_the_forward_bypasses_is_refused_not_ignored(tmp_path):
    """A layer whose weight a fused kernel reads (here: an MLP that calls F.linear on down_proj's weight) never runs
    its hook: the adapter's first step fails with the layer named, and the adapter is refused from then on."""
    model = MODELS["llama"]()
    adapter = make_adapters(model, tmp_path, 1, ["down_proj", "q_proj"])[0]
    mlp = model.model.layers[0].mlp

    def fused(x):
        hidden = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        return torch.nn.functional.linear(hidden, mlp.down_proj.weight)

    mlp.forward = fused
    llm = hybridkv.patch(model, enable_lora=True, max_lora_rank=16)
    try:
        (failed,) = llm.generate(prompts(1), GREEDY, lora_request=adapter, use_tqdm=False)
        assert "model.layers.0.mlp.down_proj" in failed.error and "does not call" in failed.error
        with pytest.raises(ValueError, match="does not call"):
            llm.generate(prompts(1), GREEDY, lora_request=adapter, use_tqdm=False)
        assert tokens(llm.generate(prompts(2), GREEDY, use_tqdm=False))  # the model alone runs on
        pool = llm.core.coordinator.pool
        assert pool.num_free_blocks == pool.num_blocks - 1
    finally:
        hybridkv.unpatch(model)
        del mlp.forward


@pytest.mark.parametrize(
    "way",
    [
        pytest.param(dict(_MASKED_ROWS=10**6, _MASKED_WIDTH=10**6), id="masked"),
        pytest.param(dict(_MASKED_ROWS=0, _GROUPED_SLOTS=10**6), id="slot by slot"),
        pytest.param(dict(_MASKED_ROWS=0, _MASKED_WIDTH=0, _GROUPED_SLOTS=0), id="padded"),
        pytest.param({}, id="as chosen"),
    ],
)
def test_each_way_to_add_mixed_deltas_equals_peft(way, tmp_path, monkeypatch):
    """Twelve prompts over six adapters of ranks 4, 8 and 16 in one batch (max_loras=6), the CPU's three ways forced in
    turn (hybridkv/execution/lora.py: a mask over the slots' columns, slot by slot, rows padded per slot into batched
    matmuls), and as the step sizes choose them."""
    from hybridkv.execution import lora

    for name, value in way.items():
        monkeypatch.setattr(lora, name, value)
    model = MODELS["llama"]()
    adapters = make_adapters(model, tmp_path, 6)
    batch = prompts(12, seed=9)
    which = [None if i % 7 == 3 else adapters[i % 6] for i in range(12)]
    expected = [peft_greedy(model, a, p, NEW) for a, p in zip(which, batch, strict=True)]
    llm = hybridkv.patch(model, enable_lora=True, max_loras=6, max_lora_rank=16)
    try:
        assert tokens(llm.generate(batch, GREEDY, lora_request=which, use_tqdm=False)) == expected
    finally:
        hybridkv.unpatch(model)


def test_one_name_from_two_folders_is_two_adapters(tmp_path):
    """vLLM keys adapters by name; a name given again with another folder (new weights) is another adapter here: each
    request runs the weights it was added with, in the same batch, and their blocks are apart."""
    model = MODELS["llama"]()
    first, second = make_adapters(model, tmp_path, 2)
    renamed = hybridkv.LoRARequest(first.lora_name, first.lora_int_id, second.lora_path)
    batch = prompts(4, seed=11)
    which = [first, renamed, first, renamed]
    expected = [peft_greedy(model, a, p, NEW) for a, p in zip([first, second, first, second], batch, strict=True)]
    llm = hybridkv.patch(model, enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4)
    try:
        assert tokens(llm.generate(batch, GREEDY, lora_request=which, use_tqdm=False)) == expected
        # The first prompt ran with the first folder's weights only: under the new ones, nothing of it is hit.
        (again,) = llm.generate(batch[:1], GREEDY, lora_request=renamed, use_tqdm=False)
        assert again.num_cached_tokens == 0 and tokens([again]) == [peft_greedy(model, second, batch[0], NEW)]
        (same,) = llm.generate(batch[:1], GREEDY, lora_request=first, use_tqdm=False)
        assert same.num_cached_tokens > 0 and tokens([same]) == expected[:1]
    finally:
        hybridkv.unpatch(model)
