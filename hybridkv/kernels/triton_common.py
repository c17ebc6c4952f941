"""Pieces the Triton kernels share: the cache's view of a row, rounding to bf16, one step of the online
softmax, and which keys a tile's rows see."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    # exp2 form: portable across the interpreter and every backend; saturates correctly at +-inf.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def as_cached(
    rows,
    scale,
    CACHE_TYPE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr,
    FP8_MIN_EXPONENT: tl.constexpr,
    ROUND_TO_BF16: tl.constexpr,
):
    """Rows as the cache holds them (hybridkv/kernels/quant.py): for fp8 (FP8_MAX > 0), rows / scale clamped and
    rounded to nearest, ties to even; rows rounded the same way to a bf16 cache; else as they convert.

    The rounding is done here rather than by the conversion: the Triton interpreter's fp32 -> fp8 and
    fp32 -> bf16 conversions are wrong (127.6 -> e4m3 gave 64; bf16 truncates), and this form gives what
    a GPU's round-to-nearest-even conversion gives, so the interpreter tests check the code a GPU runs.
    """
    if FP8_MAX > 0:
        # div_rn: the correctly rounded quotient, as torch computes it (quant.as_cached). The `/` operator
        # may be off by an ulp, and a calibrated amax divides to exactly an e4m3 tie (100 or 200).
        rows = tl.minimum(tl.maximum(tl.math.div_rn(rows.to(tl.float32), scale), -FP8_MAX), FP8_MAX)
        rows = round_to_fp8_grid(rows, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT)
    elif ROUND_TO_BF16:
        rows = round_to_bf16_grid(rows)
    return rows.to(CACHE_TYPE)


@triton.jit
def round_to_bf16_grid(x):
    """x rounded to the nearest bf16 value (ties to even), as fp32: it converts to bf16 exactly, where the
    interpreter's own fp32 -> bf16 conversion truncates."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to_fp8_grid(x, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """fp32 x (within the format's range) rounded to the nearest value of a float format with
    MANTISSA_BITS stored mantissa bits and smallest normal exponent MIN_EXPONENT (ties to even): every
    operation is exact in fp32, so the result converts to the format without rounding."""
    exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXPONENT)
    step = ((exponent - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
    scaled = tl.abs(x) / step
    whole = tl.floor(scaled)
    fraction = scaled - whole
    odd = (whole.to(tl.int32) & 1) == 1
    rounded = (whole + tl.where((fraction > 0.5) | ((fraction == 0.5) & odd), 1.0, 0.0)) * step
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def online_softmax_step(q, k, v, visible, acc, running_max, running_sum, scale, softcap, USE_SOFTCAP: tl.constexpr):
    """Fold one KV tile into the running max, sum and weighted values (base-2 online softmax)."""
    scores = tl.dot(q, k, input_precision="ieee") * scale
    if USE_SOFTCAP:
        scores = softcap * tanh(scores / softcap)
    scores = tl.where(visible, scores * 1.4426950408889634, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    # Rows with nothing visible yet (padding rows) keep a finite max so exp2 gives 0, not NaN.
    new_max = tl.where(new_max > float("-inf"), new_max, 0.0)
    probs = tl.exp2(scores - new_max[:, None])
    correction = tl.exp2(running_max - new_max)
    running_sum = running_sum * correction + tl.sum(probs, axis=1)
    acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
    return acc, new_max, running_sum


@triton.jit
def visible_keys(
    key_positions,
    key_valid,
    row_position,
    row_last,
    sliding_window,
    chunk_size,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
):
    # Keys up to the row's last visible position (its own, or past it within an image that attends both
    # ways); a window counts back from the row's own position.
    visible = key_valid[None, :] & (key_positions[None, :] <= row_last[:, None])
    if USE_WINDOW:
        visible = visible & (key_positions[None, :] > row_position[:, None] - sliding_window)
    if USE_CHUNK:
        visible = visible & (key_positions[None, :] >= row_position[:, None] // chunk_size * chunk_size)
    return visible
