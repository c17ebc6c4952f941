"""Model families hybridkv supports, and the checks that a model is one of them.

Adding a family: read its modeling file in transformers for what reaches the attention function
(`sliding_window`, `softcap`, `s_aux`, ...) and how its config describes layer kinds, add a `Family`
below, and add it to the equivalence tests (tests/test_patch_equivalence.py). docs/adding_a_model.md
walks through an example.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.kv_spec import LayerSpec
from hybridkv.patches.layer_kinds import layer_specs_from_config


@dataclass(frozen=True)
class Family:
    """One supported family: its transformers `model_type`, and what its layers use."""

    model_type: str
    name: str
    layer_kinds: str
    features: str = ""


FAMILIES = {
    f.model_type: f
    for f in (
        Family("llama", "Llama", "full"),
        Family("mistral", "Mistral", "sliding window on every layer"),
        Family("ministral", "Ministral", "layer_types: full + sliding"),
        Family("qwen2", "Qwen2", "full, or sliding from max_window_layers on"),
        Family("qwen3", "Qwen3", "full, or sliding from max_window_layers on"),
        Family("gemma2", "Gemma 2", "alternating sliding / full", "logit softcapping"),
        Family("gemma3_text", "Gemma 3 (text)", "5 sliding : 1 full", "separate local rope base"),
        Family("gpt_oss", "GPT-OSS", "alternating sliding (128) / full", "attention sinks"),
        Family("cohere2", "Cohere2", "3 sliding : 1 full"),
        Family("phi3", "Phi-3", "full, or sliding window on every layer"),
    )
}


def check_supported(model: torch.nn.Module) -> Family:
    """The model's family, or a ValueError that lists the supported ones and how to add one."""
    model_type = getattr(model.config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        names = ", ".join(f"{f.name} ({f.model_type})" for f in FAMILIES.values())
        raise ValueError(
            f"hybridkv does not support model_type {model_type!r} yet. Supported: {names}. "
            "To add a family, see patches/families.py and docs/adding_a_model.md."
        )
    return family


def attention_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules transformers calls the attention function with, by qualified name: they carry a
    `layer_idx` and their class name ends in "Attention"."""
    return {
        name: module
        for name, module in model.named_modules()
        if getattr(module, "layer_idx", None) is not None and type(module).__name__.endswith("Attention")
    }


def layer_specs_for_model(model: torch.nn.Module, kv_dtype: torch.dtype) -> list[LayerSpec]:
    """LayerSpecs from the model's config, checked against the window each attention module uses."""
    specs = layer_specs_from_config(model.config, kv_dtype)
    for module in attention_modules(model).values():
        layer_idx = module.layer_idx
        if not hasattr(module, "sliding_window"):
            continue
        window = module.sliding_window or None
        if window != specs[layer_idx].sliding_window:
            raise ValueError(
                f"layer {layer_idx} attends with sliding_window={window} but its config says "
                f"{specs[layer_idx].sliding_window}; this model's layout is not one hybridkv understands"
            )
    return specs
