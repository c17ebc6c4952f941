"""The zoo's standard greedy runs: each family's model, prompts and transformers' own greedy tokens (built
once per test session), and the token-for-token comparison every equivalence test uses."""

from __future__ import annotations

from model_zoo import ZOO
from tiny_models import DEVICE, hf_greedy, prompts

MAX_NEW = 16
LENGTHS = (7, 33, 70, 150)
TIE = 1e-5

_cache: dict[str, tuple] = {}


def family(name):
    """The model and HF's reference for the standard prompts, built once per family."""
    if name not in _cache:
        model = ZOO[name]().to(DEVICE)
        batch = prompts(LENGTHS)
        _cache[name] = (model, batch, [hf_greedy(model, p, MAX_NEW) for p in batch])
    return _cache[name]


def assert_same_greedy(outputs, references):
    """Token-for-token equality; a difference is accepted only where HF's top-2 logits tie."""
    for output, (expected, logits) in zip(outputs, references, strict=True):
        got = output.outputs[0].token_ids
        for i, token in enumerate(expected):
            if got[i] != token:
                top2 = logits[i].topk(2).values
                assert (top2[0] - top2[1]).abs().item() < TIE, (
                    f"token {i} differs ({got[i]} vs HF {token}) without a tie: got {got}, HF {expected}"
                )
                break
        else:
            assert got == expected
