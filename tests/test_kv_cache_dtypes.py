"""KV pages of another dtype than the model: fp8 (per-layer scales), 16-bit pages for an fp32 model, and a
dtype per layer kind. Each is token-exact against transformers' own generate with K/V rounded the same
way (tests/kv_rounding.py); against plain fp32 generate, fp8 is not exact, and the zoo's agreement rate
is measured here (docs/design.md gives the figures).
"""

from __future__ import annotations

from functools import cache

import pytest
import torch

import hybridkv
from hybridkv import SamplingParams
from hybridkv.execution.config import EngineConfig
from hybridkv.tiny import tiny_model

from greedy_reference import MAX_NEW, assert_same_greedy, family
from kv_rounding import kv_rounded_like
from model_zoo import ZOO, slow_except
from tiny_models import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


@cache
def fp8_run(name: str) -> tuple[list[list[int]], list, list]:
    """hybridkv's greedy tokens over e4m3 pages, transformers' with K/V rounded as those pages hold them,
    and plain fp32 generate's, for the zoo's standard prompts."""
    model, batch, references = family(name)
    llm = hybridkv.patch(model, block_size=8, max_model_len=256, kv_cache_dtype=torch.float8_e4m3fn)
    try:
        outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    finally:
        hybridkv.unpatch(model)
    with kv_rounded_like(model, llm):
        rounded = [hf_greedy(model, prompt, MAX_NEW) for prompt in batch]
    return [o.outputs[0].token_ids for o in outputs], rounded, [tokens for tokens, _ in references], outputs


@pytest.mark.parametrize("name", slow_except(sorted(ZOO)))
def test_fp8_pages_give_generates_tokens_with_kv_rounded_to_fp8(name):
    _, rounded, _, outputs = fp8_run(name)
    assert_same_greedy(outputs, rounded)


def leading_agreement(tokens: list[int], reference: list[int]) -> int:
    agreed = 0
    while agreed < len(reference) and tokens[agreed] == reference[agreed]:
        agreed += 1
    return agreed


@pytest.mark.slow
def test_fp8_greedy_agreement_with_fp32_generate_on_the_zoo():
    """Tokens equal to fp32 generate's before the first difference, over the zoo (68 models x 4 prompts x 16
    tokens): 47% for e4m3 pages, the figure README.md and docs/design.md give. The zoo's tiny random models have
    small logit margins (median top-2 gap ~0.5), so a 3-4% attention error flips tokens that a trained model
    keeps."""
    agreed = total = 0
    for name in sorted(ZOO):
        tokens, _, references, _ = fp8_run(name)
        agreed += sum(leading_agreement(t, r) for t, r in zip(tokens, references, strict=True))
        total += sum(map(len, references))
    assert round(agreed / total, 2) == 0.47, agreed / total


def test_bf16_pages_for_an_fp32_model_give_generates_tokens_with_kv_rounded_to_bf16(patched):
    model, batch, _ = family("gemma3_text")
    llm = patched(model, block_size=8, max_model_len=256, kv_cache_dtype="bfloat16", max_num_batched_tokens=40)
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    hybridkv.unpatch(model)
    with kv_rounded_like(model, llm):
        assert_same_greedy(outputs, [hf_greedy(model, prompt, MAX_NEW) for prompt in batch])


def test_a_dtype_per_layer_kind_rounds_only_those_layers(patched):
    model, batch, _ = family("cohere2")
    llm = patched(model, block_size=8, max_model_len=256, kv_cache_dtype={"full": "fp8"})
    full = [g.group_id for g in llm.kv_config.groups if g.is_full_attention]
    # The full layers' K/V cost a quarter of the sliding layers' fp32 bytes: their blocks hold 4x the tokens.
    assert [g.block_size for g in llm.kv_config.groups] == [
        32 if g.group_id in full else 8 for g in llm.kv_config.groups
    ]
    assert llm.stats()["kv_cache_dtypes"] == {"float32": "0, 1, 2", "float8_e4m3fn": "3"}
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    hybridkv.unpatch(model)
    with kv_rounded_like(model, llm):
        assert_same_greedy(outputs, [hf_greedy(model, prompt, MAX_NEW) for prompt in batch])


def test_fp8_halves_the_kv_bytes_per_token_of_a_16_bit_model_and_doubles_the_blocks(patched):
    model = tiny_model("gemma3").to(torch.bfloat16)
    sixteen = patched(model, kv_cache_memory=1 << 20, max_model_len=256).stats()
    eight = patched(model, kv_cache_memory=1 << 20, max_model_len=256, kv_cache_dtype="fp8_e5m2").stats()
    assert eight["kv_bytes_per_token"] * 2 == sixteen["kv_bytes_per_token"]
    assert eight["kv_cache_dtypes"] == {"float8_e5m2": "0, 1, 2, 3, 4, 5"}
    assert eight["num_blocks"] == 2 * sixteen["num_blocks"]


def test_fp8_on_a_torch_without_float8_dtypes_names_the_upgrade(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype='fp8' needs torch.float8_e4m3fn, which torch .* upgrade torch"
    ):
        EngineConfig(kv_cache_dtype="fp8")


def test_vllm_names_and_auto_are_understood():
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == torch.float8_e4m3fn
    assert EngineConfig(kv_cache_dtype="fp8_e5m2").kv_cache_dtype == torch.float8_e5m2
    assert EngineConfig(kv_cache_dtype="auto").kv_cache_dtype is None
    assert EngineConfig(kv_cache_dtype={"sliding": "bfloat16", "full": None}).kv_cache_dtype == {
        "sliding": torch.bfloat16,
        "full": None,
    }
