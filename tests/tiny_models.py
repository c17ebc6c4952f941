"""The ten families the other tests use, as tiny random models from `hybridkv.tiny` (no downloads);
tests/model_zoo.py extends them to every family the README lists.

`hybridkv.tiny`'s windows are smaller than the test prompts, so windows really slide, and its initializer
ranges make greedy output depend on early prompt tokens (tests/test_model_zoo.py checks it). Gemma 3 is
the exception: at its 0.03 a 150-token prompt's first token has no effect, so its tests use 0.2.
"""

from __future__ import annotations

import itertools
import os
from functools import partial

import torch

from hybridkv.tiny import COMMON, VOCAB, WINDOW, tiny_model

__all__ = [
    "COMMON",
    "DEVICE",
    "FAMILIES",
    "VOCAB",
    "WINDOW",
    "hf_greedy",
    "hf_greedy_min_new_tokens",
    "new_request_id",
    "prompts",
    "with_early_eos",
]

# benchmarks/gpu_check.sh sets HYBRIDKV_TEST_ON_GPU=1: the kernel tests' batches and the zoo's models are
# then on the GPU (conftest.py leaves Triton compiled there rather than interpreted).
DEVICE = torch.device("cuda" if os.environ.get("HYBRIDKV_TEST_ON_GPU") == "1" else "cpu")

FAMILIES = {
    "llama": partial(tiny_model, "llama"),
    "mistral": partial(tiny_model, "mistral"),
    "ministral": partial(tiny_model, "ministral"),
    "qwen2": partial(tiny_model, "qwen2"),
    "qwen3": partial(tiny_model, "qwen3"),
    "gemma2": partial(tiny_model, "gemma2"),
    "gemma3_text": partial(tiny_model, "gemma3", initializer_range=0.2),
    "gpt_oss": partial(tiny_model, "gpt_oss"),
    "cohere2": partial(tiny_model, "cohere2"),
    "phi3": partial(tiny_model, "phi3"),
}


_request_ids = itertools.count()


def new_request_id() -> str:
    """A request id no other request of the test session has (`add_request` takes vLLM's (request_id, prompt,
    params))."""
    return f"request-{next(_request_ids)}"


def prompts(lengths, seed=1, shared_prefix=0):
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, VOCAB, (shared_prefix,), generator=generator).tolist()
    return [prefix + torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, prompt, max_new_tokens):
    """transformers' own greedy generate for one prompt: tokens and per-step logits."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [logits[0].float() for logits in out.logits]


def with_early_eos(model, prompt, max_new_tokens=16):
    """Make the model's EOS (its config's and generation config's, which transformers and hybridkv read) the second
    token of its greedy continuation of `prompt`; that continuation, without an EOS."""
    continuation = hf_greedy(model, prompt, max_new_tokens)[0]
    model.generation_config.eos_token_id = model.config.eos_token_id = continuation[1]
    return continuation


def hf_greedy_min_new_tokens(model, prompt, max_new_tokens, min_new_tokens, eos_token_id=None):
    """transformers' greedy generate with `min_new_tokens` (its EOS, the generation config's unless `eos_token_id`
    names one, masked until then) for one prompt: the tokens."""
    eos_token_id = model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )
    return out[0, len(prompt) :].tolist()
