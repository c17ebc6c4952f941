"""The dtype of each layer's KV pages, and the scales of fp8 pages.

`kv_cache_dtype` is None (the model's dtype), one dtype for every layer, or one per layer kind
(`{"full": torch.float8_e4m3fn, "sliding": torch.bfloat16}`; a kind not named keeps the model's
dtype). A dtype is a torch dtype or its name, and vLLM's names are understood too ("fp8" is e4m3fn,
"fp8_e4m3", "fp8_e5m2", "auto" the model's dtype). Pages may be fp32, fp16, bf16 or fp8; attention
computes in fp32 whatever they hold (hybridkv/kernels/quant.py).

fp8 pages store K / k_scale and V / v_scale with one pair of scales per layer (vLLM's convention),
chosen at patch time from the probe forward's own K and V of that layer (`hybridkv/patches/probe.py`, 40 tokens):
k_scale = max |K| / 200 and v_scale = max |V| / 100, vLLM's calibration rule, so the probe's largest
key is stored as 200 of e4m3's 448 (values 2.2x larger saturate rather than overflow; V has 4.5x
headroom). A KV-sharing layer reads its source's pages with the source's scales.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.kernels.quant import CACHE_DTYPES, fp8_scales, is_fp8
from hybridkv.memory.kv_spec import LayerSpec

LAYER_KINDS = ("full", "sliding", "chunked")
_VLLM_NAMES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_CHOICES = "torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn or torch.float8_e5m2"

KVCacheDtype = torch.dtype | str | Mapping[str, torch.dtype | str | None] | None


def normalize_kv_cache_dtype(value: KVCacheDtype) -> torch.dtype | dict[str, torch.dtype | None] | None:
    """`kv_cache_dtype` checked and with names made dtypes; a TypeError or ValueError names the fix."""
    if isinstance(value, Mapping):
        unknown = [kind for kind in value if kind not in LAYER_KINDS]
        if unknown:
            kinds = ", ".join(map(repr, LAYER_KINDS))
            raise ValueError(f"kv_cache_dtype names layer kinds {kinds}, got {', '.join(map(repr, unknown))}")
        return {kind: _dtype(dtype, f"kv_cache_dtype[{kind!r}]") for kind, dtype in value.items()}
    return _dtype(value, "kv_cache_dtype")


def _dtype(value: Any, name: str) -> torch.dtype | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, str):
        attribute = _VLLM_NAMES.get(value, value)
        dtype = getattr(torch, attribute, None)
        if dtype is None and attribute.startswith("float8"):
            raise ValueError(
                f"{name}={value!r} needs torch.{attribute}, which torch {torch.__version__} does not have; "
                "upgrade torch (2.1 or later has the float8 dtypes) or use 'bfloat16'"
            )
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name}={value!r} is not a dtype; use {_CHOICES} (or 'fp8', 'fp8_e5m2')")
        value = dtype
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"{name} must be None (the model's dtype), a torch dtype such as torch.bfloat16 or its name, or a "
            f"dict of layer kind to dtype; got {value!r}"
        )
    if value not in CACHE_DTYPES:
        raise ValueError(f"{name}={value} is not a KV page dtype; use {_CHOICES}")
    return value


def layer_kind(spec: LayerSpec) -> str:
    if spec.attention_chunk_size is not None:
        return "chunked"
    return "full" if spec.sliding_window is None else "sliding"


@dataclass(frozen=True)
class LayerDtypes:
    """Per layer that holds pages: its pages' dtype, and its (k_scale, v_scale) (1.0 for 16/32-bit)."""

    dtypes: dict[int, torch.dtype]
    scales: dict[int, tuple[float, float]]

    @property
    def names(self) -> dict[str, str]:
        """Each dtype held, with the layers holding it: `{"float8_e4m3fn": "0-2, 4", ...}` (for stats)."""
        by_dtype: dict[str, list[int]] = {}
        for layer_idx, dtype in sorted(self.dtypes.items()):
            by_dtype.setdefault(str(dtype).removeprefix("torch."), []).append(layer_idx)
        return {name: ", ".join(map(str, layers)) for name, layers in by_dtype.items()}


def resolve_layer_dtypes(
    kv_cache_dtype: torch.dtype | Mapping[str, torch.dtype | None] | None,
    specs: Sequence[LayerSpec],
    model_dtype: torch.dtype,
    kv_amax: Mapping[int, tuple[float, float]],
) -> tuple[list[LayerSpec], LayerDtypes]:
    """The specs with each layer's page bytes per element, and the dtypes and scales of the layers that
    hold pages (`kv_amax`: each layer's largest |K| and |V| in the probe forward)."""
    if model_dtype not in CACHE_DTYPES:
        raise ValueError(f"hybridkv serves fp32, fp16 and bf16 models; this one is {model_dtype}: convert it")
    dtypes: dict[int, torch.dtype] = {}
    for spec in specs:  # in layer order: a KV-sharing layer comes after its source, whose dtype it reads
        if spec.kv_source is not None:
            dtypes[spec.layer_idx] = dtypes[spec.kv_source]
        elif isinstance(kv_cache_dtype, Mapping):
            dtypes[spec.layer_idx] = kv_cache_dtype.get(layer_kind(spec)) or model_dtype
        else:
            dtypes[spec.layer_idx] = kv_cache_dtype or model_dtype
    resolved = [dataclasses.replace(spec, dtype_bytes=dtypes[spec.layer_idx].itemsize) for spec in specs]
    holders = [spec.layer_idx for spec in specs if spec.holds_pages]
    scales = {i: fp8_scales(*kv_amax[i]) if is_fp8(dtypes[i]) else (1.0, 1.0) for i in holders}
    for spec in specs:  # a V read from the K row's bytes is scaled as they are
        if spec.value_in_key and spec.layer_idx in scales:
            scales[spec.layer_idx] = (scales[spec.layer_idx][0],) * 2
    return resolved, LayerDtypes({i: dtypes[i] for i in holders}, scales)
