"""Latent attention (MLA): found by what a layer does, paged as its latent and rotary key, attended expanded (prompt
chunks) or absorbed (decode rows), exact against transformers' generate. The zoo's LATENT families run every other
test file's matrix too (defaults, chunks, prefix hits, tiny pools, swap, forks, beam search, fp8 pages)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import hybridkv
from hybridkv import SamplingParams
from hybridkv.kernels import PagedAttentionMetadata
from hybridkv.kernels.latent_attention import latent_attention
from hybridkv.patches.attention import running_step, store_latent_op
from hybridkv.patches.inspection import inspect_model

from greedy_reference import MAX_NEW, assert_same_greedy, family
from kv_rounding import kv_rounded_like
from model_zoo import LATENT, MLA, slow_except
from tiny_models import DEVICE, hf_greedy, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


def test_a_latent_layer_is_paged_as_its_latent_and_rotary_key(patched):
    model, _, _ = family("deepseek_v3")
    layout = inspect_model(model, torch.float32)
    layers = model.config.num_hidden_layers
    assert sorted(layout.latent) == list(range(layers))
    for spec in layout.specs:
        latent = layout.latent[spec.layer_idx]
        assert (latent.latent_dim, latent.rope_dim, latent.nope_dim) == (16, 8, MLA["qk_nope_head_dim"])
        assert latent.up_proj == f"model.layers.{spec.layer_idx}.self_attn.kv_b_proj"
        assert (spec.num_kv_heads, spec.head_dim, spec.value_head_dim, spec.value_in_key) == (1, 24, 16, True)
    llm = patched(model, block_size=8, max_model_len=256)
    # (latent + rotary key) x layers x fp32: 1/4.25 of the expanded heads' (4 heads x (24 + 16)) K/V.
    assert llm.bytes_per_block == 8 * (16 + 8) * layers * 4


@pytest.mark.parametrize("name", slow_except(sorted(LATENT)))
@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "expanded"])
def test_decode_rows_absorbed_or_expanded_give_generates_tokens(name, absorb, patched):
    """Both forms of a decode row, with a prompt's chunks beside decode rows (chunked prefill) and prefix hits."""
    model, batch, references = family(name)
    llm = patched(model, block_size=8, max_model_len=256, max_num_batched_tokens=32)
    for layer_idx in llm.core.runner.latent_layers:
        llm.core.runner.layers[layer_idx].latent.absorb = absorb
    assert_same_greedy(llm.generate(batch, GREEDY, use_tqdm=False), references)
    assert_same_greedy(llm.generate(batch, GREEDY, use_tqdm=False), references)
    assert llm.stats()["prefix_cache_hits"] > 0


def test_the_absorbed_form_computes_what_the_expanded_form_computes():
    """Random pages, a step of decode rows beside a prompt's chunk: every row within fp32 rounding of the other form."""
    torch.manual_seed(0)
    heads, nope, rotary, value, latent, block_size = 4, 16, 8, 16, 12, 4
    up = torch.nn.Linear(latent, heads * (nope + value), bias=False).to(DEVICE)
    pages = torch.randn(20, block_size, 1, latent + rotary, device=DEVICE)  # K rows: the latent, the rotary key
    query_lens, seq_lens = [1, 5, 1, 1], [9, 13, 1, 30]
    tables = [[3, 4, 5], [6, 7, 8, 9], [10], [11, 12, 13, 14, 15, 16, 17, 18]]
    query = torch.randn(sum(query_lens), heads, nope + rotary, device=DEVICE)
    results = []
    for absorb in (True, False):
        metadata = PagedAttentionMetadata.build(query_lens, seq_lens, tables, block_size, DEVICE, backend="torch")
        with torch.no_grad():
            results.append(latent_attention(query, pages, pages[..., :latent], metadata, up, nope, 0.2, absorb=absorb))
    absorbed, expanded = results
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)
    assert not torch.equal(absorbed[1:6], torch.zeros_like(absorbed[1:6]))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_the_triton_decode_kernel_computes_what_the_torch_path_computes(cache_dtype):
    """hybridkv/kernels/triton_latent.py (run by the Triton interpreter here; compiled for sm_80 and sm_90 by
    tests/test_kernels_triton_compile.py) against the torch path's absorbed form, on decode rows of several lengths
    (tiles cut mid-block, a one-token sequence) beside a prompt's chunk."""
    torch.manual_seed(0)
    heads, nope, rotary, value, latent, block_size = 4, 16, 8, 16, 24, 4
    up = torch.nn.Linear(latent, heads * (nope + value), bias=False).to(DEVICE)
    pages = torch.randn(20, block_size, 1, latent + rotary, device=DEVICE).to(cache_dtype)
    query_lens, seq_lens = [1, 5, 1, 1], [9, 13, 1, 30]
    tables = [[3, 4, 5], [6, 7, 8, 9], [10], [11, 12, 13, 14, 15, 16, 17, 18]]
    query = torch.randn(sum(query_lens), heads, nope + rotary, device=DEVICE)
    results = []
    for backend in ("torch", "triton"):
        metadata = PagedAttentionMetadata.build(query_lens, seq_lens, tables, block_size, DEVICE, backend=backend)
        with torch.no_grad():
            results.append(latent_attention(query, pages, pages[..., :latent], metadata, up, nope, 0.2))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the fast tier runs the Triton backend over fp8 pages (the test below)
def test_the_triton_backend_gives_generates_tokens(patched):
    model, batch, references = family("deepseek_v2")
    llm = patched(model, block_size=8, max_model_len=256, attention_backend="triton")
    assert_same_greedy(llm.generate(batch[:2], GREEDY, use_tqdm=False), references[:2])


def test_fp8_pages_on_the_triton_backend_give_generates_tokens_with_the_latent_rounded(patched):
    """fp8 pages written by the Triton cache write and read back by the decode rows' torch path (the Triton latent
    kernel takes 16/32-bit pages), against generate with what the layers hand their cache rounded as the pages hold
    it (tests/kv_rounding.py)."""
    model, batch, _ = family("deepseek_v2")
    fp8 = dict(kv_cache_dtype=torch.float8_e4m3fn, attention_backend="triton")
    llm = patched(model, block_size=8, max_model_len=256, **fp8)
    outputs = llm.generate(batch[:2], GREEDY, use_tqdm=False)
    hybridkv.unpatch(model)
    with kv_rounded_like(model, llm):
        rounded = [hf_greedy(model, prompt, MAX_NEW) for prompt in batch[:2]]
    assert_same_greedy(outputs, rounded)


def test_a_lora_adapter_on_the_up_projection_is_attended_through(patched):
    """PEFT wraps the up-projection in a LoRA layer: decode rows then expand through the wrapper (its adapter
    included) rather than fold the base weight into the query, and the tokens are the adapted model's."""
    model = LATENT["deepseek_v3"]().to(DEVICE)
    torch.manual_seed(3)
    config = LoraConfig(r=4, target_modules=["kv_b_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config).eval()
    batch = prompts((7, 40))
    references = [hf_greedy(peft_model, prompt, 8) for prompt in batch]
    base = [hf_greedy(model, prompt, 8)[0] for prompt in batch]  # PEFT's layers are on: the adapted model's
    llm = patched(peft_model, block_size=8, max_model_len=256)
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert_same_greedy(outputs, references)
    with peft_model.disable_adapter():
        base = [hf_greedy(peft_model, prompt, 8) for prompt in batch]
        outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert_same_greedy(outputs, base)
    assert [t for t, _ in base] != [t for t, _ in references]  # the adapter changes the tokens


def test_the_store_op_passes_torch_librarys_opcheck(patched):
    """`store_latent` (hybridkv/patches/attention.py), the cache update compiled code keeps: its fake and real
    outputs agree,
    and its outputs alias none of its inputs."""
    model = LATENT["deepseek_v3"]().to(DEVICE)
    llm = patched(model, block_size=8, max_model_len=128)
    request_id = llm.add_request("r", prompts((20,))[0], SamplingParams(temperature=0, max_tokens=2))
    llm.step()
    plan = llm.core.scheduler.schedule()
    llm.core.runner.context.metadata = llm.core.runner.prepare(
        llm.core.runner.step_inputs(plan)
    ).metadata  # one decode row
    latent = torch.randn(1, 1, 1, 16, device=DEVICE)
    rotary = torch.randn(1, 1, 1, 8, device=DEVICE)
    with running_step(llm.core.runner.context):
        torch.library.opcheck(store_latent_op, (latent, rotary, 0))
    llm.abort(request_id)


def test_a_change_to_the_weights_is_followed(patched):
    """The up-projection is read at every step and the pages hold the latents the weights computed: after an edit of
    both (in place, as an optimizer step does), tokens are the changed model's, and no page computed before is hit."""
    model = LATENT["deepseek_v3"]().to(DEVICE)
    batch = prompts((33, 40))
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = patched(model, block_size=8, max_model_len=256)
    before = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        attention.kv_b_proj.weight.mul_(1.5)
        attention.kv_a_proj_with_mqa.weight.mul_(0.7)
    references = [hf_greedy(model, prompt, 8) for prompt in batch]
    hits = llm.stats()["prefix_cache_hits"]
    assert_same_greedy(llm.generate(batch, params, use_tqdm=False), references)
    assert llm.stats()["prefix_cache_hits"] == hits
    assert [t for t, _ in references] != before  # the edit changes the tokens


def test_a_declared_latent_layer_whose_keys_are_not_its_up_projection_is_refused():
    """The config says latent attention (kv_lora_rank), but the keys the attention function receives are not the
    up-projection's output (here: nudged after it): refused rather than paged as something else."""
    model = LATENT["deepseek_v3"]().to(DEVICE)
    attention = model.model.layers[1].self_attn
    expand = attention.expand_kv

    def nudged(kv_nope, k_rot):
        key, value = expand(kv_nope, k_rot)
        return key + 1e-3, value

    attention.expand_kv = nudged
    with pytest.raises(ValueError, match=r"layer 1: its config declares multi-head latent attention.*not one linear"):
        hybridkv.patch(model, max_model_len=256)
    assert not hybridkv.is_patched(model)
