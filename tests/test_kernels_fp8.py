"""fp8 KV pages: the write, the error of attention over them against the exact reference, and the errors
a caller can cause.

Measured error (fp32 queries, unit-normal K/V, head dim 64, vLLM's scales amax/200 for K and amax/100 for
V, 25 batches of decodes, prefill chunks, windows and softcap): relative RMS error of the output 3.7%
(e4m3fn) and 7.2% (e5m2), max abs error 0.17 and 0.34 on outputs of magnitude ~1. The bounds below leave
a margin over those; a cache read without its scale, or a rounding that is off by a binade (the Triton
interpreter's own conversion), fails them many times over.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv.kernels import paged_attention, write_kv
from hybridkv.kernels.quant import as_cached, check_fp8_device, fp8_scales

from kernel_reference import DEVICE, make_paged_batch, max_abs_error, reference_attention

BACKENDS = ["torch", "triton"]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
BOUNDS = {torch.float8_e4m3fn: (0.05, 0.25), torch.float8_e5m2: (0.10, 0.5)}  # (relative RMS, max abs)
CASES = [
    ([1, 1, 1, 1], [1, 17, 64, 200], {}),
    ([5, 48, 70], [5, 48, 70], {}),
    ([1, 40, 1, 23, 1], [90, 72, 33, 23, 150], {}),
    ([1, 30, 12], [50, 30, 80], {"sliding_window": 24}),
    ([1, 25, 1], [130, 60, 40], {"sliding_window": 20, "softcap": 10.0}),
]


def fp8_batch(query_lens, seq_lens, cache_dtype, seed=0, **layout):
    dense = make_paged_batch(query_lens, seq_lens, seed=seed, **layout)
    key_amax = max(keys.abs().max() for keys in dense.dense_keys).item()
    value_amax = max(values.abs().max() for values in dense.dense_values).item()
    k_scale, v_scale = fp8_scales(key_amax, value_amax)
    batch = make_paged_batch(
        query_lens, seq_lens, seed=seed, cache_dtype=cache_dtype, k_scale=k_scale, v_scale=v_scale, in_flight=True,
        **layout,
    )  # fmt: skip
    return batch, k_scale, v_scale


@pytest.mark.fast_if(lambda backend, cache_dtype, **_: backend == "torch" or cache_dtype is FP8[0])  # e5m2: torch's
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "options"), CASES, ids=["decode", "prefill", "mixed", "window", "softcap"]
)
def test_attention_over_fp8_pages_stays_within_the_measured_error(backend, cache_dtype, query_lens, seq_lens, options):
    layout = {name: value for name, value in options.items() if name != "softcap"}
    batch, k_scale, v_scale = fp8_batch(query_lens, seq_lens, cache_dtype, **layout)
    out = paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale=0.125, backend=backend,
        key=batch.step_keys, value=batch.step_values, k_scale=k_scale, v_scale=v_scale, **options,
    )  # fmt: skip
    expected = reference_attention(batch, scale=0.125, **options)
    relative_rms, max_abs = BOUNDS[cache_dtype]
    assert ((out.cpu().double() - expected).norm() / expected.norm()).item() <= relative_rms
    assert max_abs_error(out, expected) <= max_abs


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3fn", "e5m2"])
def test_both_backends_read_the_same_fp8_pages_to_the_same_output(cache_dtype):
    batch, k_scale, v_scale = fp8_batch([1, 40, 1, 23], [90, 72, 33, 23], cache_dtype, sliding_window=32)
    outputs = [
        paged_attention(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.metadata,
            scale=0.125,
            backend=backend,
            sliding_window=32,
            key=batch.step_keys,
            value=batch.step_values,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        for backend in BACKENDS
    ]
    assert max_abs_error(outputs[0], outputs[1].double()) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3fn", "e5m2"])
def test_fp8_write_stores_row_over_scale_rounded_to_nearest_and_saturates(backend, cache_dtype):
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(6, 2, 16, generator=generator) * 3
    keys[0, 0, :4] = torch.tensor([1e6, -1e6, 127.6 * 0.02, -1.9 * 0.02])  # saturate; round across a binade
    values = torch.randn(6, 2, 16, generator=generator)
    key_cache = torch.zeros(3, 4, 2, 16, dtype=cache_dtype, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.arange(6, device=DEVICE)
    write_kv(keys.to(DEVICE), values.to(DEVICE), key_cache, value_cache, slots, backend, k_scale=0.02, v_scale=0.5)
    key_cache, value_cache = key_cache.cpu(), value_cache.cpu()
    stored = key_cache.view(-1, 2, 16)[:6].float()
    limit = torch.finfo(cache_dtype).max
    assert stored[0, 0, :2].tolist() == [limit, -limit]
    assert stored[0, 0, 2].item() == 128.0
    assert torch.equal(stored, (keys / 0.02).clamp(-limit, limit).to(cache_dtype).float())
    assert torch.equal(value_cache.view(-1, 2, 16)[:6], as_cached(values, cache_dtype, 0.5))


def test_fp8_scales_follow_vllms_calibration_rule():
    assert fp8_scales(4.0, 2.0) == (0.02, 0.02)
    assert fp8_scales(0.0, 0.0) == (1.0, 1.0)


@pytest.mark.parametrize(
    ("cache_dtype", "k_scale", "error"),
    [
        (torch.bfloat16, 0.5, r"k_scale=0.5 scales an fp8 cache only"),
        (torch.float8_e4m3fn, 0.0, "k_scale must be a positive finite number"),
        (torch.float8_e4m3fn, float("inf"), "k_scale must be a positive finite number"),
    ],
)
def test_bad_scales_are_refused_with_the_rule(cache_dtype, k_scale, error):
    batch = make_paged_batch([1], [10], cache_dtype=cache_dtype)
    with pytest.raises(ValueError, match=error):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale=0.125, k_scale=k_scale)


def test_e4m3_pages_on_a_gpu_before_compute_capability_8_9_name_the_fixes(monkeypatch):
    # Triton refuses to compile e4m3 conversions for sm_80 (tests/test_kernels_triton_compile.py).
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability 8.9 .* A100 is 8.0; use torch.float8_e5m2"):
        check_fp8_device(torch.float8_e4m3fn, torch.device("cuda", 0))
    check_fp8_device(torch.float8_e5m2, torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(torch.float8_e4m3fn, torch.device("cuda", 0))


def correctly_rounded(rows: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """rows / scale as fp32 division rounds it (both fp32; the quotient of their doubles, rounded once),
    clamped and rounded to the fp8 dtype: what every path must store."""
    quotient = (rows.double() / torch.tensor(scale, dtype=torch.float32).double()).float()
    limit = torch.finfo(cache_dtype).max
    return quotient.clamp(-limit, limit).to(cache_dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3fn", "e5m2"])
def test_a_calibrated_amax_is_stored_and_read_in_flight_as_the_exact_quotient_rounds(backend, cache_dtype):
    """fp8_scales maps the calibrated amax to 200 (K) and 100 (V), both e4m3 ties, so the quotient's last
    bit picks the side. On an H200 torch's CUDA division by a Python number (a multiply by the reciprocal)
    gave 99.99999 -> 96 where the CPU and Triton gave 100.00001 -> 104, and the torch path's in-flight
    rows then differed from pages written elsewhere. Every path divides exactly now."""
    amax = 4.562695503234863
    rows = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(1))
    rows[3, 1, 5], rows[6, 0, 2] = amax, -amax
    k_scale, v_scale = fp8_scales(amax, amax)
    expected_keys = correctly_rounded(rows, cache_dtype, k_scale)
    expected_values = correctly_rounded(rows, cache_dtype, v_scale)
    if cache_dtype == torch.float8_e4m3fn:  # the data sits on the ties: the reciprocal rounds the other way
        reciprocal = (rows[3, 1, 5] * torch.tensor(1 / v_scale, dtype=torch.float32)).to(cache_dtype)
        assert reciprocal.float() == 96.0 and expected_values[3, 1, 5].float() == 104.0
    key_cache = torch.zeros(3, 4, 2, 16, dtype=cache_dtype, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    device_rows = rows.to(DEVICE)
    slots = torch.arange(8, device=DEVICE)
    write_kv(device_rows, device_rows, key_cache, value_cache, slots, backend, k_scale=k_scale, v_scale=v_scale)
    bits = lambda tensor: tensor.cpu().view(torch.uint8)  # noqa: E731
    assert torch.equal(bits(key_cache.view(-1, 2, 16)[:8]), bits(expected_keys))
    assert torch.equal(bits(value_cache.view(-1, 2, 16)[:8]), bits(expected_values))
    assert torch.equal(bits(as_cached(device_rows, cache_dtype, v_scale)), bits(expected_values))
