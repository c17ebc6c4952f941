"""Split-KV decode (hybridkv/kernels/triton_attention.py): each sequence's keys in segments run by programs of their
own, combined by `reduce_segments_kernel`. Under the interpreter (or compiled, with HYBRIDKV_TEST_ON_GPU=1) it must
match the dense fp64 reference as the unsplit kernel does, and the unsplit kernel itself up to summation order, with
windows, sinks, softcaps, GQA, in-flight keys, 16-bit and fp8 pages, padding rows and segments left empty; and the split
it takes is a function of the step's shape alone (a CUDA graph replays the one it captured)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.kernels.triton_attention import MAX_SEGMENTS, split_segments, triton_paged_attention

from kernel_reference import make_paged_batch, max_abs_error, on_device, reference_attention

FP32_TOLERANCE = 1e-5
# Decode rows whose keys span several 128-key tiles (the interpreter's tile), one short enough to leave segments
# empty, one of a single key.
SEQ_LENS = [1, 70, 300, 517]


def _split_and_unsplit(batch, num_segments, **options):
    options = on_device(options)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.metadata)
    kwargs = dict(
        scale=options.pop("scale", 0.125),
        sliding_window=options.pop("sliding_window", None),
        softcap=options.pop("softcap", None),
        sinks=options.pop("sinks", None),
        **options,
    )
    split = triton_paged_attention(*args, **kwargs, num_segments=num_segments)
    whole = triton_paged_attention(*args, **kwargs, num_segments=1)
    return split, whole


@pytest.mark.parametrize("num_segments", [pytest.param(n, marks=pytest.mark.slow) for n in (2, 4)] + [8])
def test_split_decode_matches_reference_and_the_unsplit_kernel(num_segments):
    batch = make_paged_batch([1] * len(SEQ_LENS), SEQ_LENS)
    split, whole = _split_and_unsplit(batch, num_segments)
    assert max_abs_error(split, reference_attention(batch, scale=0.125)) <= FP32_TOLERANCE
    assert (split - whole).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    "options",
    [
        dict(sliding_window=200),
        dict(sinks=torch.tensor([-1.0, 0.5, 2.0, 4.0, 0.0, 1.0, -3.0, 6.0])),
        dict(softcap=5.0, scale=1.0),
        dict(sliding_window=150, softcap=10.0, sinks=torch.linspace(-2.0, 2.0, 8), scale=0.5),
    ],
    ids=["window", "sinks", "softcap", "all"],
)
@pytest.mark.fast_if(lambda options: len(options) > 2)  # "all" in the fast tier; each option alone in the full suite
def test_split_decode_with_windows_sinks_and_softcaps_matches_reference(options):
    batch = make_paged_batch(
        [1, 1, 1], [300, 9, 450], num_q_heads=8, num_kv_heads=2, sliding_window=options.get("sliding_window")
    )
    split, whole = _split_and_unsplit(batch, 4, **options)
    reference = reference_attention(batch, **{"scale": 0.125, **options})
    assert max_abs_error(split, reference) <= FP32_TOLERANCE
    assert (split - whole).abs().max().item() <= 1e-6


def test_split_decode_reads_the_steps_own_keys_in_flight():
    batch = make_paged_batch([1, 1], [260, 400], in_flight=True)
    split, whole = _split_and_unsplit(batch, 4, key=batch.step_keys, value=batch.step_values)
    assert max_abs_error(split, reference_attention(batch, scale=0.125)) <= FP32_TOLERANCE
    assert (split - whole).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "tolerance"),
    # fp8: the pages' own rounding against the exact reference (tests/test_kernels_fp8.py's bound); the split is
    # held to the unsplit kernel, which reads the same pages.
    [(torch.bfloat16, None, 2e-2), (torch.float32, torch.float8_e4m3fn, 0.25)],
    ids=["bf16", "fp8-pages"],
)
def test_split_decode_in_other_dtypes_matches_reference(dtype, cache_dtype, tolerance):
    scales = dict(k_scale=0.5, v_scale=2.0) if cache_dtype is not None else {}
    batch = make_paged_batch([1, 1], [300, 140], dtype=dtype, cache_dtype=cache_dtype, value_head_dim=32, **scales)
    split, whole = _split_and_unsplit(batch, 2, **scales)
    assert split.dtype == dtype
    assert max_abs_error(split, reference_attention(batch, scale=0.125)) <= tolerance  # the batch has the scales
    # The split rounds once to the output dtype, as the unsplit kernel does, after another order of sums.
    assert (split.float() - whole.float()).abs().max().item() <= (1e-6 if dtype == torch.float32 else 2e-2)


def test_split_decode_leaves_padding_rows_zero():
    batch = make_paged_batch([1, 1], [300, 33])
    padded = torch.cat([batch.query, torch.randn(3, 4, 64, device=batch.query.device)])
    out = triton_paged_attention(
        padded, batch.key_cache, batch.value_cache, batch.metadata, 0.125, None, None, None, num_segments=4
    )
    assert torch.equal(out[2:].cpu(), torch.zeros(3, 4, 64))
    assert max_abs_error(out[:2], reference_attention(batch, scale=0.125)) <= FP32_TOLERANCE


def test_the_split_depends_on_the_steps_shape_alone():
    # Gemma-3-1B at 64 running on an H200 (1 KV head, 132 SMs): 64 programs leave half the SMs idle.
    assert split_segments(64, 64, 1, 132) == 8
    assert split_segments(8, 8, 1, 132) == MAX_SEGMENTS
    assert split_segments(128, 128, 2, 132) == 1  # 256 programs fill the device
    assert split_segments(4, 40, 1, 132) == 1  # prefill chunks in the step: never split
    for num_seqs in (1, 2, 3, 16, 65, 131):
        segments = split_segments(num_seqs, num_seqs, 1, 132)
        assert segments & (segments - 1) == 0 and 1 <= segments <= MAX_SEGMENTS
        assert num_seqs * segments >= 132 or segments == MAX_SEGMENTS
