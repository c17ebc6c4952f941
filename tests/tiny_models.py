"""Tiny random models of the ten families the other tests use, built from configs (no downloads);
tests/model_zoo.py extends them to every family the README lists.

Windows are smaller than the test prompts so that windows really slide. Initializer ranges are chosen
so that greedy output depends on early prompt tokens (tests/test_model_zoo.py checks it): 0.2-0.3 for
most families; 0.03 for Gemma 2, which scales embeddings by sqrt(hidden), with untied embeddings.
"""

from __future__ import annotations

import torch
from transformers import (
    Cohere2Config,
    Cohere2ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MinistralConfig,
    MinistralForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 256
WINDOW = 16
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def _build(model_cls, config_cls, **kwargs):
    config = config_cls(**{**COMMON, **kwargs})
    torch.manual_seed(0)
    return model_cls(config).eval()


FAMILIES = {
    "llama": lambda: _build(LlamaForCausalLM, LlamaConfig, num_hidden_layers=2, initializer_range=0.3),
    # All-sliding families need 3 layers for a 40-token prompt's first token to reach the output.
    "mistral": lambda: _build(
        MistralForCausalLM, MistralConfig, num_hidden_layers=3, sliding_window=WINDOW, initializer_range=0.2
    ),
    "ministral": lambda: _build(
        MinistralForCausalLM,
        MinistralConfig,
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        initializer_range=0.3,
    ),
    "qwen2": lambda: _build(
        Qwen2ForCausalLM,
        Qwen2Config,
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
        initializer_range=0.2,
    ),
    "qwen3": lambda: _build(
        Qwen3ForCausalLM,
        Qwen3Config,
        num_hidden_layers=3,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
        initializer_range=0.3,
    ),
    "gemma2": lambda: _build(
        Gemma2ForCausalLM,
        Gemma2Config,
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=WINDOW,
        attn_logit_softcapping=5.0,
        initializer_range=0.03,
        tie_word_embeddings=False,
    ),
    "gemma3_text": lambda: _build(
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        num_hidden_layers=6,
        head_dim=16,
        sliding_window=WINDOW,
        initializer_range=0.2,  # 0.03 left a 150-token prompt's first token without effect
        tie_word_embeddings=False,
    ),
    "gpt_oss": lambda: _build(
        GptOssForCausalLM,
        GptOssConfig,
        num_hidden_layers=2,
        head_dim=16,
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        initializer_range=0.3,
        max_position_embeddings=131072,  # its yarn rope scaling expects 32 x 4,096
    ),
    "cohere2": lambda: _build(
        Cohere2ForCausalLM, Cohere2Config, num_hidden_layers=4, sliding_window=WINDOW, initializer_range=0.3
    ),
    "phi3": lambda: _build(
        Phi3ForCausalLM, Phi3Config, num_hidden_layers=3, sliding_window=WINDOW, initializer_range=0.2
    ),
}


def prompts(lengths, seed=1, shared_prefix=0):
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, VOCAB, (shared_prefix,), generator=generator).tolist()
    return [prefix + torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, prompt, max_new_tokens):
    """transformers' own greedy generate for one prompt: tokens and per-step logits."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [logits[0].float() for logits in out.logits]


def text_llama(vocab_size: int):
    """A tiny Llama whose vocabulary matches a tokenizer's, for tests that go through text."""
    config = LlamaConfig(**{**COMMON, "vocab_size": vocab_size, "num_hidden_layers": 2, "initializer_range": 0.3})
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()
