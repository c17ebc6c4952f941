"""The zoo itself: every tiny model makes a meaningful test, every refused family gets its clear error,
and the README's tables list exactly what the code serves and refuses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

import hybridkv
from hybridkv.patches.inspection import inspect_model

from greedy_reference import cached_hf_greedy
from model_zoo import LAYER_KINDS, REFUSED, ZOO, slow_except
from tiny_models import prompts

README = Path(__file__).resolve().parent.parent / "README.md"

REFUSAL_REASONS = {
    "mamba2": r"has only state layers .*does not serve a model without attention layers yet",
    "deepseek_v32": r"'indexed_attention' layers use sparse or compressed attention",
    "deepseek_v4": r"'heavily_compressed_attention' layers use sparse or compressed attention",
    **dict.fromkeys(
        ("bart", "mbart", "marian", "pegasus", "plbart", "blenderbot", "blenderbot-small", "bigbird_pegasus"),
        r"(?s)give other logits than the model's own forward.*reads positions from its own cache",
    ),
    "paligemma": r"(?s)give other logits than the model's own forward.*is_causal=False: a prompt token attends",
}


def readme_table(heading: str) -> dict[str, str]:
    """The rows of the README table under `heading`: model type (first backticked name) -> second column."""
    section = README.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[0]) if line.startswith("|") else []
        if names and names[0] != "model_type":  # not the header
            rows[names[0]] = cells[1]
    return rows


def test_the_readme_lists_exactly_the_served_families_with_the_layouts_tested():
    assert readme_table("Supported models") == {name: LAYER_KINDS[name] for name in ZOO}


def test_the_readme_lists_exactly_the_refused_families():
    assert set(readme_table("Refused on purpose")) == set(REFUSED)
    assert set(REFUSAL_REASONS) == set(REFUSED)


def test_at_least_thirty_model_types_are_served():
    assert len(ZOO) >= 30
    assert all(ZOO[name]().config.model_type == name for name in ("gemma3", "gemma3n_text", "olmo3", "cohere2_moe"))


@pytest.mark.parametrize("name", slow_except(sorted(ZOO)))
def test_greedy_output_depends_on_the_first_prompt_token(name):
    """A tiny model whose output ignores early tokens would make every equivalence test blind. For hybrid
    layouts the first token of a 150-token prompt is out of every window: only full layers carry it."""
    model = ZOO[name]()
    windows = {spec.sliding_window for spec in inspect_model(model, torch.float32).specs}
    lengths = (40, 150) if None in windows and len(windows) > 1 else (40,)
    for prompt in prompts(lengths):
        changed = [(prompt[0] + 1) % model.config.get_text_config().vocab_size, *prompt[1:]]
        output = cached_hf_greedy(model, prompt, 16)[0]
        assert len(set(output)) > 1, f"{name}: greedy output is one repeated token"
        assert cached_hf_greedy(model, changed, 16)[0] != output, (
            f"{name}: the first of {len(prompt)} tokens changes nothing"
        )


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_families_hybridkv_cannot_serve_exactly_are_refused_with_the_reason(name):
    model = REFUSED[name]()
    with pytest.raises(ValueError, match=REFUSAL_REASONS[name]):
        hybridkv.patch(model, max_model_len=256)
    assert not hybridkv.is_patched(model)
    assert model.config._attn_implementation != "hybridkv"


@pytest.mark.parametrize("name", slow_except(sorted(ZOO)))
def test_kv_bytes_per_token_equal_what_the_models_own_cache_stores(name, patched):
    """stats()' bytes per token against transformers' DynamicCache after a prompt shorter than every
    window: each layer that stores K/V counts once, KV-sharing layers (which store nothing) not at all."""
    model = ZOO[name]()
    prompt = torch.tensor([prompts((12,))[0]])
    with torch.inference_mode():
        cache = getattr(model(input_ids=prompt, use_cache=True), "past_key_values", None)
        if cache is None:  # RecurrentGemma returns none: it fills the cache it is given
            cache = DynamicCache(config=model.config)
            model(input_ids=prompt, use_cache=True, past_key_values=cache)
    stored = 0
    for layer in getattr(cache, "layers", ()):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            stored += keys.numel() * keys.element_size() + values.numel() * values.element_size()
    assert stored > 0, f"{name}: no K/V in the model's own cache"
    llm = patched(model, max_model_len=64, block_size=8)
    stats = llm.stats()
    assert stats["kv_bytes_per_token"] * prompt.shape[1] == stored
    assert stats["blocks_in_use"] == 0
