"""patch's end-to-end check (hybridkv/execution/step_check.py): a model whose paged steps compute something else than
its own forward is refused, whatever the reason, with the rows that differed."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hybridkv
import hybridkv.execution.step_check as step_check
from hybridkv.scheduling.sampling_params import SamplingParams

from model_zoo import REFUSED, ZOO
from tiny_models import COMMON, hf_greedy, prompts

WRONG_TOKEN_TYPES = (
    "bart",
    "mbart",
    "marian",
    "pegasus",
    "plbart",
    "blenderbot",
    "blenderbot-small",
    "bigbird_pegasus",
    "paligemma",
)


class CachePositionLlama(LlamaForCausalLM):
    """A Llama that numbers its tokens from its cache's length, ignoring position_ids (as BART-family
    decoders do): exact under `generate`, wrong in a step of several sequences."""

    def forward(self, input_ids=None, position_ids=None, past_key_values=None, **kwargs):
        start = past_key_values.get_seq_length() if past_key_values is not None else 0
        position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
        return super().forward(
            input_ids=input_ids, position_ids=position_ids, past_key_values=past_key_values, **kwargs
        )


def cache_position_llama():
    torch.manual_seed(0)
    return CachePositionLlama(LlamaConfig(**{**COMMON, "num_hidden_layers": 2, "initializer_range": 0.2})).eval()


def test_a_model_that_reads_positions_from_its_cache_is_refused_with_the_rows_that_differ():
    model = cache_position_llama()
    prompt = prompts((12,))[0]
    assert len(set(hf_greedy(model, prompt, 8)[0])) > 1  # generate itself is fine
    with pytest.raises(ValueError) as refused:
        hybridkv.patch(model)
    message = str(refused.value)
    # RoPE is relative: first chunks match wherever they sit; rows that read earlier keys from pages do not.
    assert "step 1" not in message
    assert "step 2, prompt A positions 16-39 (rows 0-23 of the step)" in message
    assert "step 3, prompt B position 12 (row 1 of the step)" in message
    assert "reads positions from its own cache" in message
    assert not hybridkv.is_patched(model) and model.config._attn_implementation != "hybridkv"


@pytest.mark.parametrize("name", WRONG_TOKEN_TYPES)
def test_the_refused_types_would_generate_other_tokens_without_the_check(name, monkeypatch):
    """The refusal is not spurious: with the check skipped, greedy tokens differ from generate's."""
    model = REFUSED[name]()
    batch = prompts((7, 40))
    references = [hf_greedy(model, p, 8)[0] for p in batch]
    monkeypatch.setattr(step_check, "_run_check", lambda model, layout: step_check.StepCheck((), True, "skipped"))
    llm = hybridkv.patch(model, max_model_len=256)
    try:
        outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=8))
    finally:
        hybridkv.unpatch(model)
    assert [o.outputs[0].token_ids for o in outputs] != references


def test_every_row_of_a_served_model_matches_its_forward_within_the_tolerance_by_far():
    model = ZOO["gemma3_text"]()
    llm = hybridkv.patch(model)
    try:
        check = llm.core.step_check
        assert check.mode == "fp32" and llm.stats()["step_check"] == "fp32"
        # Two first chunks, a later chunk, decode rows in a mixed step and in a decode-only step.
        assert [(s.step, s.sequence, s.first_position, s.num_rows) for s in check.segments] == [
            (1, "A", 0, 16),
            (1, "B", 0, 11),
            (2, "A", 16, 24),
            (2, "B", 11, 1),
            (3, "A", 40, 1),
            (3, "B", 12, 1),
        ]
        assert max(s.worst for s in check.segments) < step_check.TOLERANCE / 100
    finally:
        hybridkv.unpatch(model)


def test_a_16_bit_model_is_checked_on_an_fp32_copy():
    model = ZOO["llama"]().to(torch.bfloat16)
    weights = {name: p.data_ptr() for name, p in model.named_parameters()}
    llm = hybridkv.patch(model)
    assert llm.stats()["step_check"] == "fp32 copy"
    assert all(p.dtype == torch.bfloat16 and p.data_ptr() == weights[n] for n, p in model.named_parameters())
    hybridkv.unpatch(model)
    with pytest.raises(ValueError, match="reads positions from its own cache"):
        hybridkv.patch(REFUSED["bart"]().to(torch.bfloat16))


def test_a_16_bit_model_too_large_for_a_copy_is_checked_for_gross_errors_in_its_own_dtype(monkeypatch):
    monkeypatch.setattr(step_check, "_free_bytes", lambda device: 0)
    model = ZOO["mixtral"]().to(torch.bfloat16)  # MoE: bf16 rounding flips experts, the worst served case
    llm = hybridkv.patch(model)
    assert llm.stats()["step_check"] == "bfloat16, gross errors only"
    assert max(s.median for s in llm.core.step_check.segments) < step_check.GROSS
    hybridkv.unpatch(model)
    with pytest.raises(ValueError, match=r"\(checked in the model's own dtype: it is too large for an fp32 copy\)"):
        hybridkv.patch(REFUSED["bart"]().to(torch.bfloat16))


def test_the_verdict_is_kept_for_the_same_weights_and_taken_again_when_they_change(monkeypatch):
    runs = []
    run_check = step_check._run_check
    monkeypatch.setattr(step_check, "_run_check", lambda model, layout: runs.append(1) or run_check(model, layout))
    model = ZOO["llama"]()
    hybridkv.patch(model, block_size=8)
    hybridkv.patch(model, block_size=16)  # other settings: the engine is rebuilt, the check is not
    assert len(runs) == 1
    hybridkv.unpatch(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    hybridkv.patch(model)
    assert len(runs) == 2
    hybridkv.unpatch(model)
