"""Backend choice and the errors a caller can cause."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import hybridkv.kernels
import hybridkv.memory.block_pool
from hybridkv.kernels import (
    PagedAttentionMetadata,
    StepMetadata,
    attend,
    check_layer_cache,
    kv_page_views,
    paged_attention,
    resolve_backend,
    store_kv,
    write_kv,
)

from kernel_reference import DEVICE, make_paged_batch


def test_cpu_tensors_default_to_the_torch_path():
    assert resolve_backend(None, torch.device("cpu")) == "torch"


def test_cuda_tensors_default_to_triton():
    assert resolve_backend(None, torch.device("cuda", 0)) == "triton"


def test_forcing_triton_on_cpu_without_the_interpreter_names_the_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"set TRITON_INTERPRET=1 .* or use backend='torch'"):
        resolve_backend("triton", torch.device("cpu"))


def test_forcing_triton_on_cpu_under_the_interpreter_is_allowed(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", torch.device("cpu")) == "triton"


def test_a_step_resolves_its_backend_once_for_its_device(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as under the test suite, also where the GPU check runs it
    assert StepMetadata.build([1], [10]).backend == "torch"
    assert StepMetadata.build([1], [10], backend="triton").backend == "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"set TRITON_INTERPRET=1 .* or use backend='torch'"):
        StepMetadata.build([1], [10], backend="triton")


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend must be"):
        resolve_backend("flash", torch.device("cpu"))


def test_query_heads_not_a_multiple_of_kv_heads_is_rejected():
    batch = make_paged_batch([1], [10], num_q_heads=4, num_kv_heads=2)
    query = torch.randn(1, 3, 64)
    with pytest.raises(ValueError, match=r"num_q_heads \(3\) must be a multiple of num_kv_heads \(2\)"):
        paged_attention(query, batch.key_cache, batch.value_cache, batch.metadata, scale=0.125)


def test_a_query_dtype_other_than_fp32_fp16_bf16_is_rejected():
    batch = make_paged_batch([1], [10])
    with pytest.raises(ValueError, match=r"query must be fp32, fp16 or bf16 \(the cache may be of another dtype\)"):
        paged_attention(batch.query.double(), batch.key_cache, batch.value_cache, batch.metadata, scale=0.125)


def test_sinks_of_the_wrong_shape_are_rejected():
    batch = make_paged_batch([1], [10])
    with pytest.raises(ValueError, match=r"sinks must be \[num_q_heads=4\]"):
        paged_attention(
            batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale=0.125, sinks=torch.zeros(2)
        )


def test_fewer_query_rows_than_the_metadata_describes_is_rejected():
    batch = make_paged_batch([3], [10])
    with pytest.raises(ValueError, match="metadata describes 3 query rows, query has 2"):
        paged_attention(batch.query[:2], batch.key_cache, batch.value_cache, batch.metadata, scale=0.125)


def test_write_kv_with_a_mismatched_slot_mapping_is_rejected():
    key_cache = torch.zeros(4, 8, 2, 64)
    with pytest.raises(ValueError, match=r"slot_mapping must be \[3\]"):
        write_kv(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), key_cache, key_cache.clone(), torch.tensor([1, 2]))


def test_metadata_on_another_device_than_the_query_is_rejected():
    batch = make_paged_batch([1], [10])
    with pytest.raises(ValueError, match=r"must be on one device; build the metadata with .*device=query.device"):
        paged_attention(batch.query.to("meta"), batch.key_cache, batch.value_cache, batch.metadata, scale=0.125)


def test_torch_path_works_outside_inference_mode_after_running_inside_it():
    batch = make_paged_batch([1, 1], [40, 90], num_q_heads=8, num_kv_heads=2, seed=3)
    kwargs = dict(scale=0.125, backend="torch")
    with torch.inference_mode():
        inside = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, **kwargs)
    outside = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, **kwargs)
    assert torch.equal(inside, outside)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_unchecked_calls_compute_what_the_checked_ones_do(backend):
    batch = make_paged_batch([1, 7, 1], [33, 40, 90], num_q_heads=8, num_kv_heads=2, sliding_window=24, seed=4)
    metadata = PagedAttentionMetadata.build(
        batch.metadata.query_lens_list, batch.metadata.seq_lens_list, batch.metadata.block_table_rows, 16, DEVICE,
        backend=backend,
    )  # fmt: skip
    options = dict(scale=0.125, sliding_window=24, softcap=30.0)
    expected = paged_attention(batch.query, batch.key_cache, batch.value_cache, metadata, backend=backend, **options)
    assert torch.equal(attend(batch.query, batch.key_cache, batch.value_cache, metadata, **options), expected)
    key, value = torch.randn(9, 2, 64, device=DEVICE), torch.randn(9, 2, 64, device=DEVICE)
    checked = batch.key_cache.clone(), batch.value_cache.clone()
    write_kv(key, value, *checked, metadata.slot_mapping, backend=backend)
    store_kv(key, value, batch.key_cache, batch.value_cache, metadata)
    assert torch.equal(batch.key_cache.nan_to_num(), checked[0].nan_to_num())
    assert torch.equal(batch.value_cache.nan_to_num(), checked[1].nan_to_num())


def test_the_unchecked_attention_still_refuses_a_query_dtype_other_than_fp32_fp16_bf16():
    batch = make_paged_batch([1], [10])
    with pytest.raises(ValueError, match="query must be fp32, fp16 or bf16"):
        attend(batch.query.double(), batch.key_cache, batch.value_cache, batch.metadata, scale=0.125)


def test_a_layer_cache_from_page_views_passes_the_layer_check():
    pages = torch.zeros(4, 2 * 8 * 2 * (16 + 8), dtype=torch.bfloat16)
    check_layer_cache(*kv_page_views(pages, 0, 8, 2, 16, 8), num_q_heads=6)


@pytest.mark.parametrize(
    ("key_cache", "value_cache", "num_q_heads", "error"),
    [
        (torch.zeros(4, 8, 2), torch.zeros(4, 8, 2), None, r"must be \[num_blocks, block_size, num_kv_heads"),
        (torch.zeros(4, 8, 2, 64), torch.zeros(4, 8, 3, 64), None, r"must be \[num_blocks, block_size, num_kv_heads"),
        (torch.zeros(4, 8, 2, 64)[..., ::2], torch.zeros(4, 8, 2, 32), None, "need a contiguous last dimension"),
        (torch.zeros(4, 8, 2, 64, dtype=torch.float64), torch.zeros(4, 8, 2, 64), None, "must share one of fp32"),
        (torch.zeros(4, 8, 2, 64), torch.zeros(4, 8, 2, 64, dtype=torch.float16), None, "must share one of fp32"),
        (torch.zeros(4, 8, 2, 64), torch.zeros(4, 8, 2, 64), 3, r"num_q_heads \(3\) must be a multiple of num_kv"),
    ],
    ids=["not-4d", "heads-differ", "strided-dims", "float64", "k-v-dtypes-differ", "q-heads"],
)
def test_the_layer_check_names_what_the_unchecked_calls_would_get_wrong(key_cache, value_cache, num_q_heads, error):
    with pytest.raises(ValueError, match=error):
        check_layer_cache(key_cache, value_cache, num_q_heads)


def test_the_kernels_import_nothing_from_hybridkv_and_agree_on_the_null_block():
    # The kernels are the bottom layer (hybridkv/kernels/__init__.py): only relative imports, torch and triton.
    for path in Path(hybridkv.kernels.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(alias.name.startswith("hybridkv") for alias in node.names), path.name
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not (node.module or "").startswith("hybridkv"), path.name
    assert hybridkv.kernels.NULL_BLOCK_ID == hybridkv.memory.block_pool.NULL_BLOCK_ID == 0
