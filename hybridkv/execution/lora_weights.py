"""A LoRA adapter read from a PEFT folder, checked against the model it will run on.

The folder holds `adapter_config.json` (PEFT's `LoraConfig`) and `adapter_model.safetensors` (or
`adapter_model.bin`), whose keys name the model's modules: `base_model.model.<module>.lora_A.weight` `[r, in]` and
`.lora_B.weight` `[out, r]` for a linear layer, `.lora_embedding_A` `[r, vocab]` and `.lora_embedding_B` `[dim, r]` for
an embedding. Each module's scaling is PEFT's: `lora_alpha / r` (`/ sqrt(r)` with `use_rslora`), its alpha and rank
from `alpha_pattern` / `rank_pattern` where they name it; an embedding's delta is also multiplied by the embedding's own
`embed_scale` (Gemma's), as PEFT does. What PEFT would compute otherwise (DoRA, trained biases, `modules_to_save`,
trainable tokens, parameter targets such as fused MoE experts, other PEFT methods) is refused with the reason, never
approximated."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridkv.lora.request import LoRARequest

_PREFIX = "base_model.model."
_LINEAR_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_EMBEDDING_SUFFIXES = (".lora_embedding_A", ".lora_embedding_B")
_BASE_SUFFIX = ".base_layer.weight"
# adapter_config.json settings whose adapters compute something other than x @ A.T @ B.T * scaling.
_REFUSED = {
    "use_dora": "DoRA (use_dora) rescales the whole weight per column",
    "lora_bias": "a trained LoRA bias (lora_bias)",
    "modules_to_save": "whole modules saved beside the adapter (modules_to_save)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "layer_replication": "replicated layers (layer_replication)",
    "target_parameters": "parameters targeted directly (target_parameters, e.g. fused MoE experts)",
}


class LoRAError(ValueError):
    """An adapter that cannot be served as asked: its message names the adapter and the fix."""


@dataclass
class ModuleDelta:
    """One module's low-rank delta: `a` `[r, in]` and `b` `[out, r]` with the scaling folded into `b` (a linear
    layer: delta = x @ a.T @ b.T); for an embedding, `a` `[vocab, r]` (rows gathered by token id) and `b` `[dim, r]`."""

    a: torch.Tensor
    b: torch.Tensor
    embedding: bool = False

    @property
    def rank(self) -> int:
        return self.b.shape[1]


@dataclass
class AdapterWeights:
    """An adapter as read and checked: its request, its deltas by module name (the served model's), its largest rank,
    and `key`, a digest of its name, deltas and scalings (the prefix cache keys its requests' blocks by it: an
    adapter loaded again with other weights never meets the blocks of the one before)."""

    request: LoRARequest
    deltas: dict[str, ModuleDelta]
    rank: int
    key: bytes = b""
    nbytes: int = field(default=0)


def read_adapter(
    request: LoRARequest,
    modules: dict[str, torch.nn.Module],
    max_lora_rank: int,
    dtype: torch.dtype,
    embed_scales: dict[str, float] | None = None,
) -> AdapterWeights:
    """`request`'s adapter from its folder, each delta in `dtype` on the CPU. `modules`: the served model's linear and
    embedding layers by name (what an adapter may target). A LoRAError names what is wrong: no folder, no
    adapter_config.json, another PEFT method, a setting refused (module docstring), a rank above `max_lora_rank`, a
    module the model lacks or that is not a linear or embedding layer, or weights whose shapes are not the module's."""
    name = request.lora_name
    if request.tensorizer_config_dict is not None:
        raise LoRAError(f"adapter {name!r}: tensorizer_config_dict is vLLM's tensorizer; give a PEFT folder")
    if not request.lora_path:
        raise LoRAError(f"adapter {name!r}: lora_path is empty; give the PEFT folder it was saved to")
    folder = Path(request.lora_path).expanduser()
    if not folder.is_dir():
        raise LoRAError(
            f"adapter {name!r}: lora_path {str(folder)!r} is not a folder (save it with model.save_pretrained)"
        )
    config = _config(name, folder)
    tensors = _tensors(name, folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if key.endswith(
            _BASE_SUFFIX
        ):  # PEFT saves a targeted embedding's own weight beside it: the model's, or refused
            _check_base_weight(name, key[: -len(_BASE_SUFFIX)].removeprefix(_PREFIX), tensor, modules)
            continue
        for suffix in (*_LINEAR_SUFFIXES, *_EMBEDDING_SUFFIXES):
            if key.endswith(suffix):
                module = key[: -len(suffix)].removeprefix(_PREFIX)
                pairs.setdefault(module, {})[suffix] = tensor
                break
        else:
            raise LoRAError(
                f"adapter {name!r}: {key!r} in its weights is not a LoRA A or B matrix (biases, saved modules and "
                "other PEFT weights are not served)"
            )
    if not pairs:
        raise LoRAError(f"adapter {name!r}: its weights hold no LoRA matrix")
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    alphas = config.get("alpha_pattern") or {}
    deltas: dict[str, ModuleDelta] = {}
    digest = hashlib.sha256(f"hybridkv-lora-v1\n{name}\n".encode())
    for module_name in sorted(pairs):
        found = _module(name, module_name, modules)
        delta = _delta(name, module_name, found, pairs[module_name], max_lora_rank)
        module_alpha = float(alphas[_pattern(alphas, module_name)]) if _pattern(alphas, module_name) else alpha
        scaling = module_alpha / (math.sqrt(delta.rank) if rslora else delta.rank)
        if delta.embedding and embed_scales and module_name in embed_scales:
            scaling *= embed_scales[module_name]
        delta.a = delta.a.to(dtype).contiguous()
        delta.b = (delta.b.to(torch.float64) * scaling).to(dtype).contiguous()
        deltas[module_name] = delta
        digest.update(f"{module_name}:{delta.embedding}:{scaling!r}\n".encode())
        for tensor in (delta.a, delta.b):
            digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    nbytes = sum(d.a.numel() * d.a.element_size() + d.b.numel() * d.b.element_size() for d in deltas.values())
    rank = max(d.rank for d in deltas.values())
    return AdapterWeights(request, deltas, rank, digest.digest(), nbytes)


def _config(name: str, folder: Path) -> dict:
    path = folder / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoRAError(
            f"adapter {name!r}: {str(path)!r} is missing; save the adapter with PEFT's save_pretrained"
        ) from None
    except (OSError, ValueError) as exc:
        raise LoRAError(f"adapter {name!r}: {str(path)!r} cannot be read as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAError(f"adapter {name!r}: {str(path)!r} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoRAError(f"adapter {name!r}: its peft_type is {kind!r}; hybridkv serves LoRA adapters only")
    for setting, what in _REFUSED.items():
        if config.get(setting):
            raise LoRAError(f"adapter {name!r}: {what} is not served; merge it into the model or train without it")
    if config.get("bias", "none") != "none":
        raise LoRAError(
            f"adapter {name!r}: bias={config['bias']!r} trains biases, which are not served; use bias='none'"
        )
    return config


def _tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    safetensors, pickled = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if safetensors.exists():
            from safetensors.torch import load_file

            return load_file(str(safetensors), device="cpu")
        if pickled.exists():
            return torch.load(pickled, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or damaged file: the reader's own error, named
        raise LoRAError(f"adapter {name!r}: its weights in {str(folder)!r} cannot be read ({exc})") from None
    raise LoRAError(f"adapter {name!r}: {str(folder)!r} has no adapter_model.safetensors or adapter_model.bin")


def _check_base_weight(name: str, module_name: str, tensor: torch.Tensor, modules: dict[str, torch.nn.Module]) -> None:
    module = _module(name, module_name, modules)
    weight = module.weight.detach()
    if tensor.shape != weight.shape or not torch.equal(tensor.to(weight.device, weight.dtype), weight):
        raise LoRAError(
            f"adapter {name!r} carries its own weights for {module_name!r} (a resized or trained embedding), which are "
            "not the model's; merge the adapter into the model or serve the model it was trained with"
        )


def _pattern(patterns: dict, module_name: str) -> str | None:
    """PEFT's match of `rank_pattern` / `alpha_pattern` keys: a key matches a module name it ends (after a dot)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_name):
            return key
    return None


def _module(name: str, module_name: str, modules: dict[str, torch.nn.Module]) -> torch.nn.Module:
    found = modules.get(module_name)
    if found is None:
        raise LoRAError(
            f"adapter {name!r} targets {module_name!r}, which the model has not as a linear or embedding layer; "
            "was it trained on another base model?"
        )
    return found


def _delta(
    name: str, module_name: str, module: torch.nn.Module, pair: dict[str, torch.Tensor], max_rank: int
) -> ModuleDelta:
    embedding = isinstance(module, torch.nn.Embedding)
    suffixes = _EMBEDDING_SUFFIXES if embedding else _LINEAR_SUFFIXES
    if set(pair) != set(suffixes):
        raise LoRAError(f"adapter {name!r}: {module_name!r} needs both {suffixes[0]} and {suffixes[1]}")
    a, b = pair[suffixes[0]], pair[suffixes[1]]
    rank = a.shape[0]
    if rank > max_rank:
        raise LoRAError(
            f"adapter {name!r} has rank {rank} at {module_name!r}, above max_lora_rank={max_rank}; patch with "
            f"max_lora_rank={rank} or more"
        )
    if embedding:
        expected = ((rank, module.num_embeddings), (module.embedding_dim, rank))
    else:
        expected = ((rank, module.in_features), (module.out_features, rank))
    if (tuple(a.shape), tuple(b.shape)) != expected:
        raise LoRAError(
            f"adapter {name!r}: {module_name!r}'s A and B are {tuple(a.shape)} and {tuple(b.shape)}, the module needs "
            f"{expected[0]} and {expected[1]}; was it trained on another base model?"
        )
    return ModuleDelta(a.t() if embedding else a, b, embedding)
