"""The zoo's standard greedy runs: each family's model, prompts and transformers' own greedy tokens (built
once per test process), and the token-for-token comparison every equivalence test uses.

transformers' greedy tokens and logits are kept on disk for every test process and later runs
(`cached_hf_greedy`): pytest-xdist's workers are separate processes, and each would compute them again. A file
is keyed by everything `hf_greedy`'s result depends on: the torch and transformers versions (the directory), the
model's class, module tree, config, generation config, attention implementations, train/eval modes and every
parameter and buffer byte, the prompt, the number of new tokens, the device and torch's thread count and default
dtype. A model that hybridkv has patched, or that carries hooks or a forward set on one of its modules, is not
cached: what it runs is not transformers' code alone. Files are written under a temporary name and renamed, so a
reader sees a whole file or none. Delete the directory (or point HYBRIDKV_TEST_REFERENCES elsewhere) to start
afresh.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch
import transformers

import hybridkv

from model_zoo import ZOO
from tiny_models import DEVICE, hf_greedy, prompts

MAX_NEW = 16
LENGTHS = (7, 33, 70, 150)
TIE = 1e-5

_cache: dict[str, tuple] = {}

REFERENCE_DIR = (
    Path(os.environ.get("HYBRIDKV_TEST_REFERENCES") or Path(tempfile.gettempdir()) / "hybridkv-test-references")
    / f"torch-{torch.__version__}-transformers-{transformers.__version__}"
)


def _plain_transformers(model: torch.nn.Module) -> bool:
    global_hooks = (torch.nn.modules.module._global_forward_hooks, torch.nn.modules.module._global_forward_pre_hooks)
    if hybridkv.is_patched(model) or any(global_hooks):
        return False
    for module in model.modules():
        hooks = (module._forward_hooks, module._forward_pre_hooks)
        if any(hooks) or "forward" in vars(module):
            return False
    return True


def reference_key(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> str:
    """A digest of everything `hf_greedy(model, prompt, max_new_tokens)` depends on, beyond the library versions."""
    digest = hashlib.sha256()

    def add(text: str) -> None:
        digest.update(text.encode())
        digest.update(b"\0")

    add(f"{type(model).__module__}.{type(model).__qualname__}")
    add(repr(model))
    add(f"training={sorted({module.training for module in model.modules()})} {torch.get_default_dtype()}")
    add(model.config.to_json_string(use_diff=False))
    add(model.generation_config.to_json_string(use_diff=False))
    for config in (model.config, *(getattr(model.config, key) for key in model.config.sub_configs)):
        add(repr(getattr(config, "_attn_implementation", None)))
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        add(f"{name} {tensor.dtype} {tuple(tensor.shape)} {tensor.device.type}")
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    add(f"{prompt} {max_new_tokens} {torch.get_num_threads()}")
    return digest.hexdigest()


def cached_hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int):
    """`hf_greedy(model, prompt, max_new_tokens)`, read from the disk cache when an equal run was made before."""
    if not _plain_transformers(model):
        return hf_greedy(model, prompt, max_new_tokens)
    path = REFERENCE_DIR / f"{reference_key(model, prompt, max_new_tokens)}.pt"
    if path.exists():
        tokens, logits = torch.load(path, weights_only=True)
        return tokens, [row.to(model.device) for row in logits]
    tokens, logits = hf_greedy(model, prompt, max_new_tokens)
    REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=REFERENCE_DIR, suffix=".tmp", delete=False) as file:
        torch.save((tokens, [row.cpu() for row in logits]), file)
    os.replace(file.name, path)
    return tokens, logits


def family(name):
    """The model and HF's reference for the standard prompts, built once per family."""
    if name not in _cache:
        model = ZOO[name]().to(DEVICE)
        batch = prompts(LENGTHS)
        _cache[name] = (model, batch, [cached_hf_greedy(model, p, MAX_NEW) for p in batch])
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
