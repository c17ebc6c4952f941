"""The CPU decode kernel (hybridkv/kernels/cpu_decode.c): which rows it takes, every page format against the
per-sequence torch path, and what happens where it cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hybridkv.kernels import PagedAttentionMetadata, attend, cpu_decode, paged_attention, store_kv
from hybridkv.kernels.quant import FP8_DTYPES
from hybridkv.kernels.torch_plan import SHORT_CHUNK_ROWS, _decode_only_layout, _general_layout, torch_plan

from kernel_reference import make_paged_batch, max_abs_error, reference_attention


def test_the_kernel_builds_on_a_machine_with_a_c_compiler():
    assert cpu_decode.available(), cpu_decode.unavailable_reason()


def test_decode_rows_go_to_the_kernel_and_prefill_chunks_are_gathered():
    metadata = PagedAttentionMetadata.build([1, 7, 1], [30, 7, 50], [[1, 2], [3], [4, 5, 6, 7]], 16)
    plan = torch_plan(metadata, None, None, batch_decodes=True)
    assert plan.decode.rows.tolist() == [0, 8]
    assert plan.decode.seq_ids.tolist() == [0, 2]
    assert plan.decode.seq_lens.tolist() == [30, 50]
    assert plan.decode.num_keys == 80
    assert [(seq.query_start, seq.query_end) for seq in plan.sequences] == [(1, 8)]
    assert plan.gather_block_ids.tolist() == [3]
    assert plan.gathered_rows.tolist() == list(range(1, 8))


def test_a_window_starts_each_decode_row_at_its_first_visible_position():
    metadata = PagedAttentionMetadata.build([1, 1], [10, 100], [[1], [0, 0, 0, 2, 3, 4, 5]], 16)
    plan = torch_plan(metadata, 24, None, batch_decodes=True)
    assert plan.decode.first_positions.tolist() == [0, 76]
    assert plan.decode.num_keys == 10 + 24


def _kernel_and_loop(batch, **options):
    kernel = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, **options)
    with cpu_decode.disabled():
        loop = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, **options)
    return kernel, loop


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, *FP8_DTYPES])
@pytest.mark.parametrize("in_flight", [False, True])
def test_every_page_format_matches_the_per_sequence_path(cache_dtype, in_flight):
    scales = {"k_scale": 0.05, "v_scale": 0.03} if cache_dtype in FP8_DTYPES else {}
    batch = make_paged_batch(
        [1, 1, 9, 1],
        [70, 1, 40, 133],
        num_q_heads=8,
        num_kv_heads=2,
        cache_dtype=cache_dtype,
        in_flight=in_flight,
        **scales,
    )
    step_rows = {"key": batch.step_keys, "value": batch.step_values} if in_flight else {}
    kernel, loop = _kernel_and_loop(batch, scale=0.125, **scales, **step_rows)
    assert max_abs_error(kernel, loop) <= 2e-6


@pytest.mark.parametrize(
    ("queries_per_kv", "num_kv_heads", "head_dim", "value_head_dim"),
    [(3, 2, 20, 12), (8, 1, 72, 72), (5, 3, 16, 136), (1, 4, 8, 4), (16, 1, 256, 256)],
)
def test_every_head_grouping_and_width_matches_the_reference(queries_per_kv, num_kv_heads, head_dim, value_head_dim):
    """The kernel sums values for up to four q heads by up to eight 8-lane chunks per pass, then the rest
    (a chunk tail of fewer than 8 lanes one by one): odd groups and widths take every combination."""
    batch = make_paged_batch(
        [1, 1, 1, 1],
        [45, 1, 77, 260],
        num_q_heads=queries_per_kv * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        value_head_dim=value_head_dim,
        in_flight=True,
    )
    options = {"scale": head_dim**-0.5, "key": batch.step_keys, "value": batch.step_values}
    kernel, loop = _kernel_and_loop(batch, **options)
    assert max_abs_error(kernel, loop) <= 2e-6
    reference = reference_attention(batch, scale=head_dim**-0.5)
    assert max_abs_error(kernel, reference) <= 2e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_models_get_their_output_rounded_once(dtype):
    batch = make_paged_batch([1, 1, 5], [40, 90, 5], dtype=dtype)
    kernel, loop = _kernel_and_loop(batch, scale=0.125)
    assert kernel.dtype == dtype
    assert max_abs_error(kernel, reference_attention(batch, scale=0.125)) <= 2e-2
    # Both paths compute in fp32 and round once: they differ by at most one rounding step.
    assert max_abs_error(kernel, loop) <= 8e-3


def test_softcap_sinks_and_window_together_match_the_reference():
    batch = make_paged_batch([1, 1, 1], [5, 64, 200], num_q_heads=8, num_kv_heads=2, sliding_window=48)
    sinks = torch.linspace(-2.0, 2.0, 8)
    options = {"scale": 0.125, "sliding_window": 48, "softcap": 5.0, "sinks": sinks}
    kernel, loop = _kernel_and_loop(batch, **options)
    assert max_abs_error(kernel, reference_attention(batch, **options)) <= 1e-5
    assert max_abs_error(kernel, loop) <= 1e-6


def test_a_group_too_large_for_the_kernel_takes_the_per_sequence_path():
    assert cpu_decode.accepts(group=16, head_dim=256, value_dim=256)  # Gemma's heads
    assert not cpu_decode.accepts(group=64, head_dim=512, value_dim=512)
    batch = make_paged_batch([1, 1], [30, 70], num_q_heads=64, num_kv_heads=1, head_dim=512)
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale=0.04)
    assert max_abs_error(out, reference_attention(batch, scale=0.04)) <= 1e-5


def _in_a_fresh_process(environment: dict[str, str], cache_dir) -> str:
    script = textwrap.dedent(
        """
        from hybridkv.kernels import cpu_decode, paged_attention
        from kernel_reference import make_paged_batch, max_abs_error, reference_attention
        batch = make_paged_batch([1, 4], [50, 4])
        out = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale=0.125)
        assert max_abs_error(out, reference_attention(batch, scale=0.125)) <= 1e-5
        print(cpu_decode.available(), cpu_decode.unavailable_reason())
        """
    )
    env = {**os.environ, "HYBRIDKV_CACHE_DIR": str(cache_dir), **environment}
    tests_dir = os.path.dirname(__file__)
    env["PYTHONPATH"] = os.pathsep.join([tests_dir, env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.slow
def test_without_a_compiler_the_torch_path_serves_decode_rows(tmp_path):
    printed = _in_a_fresh_process({"CC": "/bin/false"}, tmp_path)
    assert printed.startswith("False could not build the CPU decode kernel")
    assert not list(tmp_path.glob("*.so"))


@pytest.mark.slow
def test_hybridkv_cpu_kernel_0_turns_the_kernel_off(tmp_path):
    assert _in_a_fresh_process({"HYBRIDKV_CPU_KERNEL": "0"}, tmp_path) == "False HYBRIDKV_CPU_KERNEL=0"


@pytest.mark.slow
def test_the_library_is_built_once_into_the_cache_directory(tmp_path):
    assert _in_a_fresh_process({}, tmp_path) == "True None"
    (library,) = tmp_path.glob("cpu_decode-*.so")
    built_at = library.stat().st_mtime_ns
    assert _in_a_fresh_process({}, tmp_path) == "True None"
    assert library.stat().st_mtime_ns == built_at


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, *FP8_DTYPES])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 9, 1]], ids=["decode-only", "mixed"])
def test_attend_with_store_leaves_the_pages_as_a_separate_store_does(cache_dtype, query_lens):
    """On a decode-only step the kernel stores the rows itself; either way the pages end the same. (A chunk of 9 rows
    is gathered either way; a shorter one is the next test's.)"""
    scales = {"k_scale": 0.05, "v_scale": 0.03} if cache_dtype in FP8_DTYPES else {}
    pages = []
    outputs = []
    for fused in (True, False):
        batch = make_paged_batch(
            query_lens, [40, 70, 19], in_pages=True, in_flight=True, cache_dtype=cache_dtype, **scales
        )
        options = {"scale": 0.125, "key": batch.step_keys, "value": batch.step_values, **scales}
        caches = (batch.key_cache, batch.value_cache, batch.metadata)
        before = batch.key_cache.clone()
        if fused:
            outputs.append(attend(batch.query, *caches, store=True, **options))
        else:
            outputs.append(attend(batch.query, *caches, **options))
            store_kv(batch.step_keys, batch.step_values, *caches, **scales)
        pages.append((batch.key_cache.clone(), batch.value_cache.clone()))
        assert not torch.equal(before.view(torch.uint8), batch.key_cache.view(torch.uint8))  # rows were stored
    assert torch.equal(outputs[0], outputs[1])
    for fused_pages, stored_pages in zip(*pages, strict=True):
        assert torch.equal(fused_pages.view(torch.uint8), stored_pages.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, *FP8_DTYPES])
@pytest.mark.parametrize("window", [None, 24])
def test_short_chunks_attended_row_by_row_over_rows_stored_first(cache_dtype, window):
    """A step's sequences of at most SHORT_CHUNK_ROWS rows (a speculative check) go to the decode kernel row by row,
    each over its keys up to its own, the rows stored first, where `attend` stores them and the layer has full
    attention; their outputs are the gathered path's to fp32 rounding and the pages end as a separate store leaves
    them. A sliding window's layer gathers them as before (its rows are stored after attending). The step's rows have
    blocks of their own here (the batch stores them beforehand, as the store writes them again); a row whose slot
    is the null block's (-1) turns the path off (the next test)."""
    scales = {"k_scale": 0.05, "v_scale": 0.03} if cache_dtype in FP8_DTYPES else {}
    query_lens = [1, SHORT_CHUNK_ROWS, 3, 1]
    results = []
    for fused in (True, False):
        batch = make_paged_batch(query_lens, [40, 70, 19, 33], cache_dtype=cache_dtype, **scales)
        options = {"scale": 0.125, "key": batch.step_keys, "value": batch.step_values, "sliding_window": window}
        caches = (batch.key_cache, batch.value_cache, batch.metadata)
        out = attend(batch.query, *caches, store=fused, **options, **scales)
        if not fused:
            store_kv(batch.step_keys, batch.step_values, *caches, **scales)
        plan = torch_plan(batch.metadata, window, None, True, short_chunks=fused)
        assert plan.stores_first == (fused and window is None)
        results.append((out, batch.key_cache.clone(), batch.value_cache.clone()))
    (fused_out, *fused_pages), (plain_out, *plain_pages) = results
    torch.testing.assert_close(fused_out, plain_out, rtol=1e-5, atol=1e-5)
    for fused_page, plain_page in zip(fused_pages, plain_pages, strict=True):
        assert torch.equal(fused_page.view(torch.uint8), plain_page.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_short_chunks_alone_are_stored_by_the_kernel_before_any_row_reads(cache_dtype):
    """A step of short chunks and decode rows only: the decode kernel stores every row first, then attends (no
    separate write). The rows' slots hold NaN before the call, so a row read before its store would poison the
    output; the output is the gathered path's and the pages end as a separate store leaves them."""
    batch = make_paged_batch([3, 1, SHORT_CHUNK_ROWS], [40, 19, 70], cache_dtype=cache_dtype)
    options = {"scale": 0.125, "key": batch.step_keys, "value": batch.step_values}
    caches = (batch.key_cache, batch.value_cache, batch.metadata)
    expected = attend(batch.query, *caches, **options)  # gathered, the rows read in flight, nothing stored
    expected_pages = (batch.key_cache.clone(), batch.value_cache.clone())
    store_kv(torch.full_like(batch.step_keys, float("nan")), torch.full_like(batch.step_values, float("nan")), *caches)
    out = attend(batch.query, *caches, store=True, **options)
    plan = torch_plan(batch.metadata, None, None, True, short_chunks=True)
    assert plan.stores_first and not plan.sequences
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for page, expected_page in zip((batch.key_cache, batch.value_cache), expected_pages, strict=True):
        assert torch.equal(page.view(torch.uint8), expected_page.view(torch.uint8))


def test_short_chunks_whose_rows_have_no_slot_are_gathered():
    """The step's rows on the null block (slot -1: nothing to read back) keep the gathered path, bit for bit."""
    outputs = []
    for fused in (True, False):
        batch = make_paged_batch([1, SHORT_CHUNK_ROWS, 1], [40, 70, 19], in_pages=True, in_flight=True)
        options = {"scale": 0.125, "key": batch.step_keys, "value": batch.step_values}
        outputs.append(attend(batch.query, batch.key_cache, batch.value_cache, batch.metadata, store=fused, **options))
        assert not torch_plan(batch.metadata, None, None, True, short_chunks=fused).stores_first
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize(("window", "chunk"), [(None, None), (24, None), (None, 32)])
def test_a_step_of_decode_rows_only_gets_the_layout_the_general_builder_gives(window, chunk):
    step = PagedAttentionMetadata.build([1, 1, 1], [10, 100, 33], [[1], [2] * 7, [3] * 3], 16).step
    fast = _decode_only_layout(step, window, chunk)
    general = _general_layout(step, 16, window, chunk, batch_decodes=True)
    assert fast.sequences == general.sequences == []
    for name in ("seq_ids", "rows", "first_positions", "seq_lens"):
        assert getattr(fast.decode, name).tolist() == getattr(general.decode, name).tolist(), name
        assert getattr(fast.decode, name).dtype == torch.int32
    assert fast.decode.num_keys == general.decode.num_keys
    for name in ("gather_seqs", "gather_blocks", "row_keys", "gathered_rows"):
        assert getattr(fast, name).tolist() == getattr(general, name).tolist() == [], name
