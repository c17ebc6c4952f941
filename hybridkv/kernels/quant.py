"""What a KV page element can be, and how a K or V row becomes one.

A cache holds fp32, fp16, bf16 or (where torch has them) fp8 elements; the model may compute in another
of fp32, fp16 and bf16 (attention upcasts what it reads). An fp8 cache stores ``row / scale`` clamped
to the format's largest finite value (vLLM's per-layer convention: one K scale and one V scale per
layer), so a stored element times its scale is the row again, to fp8's precision. The attention folds
the K scale into the logit scale and the V scale into the output, so it never rescales a page.

The K/V a step computes are also read in flight, before they are stored (``dispatch.attend``): they
are first made exactly what the cache would hold (``as_cached``), so a key read from a page and the
same key read in flight give the same logits, and a prefix-cache hit never changes a result.
"""

from __future__ import annotations

import math

import torch

QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# vLLM's calibration constants (envs.K_SCALE_CONSTANT, V_SCALE_CONSTANT): scale = amax / constant, so the
# largest value calibrated maps to 200 (K) or 100 (V), leaving e4m3's 448 as 2.2x (4.5x) headroom.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
FP8_DTYPES = tuple(
    dtype for dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if dtype
)
CACHE_DTYPES = QUERY_DTYPES + FP8_DTYPES


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3fn, 57,344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def fp8_scales(key_amax: float, value_amax: float) -> tuple[float, float]:
    """Per-layer (k_scale, v_scale) from the largest |K| and |V| seen in calibration, vLLM's rule:
    amax / 200 for K and amax / 100 for V (1.0 where nothing was seen)."""
    k_scale = key_amax / K_SCALE_CONSTANT if key_amax > 0 else 1.0
    v_scale = value_amax / V_SCALE_CONSTANT if value_amax > 0 else 1.0
    return float(k_scale), float(v_scale)


def as_cached(rows: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``rows`` as a cache of ``cache_dtype`` stores them: ``rows / scale`` clamped to fp8's range and
    rounded to fp8 (to nearest, ties to even), or simply rounded to a 16/32-bit cache dtype (scale 1)."""
    if is_fp8(cache_dtype):
        limit = fp8_max(cache_dtype)
        return (rows.float() / _divisor(scale, rows.device)).clamp_(-limit, limit).to(cache_dtype)
    return rows.to(cache_dtype)


def _divisor(scale: float, device: torch.device) -> float | torch.Tensor:
    """``scale`` as a divisor whose quotient is correctly rounded on ``device``. On CUDA, torch divides by
    a Python number as a multiplication by its reciprocal, an ulp off at times; a calibrated amax then
    lands on the other side of an e4m3 tie (100 or 200: measured on an H200, 96 where the CPU and the
    Triton kernels give 104). A divisor on the device divides exactly; the CPU already does."""
    if device.type == "cpu":
        return scale
    return torch.full((), scale, dtype=torch.float32, device=device)


def triton_format(cache_dtype: torch.dtype, rows_dtype: torch.dtype) -> dict[str, float | int | bool]:
    """The constexprs of ``triton_common.as_cached`` for rows of ``rows_dtype`` stored in ``cache_dtype``."""
    if is_fp8(cache_dtype):
        info = torch.finfo(cache_dtype)
        mantissa_bits = round(-math.log2(info.eps))
        min_exponent = round(math.log2(info.tiny))
        return {
            "FP8_MAX": info.max,
            "FP8_MANTISSA_BITS": mantissa_bits,
            "FP8_MIN_EXPONENT": min_exponent,
            "ROUND_TO_BF16": False,
        }
    return {
        "FP8_MAX": 0.0,
        "FP8_MANTISSA_BITS": 0,
        "FP8_MIN_EXPONENT": 0,
        "ROUND_TO_BF16": cache_dtype == torch.bfloat16 and rows_dtype == torch.float32,
    }


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-byte tensor as uint8, so that copies work where torch has no fp8 kernel (``index_copy_`` on
    the CPU); any other tensor as it is."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 and tensor.dtype != torch.uint8 else tensor


def check_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """Scales are positive finite numbers, and other than 1 only for an fp8 cache."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (isinstance(scale, (int, float)) and 0.0 < float(scale) < float("inf")):
            raise ValueError(f"{name} must be a positive finite number, got {scale!r}")
        if scale != 1.0 and not is_fp8(cache_dtype):
            raise ValueError(f"{name}={scale} scales an fp8 cache only; a {cache_dtype} cache stores rows as they are")


def check_fp8_device(dtype: torch.dtype, device: torch.device) -> None:
    """The Triton kernels convert float8_e4m3fn with instructions NVIDIA GPUs have from compute capability
    8.9 (Ada, Hopper) on: an older GPU gets a ValueError naming the fixes."""
    if device.type != "cuda" or dtype != getattr(torch, "float8_e4m3fn", None):
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(
            f"kv_cache_dtype=torch.float8_e4m3fn needs a GPU of compute capability 8.9 or later for the Triton "
            f"kernels, and {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}; use "
            "torch.float8_e5m2 (any capability) or a 16-bit kv_cache_dtype"
        )
