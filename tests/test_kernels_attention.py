"""Paged attention, torch path and Triton kernels (interpreter), against the dense fp64 reference.

Tolerances (max abs error on outputs of magnitude ~1): fp32 1e-5; fp16 2e-3; bf16 2e-2 (one bf16
rounding of the output is 4e-3 relative). Every slot that holds no real token, the null block
included, is NaN unless a test says otherwise, so a single read of one shows as NaN in the output.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.kernels import cpu_decode, paged_attention
from hybridkv.kernels.metadata import KeyLimits

from fast_tier import examples
from kernel_reference import make_paged_batch, max_abs_error, on_device, reference_attention

# "torch-loop": the torch path with the CPU decode kernel off (its own per-sequence loop for decode rows).
BACKENDS = ["torch", "torch-loop", "triton"]
FP32_TOLERANCE = 1e-5
TOLERANCE = {torch.float32: FP32_TOLERANCE, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def attention(backend, query, key_cache, value_cache, metadata, **options) -> torch.Tensor:
    """``paged_attention`` on a backend of ``BACKENDS``."""
    with cpu_decode.disabled() if backend == "torch-loop" else contextlib.nullcontext():
        return paged_attention(
            query, key_cache, value_cache, metadata, backend=backend.removesuffix("-loop"), **on_device(options)
        )


def attention_error(batch, backend, *, scale=0.125, **options) -> float:
    out = attention(backend, batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale=scale, **options)
    assert out.shape == (*batch.query.shape[:2], batch.value_cache.shape[-1])
    assert out.dtype == batch.query.dtype
    return max_abs_error(out, reference_attention(batch, scale=scale, **options))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sliding_window", [None, 8])
@pytest.mark.parametrize("in_flight", [False, True])
def test_rows_that_see_later_keys_of_their_image_match_reference(backend, sliding_window, in_flight):
    """An image's tokens attending both ways (Gemma 3): rows 3..9 of the first chunk see on to position 9 of
    their sequence, rows of the second chunk (from position 20) on to position 30; a decode row beside them."""
    batch = make_paged_batch([12, 1, 16], [12, 40, 36], sliding_window=sliding_window, in_flight=in_flight)
    first_row_positions = [0, 39 - 12, 20 - 13]  # each row's position is its row index plus its sequence's shift
    rows = [(row, 9 - row) for row in range(3, 9)] + [
        (row, 30 - (row + first_row_positions[2])) for row in range(13, 23)
    ]
    positions = (
        [row + first_row_positions[0] for row in range(12)]
        + [39]
        + [row + first_row_positions[2] for row in range(13, 29)]
    )
    last = torch.tensor(positions, dtype=torch.int32)
    for row, extra in rows:
        last[row] += extra
    limits = KeyLimits(rows, last.to(batch.query.device))
    options = dict(key=batch.step_keys, value=batch.step_values) if in_flight else {}
    out = attention(backend, batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale=0.125,
                    sliding_window=sliding_window, key_limits=limits, **options)  # fmt: skip
    expected = reference_attention(batch, scale=0.125, sliding_window=sliding_window, key_limits=limits)
    assert max_abs_error(out, expected) <= FP32_TOLERANCE
    causal = reference_attention(batch, scale=0.125, sliding_window=sliding_window)
    assert max_abs_error(causal, expected) > 1e-2  # the limits change the rows they list


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_only_batch_matches_reference(backend):
    batch = make_paged_batch([1, 1, 1, 1], [1, 17, 64, 200])
    assert attention_error(batch, backend) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_only_batch_matches_reference(backend):
    batch = make_paged_batch([5, 48, 70], [5, 48, 70])
    assert attention_error(batch, backend) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_prefill_chunks_and_decodes_match_reference(backend):
    batch = make_paged_batch([1, 40, 1, 23, 1], [90, 72, 33, 23, 150])
    assert attention_error(batch, backend) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("context", ["shorter", "equal", "longer"])
def test_sliding_window_matches_reference_for_context_vs_window(backend, context):
    window = 32
    seq_len = {"shorter": 20, "equal": 32, "longer": 150}[context]
    batch = make_paged_batch([1, 12, seq_len], [seq_len, seq_len, seq_len], sliding_window=window)
    assert attention_error(batch, backend, sliding_window=window) <= FP32_TOLERANCE


@pytest.mark.fast_if(lambda backend, chunk: backend != "triton" or chunk == 24)  # Triton's: a chunk across blocks
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [16, 24, 40])
def test_chunked_local_attention_matches_reference(backend, chunk):
    """A query sees only its own chunk: decodes at, just past and inside a chunk boundary, and prefill
    chunks that cross boundaries (chunks of 24 and 40 end inside blocks of 16)."""
    batch = make_paged_batch([1, 1, 1, 30, 70, 5], [48, 49, 60, 100, 70, 123], attention_chunk_size=chunk)
    assert sum(row.count(0) for row in batch.metadata.block_table_rows) >= 2
    assert attention_error(batch, backend, attention_chunk_size=chunk) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_contexts_put_null_blocks_in_the_table(backend):
    batch = make_paged_batch([1, 30], [200, 180], sliding_window=24)
    null_entries = sum(row.count(0) for row in batch.metadata.block_table_rows)
    assert null_entries >= 10
    assert attention_error(batch, backend, sliding_window=24) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_null_block_contents_never_change_the_output(backend):
    outputs = []
    for garbage in (float("nan"), 1e4, -1e4):
        batch = make_paged_batch([1, 20, 1], [120, 100, 77], sliding_window=16, garbage=garbage)
        out = attention(
            backend, batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale=0.125, sliding_window=16
        )
        outputs.append(out)
    assert torch.isfinite(outputs[0]).all()
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(outputs[0], outputs[2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("queries_per_kv", [1, 2, 4, 8])
def test_gqa_ratio_matches_reference(backend, queries_per_kv):
    batch = make_paged_batch([1, 9, 1], [40, 30, 70], num_q_heads=2 * queries_per_kv, num_kv_heads=2)
    assert attention_error(batch, backend) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_matches_reference(backend):
    batch = make_paged_batch([1, 20], [60, 45])
    # A scale of 1 pushes logits to ~8, deep into tanh's bend for a cap of 5.
    assert attention_error(batch, backend, scale=1.0, softcap=5.0) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_match_reference(backend):
    batch = make_paged_batch([1, 20], [60, 45])
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    assert attention_error(batch, backend, sinks=sinks) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_take_probability_mass_from_the_keys(backend):
    batch = make_paged_batch([1], [30])
    without = attention(backend, batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale=0.125)
    huge_sinks = torch.full((4,), 50.0)
    with_sinks = attention(
        backend, batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale=0.125, sinks=huge_sinks
    )
    assert without.abs().max() > 0.1
    assert with_sinks.abs().max() < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_softcap_and_sinks_together_match_reference(backend):
    batch = make_paged_batch([1, 25, 1], [130, 60, 40], num_q_heads=8, sliding_window=20)
    sinks = torch.linspace(-2.0, 2.0, 8)
    error = attention_error(batch, backend, scale=0.5, sliding_window=20, softcap=10.0, sinks=sinks)
    assert error <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("head_dim", "value_head_dim"), [(64, 32), (48, 64)])
def test_value_head_dim_other_than_the_key_head_dim_matches_reference(backend, head_dim, value_head_dim):
    batch = make_paged_batch(
        [1, 30, 1], [50, 30, 90], head_dim=head_dim, value_head_dim=value_head_dim, sliding_window=24
    )
    assert attention_error(batch, backend, scale=head_dim**-0.5, sliding_window=24) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_caches_that_are_views_into_shared_pages_match_reference(backend):
    """The engine's layout: a layer's K and V are views of its slot in every page, blocks a page apart,
    with other layers' slots (NaN here) around them."""
    batch = make_paged_batch([1, 20, 1], [40, 20, 75], value_head_dim=32, in_pages=True, sliding_window=16)
    assert batch.key_cache.stride(0) != batch.key_cache[0].numel()
    assert attention_error(batch, backend, sliding_window=16) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_head_dim_matches_reference(backend, head_dim):
    batch = make_paged_batch([1, 10], [50, 30], head_dim=head_dim)
    assert attention_error(batch, backend, scale=head_dim**-0.5) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_inputs_match_reference_within_tolerance(backend, dtype):
    batch = make_paged_batch([1, 30, 1], [100, 50, 20], dtype=dtype, sliding_window=40)
    sinks = torch.tensor([0.0, 1.0, -1.0, 2.0], dtype=dtype)
    error = attention_error(batch, backend, sliding_window=40, softcap=20.0, sinks=sinks)
    assert error <= TOLERANCE[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_sizes_other_than_the_tile_match_reference(backend):
    for block_size in (8, 32):
        batch = make_paged_batch([1, 12], [75, 40], block_size=block_size, sliding_window=30)
        assert attention_error(batch, backend, sliding_window=30) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_query_rows_come_back_as_zeros(backend):
    batch = make_paged_batch([1, 6], [20, 6])
    padded_query = torch.cat([batch.query, torch.randn(3, 4, 64, device=batch.query.device)])
    out = attention(backend, padded_query, batch.key_cache, batch.value_cache, batch.metadata, scale=0.125)
    assert torch.equal(out[7:].cpu(), torch.zeros(3, 4, 64))
    assert max_abs_error(out[:7], reference_attention(batch, scale=0.125)) <= FP32_TOLERANCE


@st.composite
def paged_shapes(draw):
    num_seqs = draw(st.integers(1, 3))
    seq_lens = draw(st.lists(st.integers(1, 90), min_size=num_seqs, max_size=num_seqs))
    query_lens = [draw(st.sampled_from([1, draw(st.integers(1, seq_len))])) for seq_len in seq_lens]
    return {
        "query_lens": query_lens,
        "seq_lens": seq_lens,
        "queries_per_kv": draw(st.sampled_from([1, 2, 3, 4])),
        "num_kv_heads": draw(st.integers(1, 2)),
        "head_dim": draw(st.sampled_from([64, 80, 128])),
        "block_size": draw(st.sampled_from([4, 16, 32])),
        "sliding_window": draw(st.one_of(st.none(), st.integers(1, 64))),
        "softcap": draw(st.one_of(st.none(), st.floats(1.0, 30.0))),
        "use_sinks": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _check_drawn_shape(shape, backend):
    num_q_heads = shape["queries_per_kv"] * shape["num_kv_heads"]
    batch = make_paged_batch(
        shape["query_lens"],
        shape["seq_lens"],
        num_q_heads=num_q_heads,
        num_kv_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
        block_size=shape["block_size"],
        sliding_window=shape["sliding_window"],
        seed=shape["seed"],
    )
    sinks = torch.linspace(-1.0, 1.0, num_q_heads) if shape["use_sinks"] else None
    error = attention_error(
        batch,
        backend,
        scale=shape["head_dim"] ** -0.5,
        sliding_window=shape["sliding_window"],
        softcap=shape["softcap"],
        sinks=sinks,
    )
    assert error <= FP32_TOLERANCE


@settings(max_examples=examples(150), deadline=None)
@given(shape=paged_shapes())
def test_torch_path_matches_reference_on_drawn_shapes(shape):
    _check_drawn_shape(shape, "torch")


@settings(max_examples=examples(60), deadline=None)
@given(shape=paged_shapes())
def test_torch_path_without_the_decode_kernel_matches_reference_on_drawn_shapes(shape):
    _check_drawn_shape(shape, "torch-loop")


@pytest.mark.slow
@settings(max_examples=examples(40), deadline=None)
@given(shape=paged_shapes())
def test_triton_kernel_matches_reference_on_drawn_shapes(shape):
    _check_drawn_shape(shape, "triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_query_matches_reference(backend):
    batch = make_paged_batch([1, 12], [40, 30])
    # HF hands attention [batch, heads, tokens, dim]; a caller's transpose gives a strided query.
    strided_query = batch.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided_query.is_contiguous()
    out = attention(backend, strided_query, batch.key_cache, batch.value_cache, batch.metadata, scale=0.125)
    assert max_abs_error(out, reference_attention(batch, scale=0.125)) <= FP32_TOLERANCE
