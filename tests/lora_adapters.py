"""PEFT LoRA adapters for the tests and benchmarks: made on a tiny model with random A and B (PEFT's
`init_lora_weights=False`, so each adapter changes the tokens), saved as PEFT folders, and PEFT's own greedy generate
with one of them (the reference hybridkv's tokens must equal)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

import hybridkv

ALL_LINEAR = "all-linear"


def make_adapters(
    model: torch.nn.Module,
    folder: Path,
    count: int,
    target_modules: str | list[str] = ALL_LINEAR,
    ranks: list[int] | None = None,
    seed: int = 0,
    **config,
) -> list[hybridkv.LoRARequest]:
    """`count` adapters of `model` saved under `folder` (`a0`, `a1`, ...), each its LoRARequest (ids from 1). Ranks
    cycle through `ranks` (default 4, 8, 16); `config`: more LoraConfig settings."""
    from peft import LoraConfig, get_peft_model

    ranks = ranks or [4, 8, 16]
    requests = []
    for index in range(count):
        rank = ranks[index % len(ranks)]
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=target_modules, init_lora_weights=False, **config)
        torch.manual_seed(seed + 1000 * index)
        peft_model = get_peft_model(copy.deepcopy(model), lora)
        with torch.no_grad():  # random A and B of a size that changes tokens without drowning the model
            for name, parameter in peft_model.named_parameters():
                if "lora_" in name:
                    parameter.normal_(0, 0.5 / parameter.shape[-1] ** 0.5)
        path = folder / f"a{index}"
        peft_model.save_pretrained(str(path))
        requests.append(hybridkv.LoRARequest(f"a{index}", index + 1, str(path)))
    return requests


def peft_greedy(model: torch.nn.Module, adapter: hybridkv.LoRARequest | None, prompt: list[int], max_new_tokens: int):
    """PEFT's greedy generate of `prompt` with `adapter` loaded on `model` (None: the model alone); the model is as it
    was after."""
    from peft import PeftModel

    runner = model if adapter is None else PeftModel.from_pretrained(model, adapter.lora_path)
    try:
        with torch.inference_mode():
            out = runner.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    finally:
        if adapter is not None:
            runner.unload()
    return out[0, len(prompt) :].tolist()
