"""Paged attention with the step's own K/V read in flight, against the dense fp64 reference.

In these batches the step's rows are never stored: the blocks wholly past a sequence's context are the
null block and every unwritten slot is NaN, so a key read from a page instead of from the rows shows as
NaN in the output. Engine steps attend this way, then store the rows (the kernels' order in the engine).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.kernels import PagedAttentionMetadata, paged_attention, write_kv

from fast_tier import examples
from kernel_reference import DEVICE, make_paged_batch, max_abs_error, on_device, reference_attention

BACKENDS = ["torch", "triton"]
FP32_TOLERANCE = 1e-5


def in_flight_error(batch, backend, *, scale=0.125, **options) -> float:
    out = paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.metadata,
        scale=scale,
        backend=backend,
        key=batch.step_keys,
        value=batch.step_values,
        **on_device(options),
    )
    return max_abs_error(out, reference_attention(batch, scale=scale, **options))


# Triton's: the full and the windowed-with-softcap layouts in the fast tier (torch's: all four).
@pytest.mark.fast_if(lambda backend, options: backend == "torch" or len(options) != 1)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "options",
    [{}, {"sliding_window": 16}, {"attention_chunk_size": 24}, {"sliding_window": 20, "softcap": 10.0}],
    ids=["full", "window", "chunked", "window-softcap"],
)
def test_prefill_chunks_and_decodes_read_in_flight_match_reference(backend, options):
    layout = {name: value for name, value in options.items() if name != "softcap"}
    batch = make_paged_batch([1, 40, 1, 23, 70], [90, 72, 33, 23, 150], in_flight=True, **layout)
    # The rows' own positions hold nothing: the null block, or NaN in the context's last block.
    assert sum(row.count(0) for row in batch.metadata.block_table_rows) >= 6
    assert in_flight_error(batch, backend, **options) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_flight_rows_with_sinks_gqa_and_narrower_values_match_reference(backend):
    batch = make_paged_batch(
        [1, 25, 9], [130, 60, 9], num_q_heads=8, value_head_dim=32, sliding_window=20, in_flight=True, in_pages=True
    )
    sinks = torch.linspace(-2.0, 2.0, 8)
    assert in_flight_error(batch, backend, scale=0.5, sliding_window=20, sinks=sinks) <= FP32_TOLERANCE


def stored_and_in_flight(batch, options):
    """The batch's attention reading the step's rows from pages (stored first), then in flight."""
    stored = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, **options)
    in_flight = paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.metadata,
        key=batch.step_keys,
        value=batch.step_values,
        **options,
    )
    return stored, in_flight


@pytest.mark.parametrize("backend", BACKENDS)
def test_reading_in_flight_gives_what_reading_the_stored_rows_gives(backend):
    batch = make_paged_batch([1, 30, 12], [50, 30, 80], sliding_window=24)
    options = dict(scale=0.125, sliding_window=24, backend=backend)
    stored, in_flight = stored_and_in_flight(batch, options)
    if backend == "torch":  # the same keys in the same workspace: the same bits
        assert torch.equal(in_flight, stored)
    else:  # another loop order over the same keys
        assert max_abs_error(in_flight, stored.double()) <= 1e-6


@pytest.mark.fast_if(lambda backend, cache_dtype: backend == "torch" or cache_dtype is torch.float8_e4m3fn)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_rows_in_flight_are_rounded_as_the_cache_would_hold_them(backend, cache_dtype):
    """An fp32 model over a bf16 or fp8 cache: the step's rows read in flight give exactly the output of
    the same rows stored first, so a prefix-cache hit (keys from pages) equals a recompute (in flight)."""
    scales = {"k_scale": 0.03, "v_scale": 0.05} if cache_dtype.itemsize == 1 else {}
    batch = make_paged_batch([1, 30, 12], [50, 30, 80], sliding_window=24, cache_dtype=cache_dtype, **scales)
    options = dict(scale=0.125, sliding_window=24, backend=backend, **scales)
    stored, in_flight = stored_and_in_flight(batch, options)
    if backend == "torch":
        assert torch.equal(in_flight, stored)
    else:
        assert max_abs_error(in_flight, stored.double()) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_block_read_at_one_position_and_stored_into_at_another_is_read_before_it_is_overwritten(backend):
    """A windowed group gives a block its window no longer needs after the step to the step's new tail:
    the table holds -b at the old position (read there) and b at the new one (stored into). Attention
    reads the old keys; the write after it skips the rows at the old position and fills the new one."""
    block_size, window = 4, 6
    batch = make_paged_batch([12], [20], block_size=block_size, sliding_window=window, in_flight=True)
    first, second = batch.metadata.block_table_rows[0][:2]  # positions 0..7, the context; 8..19 the step
    assert batch.metadata.block_table_rows[0] == [first, second, 0, 0, 0] and 0 not in (first, second)
    # The step's first query (8) sees keys from 3, its last (19) from 14; after the step the window of
    # position 20 starts at 15, so blocks 3 and 4 stay and take the two context blocks.
    row = [-first, -second, 0, first, second]
    metadata = PagedAttentionMetadata.build([12], [20], [row], block_size, DEVICE, backend=backend)
    assert metadata.block_table[0].tolist() == [first, second, 0, first, second]
    slots = [first * 4 + i for i in range(4)] + [second * 4 + i for i in range(4)]
    assert metadata.slot_mapping.tolist() == [-1] * 4 + slots
    out = paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        metadata,
        scale=0.125,
        sliding_window=window,
        key=batch.step_keys,
        value=batch.step_values,
    )
    assert max_abs_error(out, reference_attention(batch, scale=0.125, sliding_window=window)) <= FP32_TOLERANCE
    write_kv(batch.step_keys, batch.step_values, batch.key_cache, batch.value_cache, metadata.slot_mapping, backend)
    assert torch.equal(batch.key_cache[first].cpu(), batch.dense_keys[0][12:16])
    assert torch.equal(batch.value_cache[second].cpu(), batch.dense_values[0][16:20])


@st.composite
def in_flight_shapes(draw):
    num_seqs = draw(st.integers(1, 3))
    seq_lens = draw(st.lists(st.integers(1, 90), min_size=num_seqs, max_size=num_seqs))
    query_lens = [draw(st.sampled_from([1, draw(st.integers(1, seq_len))])) for seq_len in seq_lens]
    return {
        "query_lens": query_lens,
        "seq_lens": seq_lens,
        "num_q_heads": draw(st.sampled_from([1, 2, 4])) * 2,
        "block_size": draw(st.sampled_from([4, 16, 32])),
        "sliding_window": draw(st.one_of(st.none(), st.integers(1, 64))),
        "softcap": draw(st.one_of(st.none(), st.floats(1.0, 30.0))),
        "seed": draw(st.integers(0, 2**16)),
    }


def _check_drawn_shape(shape, backend):
    batch = make_paged_batch(
        shape["query_lens"],
        shape["seq_lens"],
        num_q_heads=shape["num_q_heads"],
        block_size=shape["block_size"],
        sliding_window=shape["sliding_window"],
        seed=shape["seed"],
        in_flight=True,
    )
    error = in_flight_error(batch, backend, sliding_window=shape["sliding_window"], softcap=shape["softcap"])
    assert error <= FP32_TOLERANCE


@settings(max_examples=examples(100), deadline=None)
@given(shape=in_flight_shapes())
def test_torch_path_reads_in_flight_correctly_on_drawn_shapes(shape):
    _check_drawn_shape(shape, "torch")


@pytest.mark.slow
@settings(max_examples=examples(25), deadline=None)
@given(shape=in_flight_shapes())
def test_triton_kernel_reads_in_flight_correctly_on_drawn_shapes(shape):
    _check_drawn_shape(shape, "triton")


def test_rows_in_flight_must_come_as_a_key_and_value_pair_of_the_caches_shape():
    batch = make_paged_batch([3], [10], in_flight=True)
    call = dict(scale=0.125)
    with pytest.raises(ValueError, match="key and value rows together"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, key=batch.step_keys, **call)
    with pytest.raises(ValueError, match=r"must be \[num_tokens, 2, 64\]"):
        bad = batch.step_keys[..., :32]
        paged_attention(
            batch.query, batch.key_cache, batch.value_cache, batch.metadata, key=bad, value=bad, **call
        )  # fmt: skip
    with pytest.raises(ValueError, match="describes 3 rows, key and value hold 2"):
        keys, values = batch.step_keys[:2], batch.step_values[:2]
        paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, key=keys, value=values, **call)
