"""The graph-ready step: attention as one opaque torch op per layer, a forward that traces with no graph break,
step buffers that keep their addresses, and decode steps padded to buckets (graph mode, which a GPU captures
as CUDA graphs and the CPU runs eagerly over the same padded buffers)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version

import hybridkv
from hybridkv import SamplingParams
from hybridkv.execution.graphs import decode_buckets
from hybridkv.kernels import StepMetadata
from hybridkv.kernels.step_buffers import _FILL, _NATIVE, StepBuffers
from hybridkv.patches.attention import paged_attention_op, running_step

from model_zoo import LATENT, STATE, ZOO, slow_except, untraceable_llama
from tiny_models import FAMILIES, hf_greedy, new_request_id, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_decode_buckets_follow_vllms_capture_sizes_up_to_max_num_seqs():
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert decode_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert decode_buckets(1) == (1,)
    assert decode_buckets(256)[-4:] == (160, 192, 224, 256)
    assert decode_buckets(300)[-2:] == (256, 300)


def test_the_attention_op_passes_torch_librarys_opcheck(patched):
    model = FAMILIES["gemma3_text"]()
    llm = patched(model, block_size=8, max_model_len=128)
    request_id = llm.add_request(new_request_id(), prompts((20,))[0], SamplingParams(temperature=0, max_tokens=2))
    llm.step()  # the prompt's pages hold its keys; the next step is one decode row
    plan = llm.core.scheduler.schedule()
    prepared = llm.core.runner.prepare(llm.core.runner.step_inputs(plan))
    llm.core.runner.context.metadata = prepared.metadata
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    with running_step(llm.core.runner.context):
        for layer_idx, window in ((0, 16), (5, None)):  # a sliding and the full layer
            torch.library.opcheck(paged_attention_op, (query, key, value, None, layer_idx, 0.25, None, window))
    llm.abort(request_id)


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# transformers' own code of these loops in Python over what a tensor holds: no graph can hold their forward.
# Zoo families dynamo cannot trace whole: Step3p7's experts looped over the experts its router picked until
# transformers 5.25. The refusal itself is tested on a model that loops on every version (`untraceable_llama`).
UNTRACEABLE = {"step3p7"} if Version(transformers.__version__) < Version("5.25") else set()


# State layers are not compiled (test below); neither are the latent families that have them too.
WITH_STATE_LAYERS = STATE.keys() | {"kimi_linear", "bailing_hybrid"}


@pytest.mark.parametrize("name", slow_except(sorted(ZOO.keys() - UNTRACEABLE - WITH_STATE_LAYERS), fast=("gpt_oss",)))
def test_every_served_family_runs_its_compiled_program_with_eager_tokens(name, patched, eager_pieces):
    """One trace per family at patch time (no graph break), split at attention into the program that then serves
    every step: the prompts' step (rows of several lengths) and the decode steps after it run with no trace
    again (set_stance fail_on_recompile, dynamo's graph count unchanged), and the tokens are eager mode's.
    The pieces run as traced here (`eager_pieces`); inductor's code: the tests below and
    benchmarks/compile_sweep.py."""
    model = ZOO[name]()
    batch = prompts((7, 33, 70))
    params = SamplingParams(temperature=0, max_tokens=3)
    expected = tokens(patched(model, block_size=8, max_model_len=256).generate(batch, params, use_tqdm=False))
    llm = patched(model, block_size=8, max_model_len=256, compile=True)
    assert llm.stats()["compiled"] and llm.stats()["compiled_from"] == "traced"
    graphs = unique_graphs()
    with torch.compiler.set_stance("fail_on_recompile"):
        assert tokens(llm.generate(batch, params, use_tqdm=False)) == expected
    assert unique_graphs() == graphs


def test_compile_refuses_a_model_whose_forward_cannot_be_traced_whole_naming_the_fix(patched):
    model = untraceable_llama()
    cannot_trace = r"compile=True: .*cannot be compiled: torch.compile\(fullgraph=True\) cannot trace.*compile=False"
    with pytest.raises(ValueError, match=cannot_trace):
        hybridkv.patch(model, block_size=8, max_model_len=256, compile=True)
    assert not hybridkv.is_patched(model)
    llm = patched(model, block_size=8, max_model_len=256, enforce_eager=False)  # graph mode still serves it
    assert tokens(llm.generate(prompts((7,)), GREEDY, use_tqdm=False))[0] == hf_greedy(model, prompts((7,))[0], 12)[0]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_latent_attention_models_pad_decode_steps_in_graph_mode_and_compile_when_asked(backend, patched, eager_pieces):
    """A latent attention model's decode steps are padded to buckets in graph mode: a step of decode rows only attends
    over the step buffers' own tables and lengths (hybridkv/kernels/latent_attention.py, what a CUDA graph captures),
    padding rows included, and gives eager mode's tokens, on the torch path (the CPU decode kernel) and the Triton
    latent kernel (the interpreter). It does not compile by default; compile=True traces the forward, its cache
    updates as `store_latent` ops, and gives eager mode's tokens too."""
    model = LATENT["deepseek_v3"]()
    batch = prompts((7, 33, 70))
    common = dict(block_size=8, max_model_len=256, attention_backend=backend)
    expected = tokens(patched(model, enforce_eager=True, **common).generate(batch, GREEDY, use_tqdm=False))
    hybridkv.unpatch(model)
    llm = patched(model, enforce_eager=False, **common)
    assert llm.stats()["decode_buckets"] == list(decode_buckets(llm.config.max_num_seqs))
    assert not llm.stats()["compiled"]
    padded = []
    forward = llm.core.runner.forward
    llm.core.runner.forward = lambda prepared: padded.append(prepared.bucket) or forward(prepared)
    assert tokens(llm.generate(batch, GREEDY, use_tqdm=False)) == expected
    assert 4 in padded  # three decode rows and one padding row
    hybridkv.unpatch(model)
    if backend == "torch":
        llm = patched(model, block_size=8, max_model_len=256, max_num_batched_tokens=32, compile=True)
        assert llm.stats()["compiled"] and llm.stats()["compiled_from"] == "traced"
        assert tokens(llm.generate(batch, GREEDY, use_tqdm=False)) == expected


def test_latent_attention_over_fp8_pages_stays_unpadded_in_graph_mode(patched):
    """fp8 pages' decode rows take the torch path on the Triton backend, built per step: no bucket to capture."""
    model = LATENT["deepseek_v2"]()
    llm = patched(model, block_size=8, max_model_len=256, enforce_eager=False, kv_cache_dtype=torch.float8_e4m3fn)
    assert llm.stats()["decode_buckets"] == []


def test_compile_and_graphs_leave_state_layer_models_eager_with_a_clear_error(patched):
    """State layers run per request segment (hybridkv/execution/state_layers.py), which neither torch.compile nor a CUDA
    graph holds yet: compile=True is refused naming the fix, and graph mode leaves their steps unpadded."""
    model = STATE["qwen3_next"]()
    with pytest.raises(ValueError, match=r"compile=True does not compile models with state layers yet.*compile=False"):
        hybridkv.patch(model, block_size=8, max_model_len=256, compile=True)
    llm = patched(model, block_size=8, max_model_len=256, enforce_eager=False)
    assert llm.stats()["decode_buckets"] == [] and llm.stats()["state_layers"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3_text", "gemma4"])
def test_compiled_steps_of_any_size_never_recompile_after_warm_up(name, patched, eager_pieces):
    """Traced once at patch time; after it no step size traces again, whatever the prompts, chunks and decode
    batch sizes: a lone request (one row, one logits row), chunked prompts, decode buckets (graph mode)."""
    model = ZOO[name]()
    llm = patched(model, block_size=8, max_model_len=256, max_num_batched_tokens=32, compile=True, enforce_eager=False)
    graphs = unique_graphs()
    with torch.compiler.set_stance("fail_on_recompile"):
        assert tokens(llm.generate(prompts((9,)), GREEDY, use_tqdm=False)) == [
            hf_greedy(model, prompts((9,))[0], 12)[0]
        ]
        again = prompts((5, 21, 90, 40, 3), seed=3)
        references = [hf_greedy(model, p, 12)[0] for p in again]
        assert tokens(llm.generate(again, GREEDY, use_tqdm=False)) == references
    assert unique_graphs() == graphs


@pytest.mark.slow
def test_the_compile_setting_runs_inductors_code_and_gives_eager_tokens_or_a_tie(patched):
    """compile=True: inductor's kernels for the forward (may sum in another order than eager: greedy tokens
    equal transformers', or its top-2 logits tie within 1e-4)."""
    model = FAMILIES["llama"]()
    batch = prompts((7, 33))
    references = [hf_greedy(model, p, 8) for p in batch]
    llm = patched(model, block_size=8, max_model_len=256, compile=True)
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for output, (expected, logits) in zip(outputs, references, strict=True):
        got = output.outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
        if first is not None:
            top2 = logits[first].topk(2).values
            assert (top2[0] - top2[1]).abs().item() < 1e-4, f"token {first}: {got} vs {expected}"


def test_step_buffers_keep_their_addresses_across_steps(patched):
    model = FAMILIES["gemma3_text"]()
    llm = patched(model, block_size=8, max_model_len=256, max_num_batched_tokens=32, enforce_eager=False)
    buffers = llm.core.runner.buffers[torch.device("cpu")]
    tensors = [buffers.input_ids, buffers.positions, buffers.logits_rows, buffers.cu_seqlens_q, buffers.seq_lens]
    tensors += [*buffers.tables.values(), *buffers.slots.values()]
    addresses = [t.device.data_ptr() for t in tensors]
    seen = set()
    for prompt in prompts((7, 33, 70)):
        llm.add_request(new_request_id(), prompt, GREEDY)
    while llm.has_unfinished_requests():
        llm.step()
        metadata = llm.core.runner.context.metadata
        seen.add(metadata[0].block_table.data_ptr())
        assert [t.device.data_ptr() for t in tensors] == addresses
    assert seen == {buffers.tables[8].device.data_ptr()}  # every group-0 table a view at the buffer's start


def test_a_decode_step_is_padded_to_its_bucket_and_the_padded_rows_write_nothing(patched):
    model = FAMILIES["gemma3_text"]()
    llm = patched(model, block_size=8, max_model_len=256, enforce_eager=False)
    for prompt in prompts((7, 33, 70)):
        llm.add_request(new_request_id(), prompt, SamplingParams(temperature=0, max_tokens=4))
    llm.step()  # the three prompts
    pages = {device: pages.clone() for device, pages in llm.core.runner._pages.items()}
    held = {b for m in llm.core.coordinator.managers for row in m.req_to_block_ids.values() for b in row}
    plan = llm.core.scheduler.schedule()
    prepared = llm.core.runner.prepare(llm.core.runner.step_inputs(plan))
    assert prepared.bucket == 4 and prepared.num_tokens == 4  # 3 decode rows padded to 4
    step = prepared.metadata[0].step
    assert step.seq_lens_list[3] == 1 and step.query_lens_list[3] == 1
    assert all(m.slot_mapping[3].item() == -1 for m in prepared.metadata)  # the padded row stores nothing
    logits = llm.core.runner.forward(prepared)
    assert logits.shape[0] == 3  # only the sampled rows come back
    for device, before in pages.items():
        changed = (llm.core.runner._pages[device] != before).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) <= held - {0}  # only blocks the three requests hold; never the null block
    llm.core.scheduler.update(plan, logits.argmax(-1).tolist())


@pytest.mark.parametrize("name", slow_except(sorted(ZOO)))
def test_graph_mode_gives_eager_modes_tokens(name, patched):
    """Static buffers and padded decode buckets (what a GPU captures) change no token, with chunked prefill,
    prefix-cache hits and a pool small enough to preempt, by recompute and by swap."""
    model = ZOO[name]()
    batch = prompts((7, 33, 70, 150))
    settings = dict(block_size=8, max_model_len=256, max_num_batched_tokens=32)
    eager = tokens(patched(model, **settings, enforce_eager=True).generate(batch, GREEDY, use_tqdm=False))
    llm = patched(model, **settings, enforce_eager=False)
    assert tokens(llm.generate(batch, GREEDY, use_tqdm=False)) == eager
    assert tokens(llm.generate(batch, GREEDY, use_tqdm=False)) == eager  # prefix-cache hits
    assert llm.stats()["prefix_cache_hits"] > 0  # state-layer models too: their hits restore state checkpoints
    tight = hybridkv.min_num_blocks(model, **settings) + 2
    llm = patched(model, **settings, num_blocks=tight, enforce_eager=False)
    assert tokens(llm.generate(batch, GREEDY, use_tqdm=False)) == eager
    assert llm.stats()["num_preemptions"] > 0
    # Room for 64 blocks, and for 4 requests' states in the half of it that states may take (state layers).
    swap_bytes = 64 * llm.bytes_per_block + 8 * llm.stats().get("state_bytes_per_request", 0)
    swap = dict(num_blocks=tight, preemption_mode="swap", swap_space=swap_bytes / (1 << 30))
    llm = patched(model, **settings, **swap, enforce_eager=False)
    assert tokens(llm.generate(batch, GREEDY, use_tqdm=False)) == eager
    assert llm.stats()["num_swaps"] > 0


@pytest.mark.parametrize("name", slow_except(sorted(ZOO)))
def test_graph_mode_forks_samples_and_searches_beams_like_eager_mode(name, patched):
    model = ZOO[name]()
    batch = prompts((9, 40))
    runs = []
    for eager in (True, False):
        llm = patched(model, block_size=8, max_model_len=256, enforce_eager=eager)
        forks = llm.generate(batch, SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=6), use_tqdm=False)
        beams = llm.beam_search(batch, hybridkv.BeamSearchParams(beam_width=3, max_tokens=6))
        runs.append(
            (
                [[c.token_ids for c in o.outputs] for o in forks],
                [[(s.tokens, s.cum_logprob) for s in b.sequences] for b in beams],
            )
        )
    (eager_forks, eager_beams), (graph_forks, graph_beams) = runs
    assert eager_forks == graph_forks
    # The same beams; their scores within float noise (a padded decode step's rows may round differently).
    assert [[s for s, _ in b] for b in eager_beams] == [[s for s, _ in b] for b in graph_beams]
    scores = [[score for beams in run for _, score in beams] for run in (eager_beams, graph_beams)]
    assert scores[0] == pytest.approx(scores[1], abs=1e-3)


@pytest.mark.parametrize("native", [True, False], ids=["c-fill", "numpy-fill"])
def test_buffer_metadata_equals_the_built_metadata(native):
    """StepBuffers (the engine's per-step metadata, written in place) against StepMetadata.build/for_groups
    (fresh tensors, direct callers), on a mixed step with null and moved (-id) entries; the slot mapping and
    table rows written by step_fill.c and by numpy."""
    query_lens, seq_lens = [1, 5, 1, 3], [17, 12, 40, 3]
    block_size = 8
    tables = [
        [[1, 2, 3], [4, 5], [0, 0, -6, 7, 8], [9]],
        [[10, 11, 12], [13, 0], [0, 0, 0, 14, 15], [-16]],
    ]
    built = StepMetadata.build(query_lens, seq_lens).for_groups(tables, block_size)
    buffers = StepBuffers(torch.device("cpu"), "torch", 8, 32, {block_size: (2, 8)})
    assert buffers.fill is not None, "step_fill.c did not build (a C compiler is on this machine)"
    if not native:
        buffers.fill = None
    width = max(len(row) for group in tables for row in group)
    dense = np.zeros((2, 4, width), dtype=np.int32)
    for g, group in enumerate(tables):
        for s, row in enumerate(group):
            dense[g, s, : len(row)] = row
    q, k = np.array(query_lens), np.array(seq_lens)
    positions = np.concatenate([np.arange(n - m, n) for m, n in zip(q, k, strict=True)])
    written = buffers.step(q, k, positions, {block_size: dense}, np.arange(4))[block_size]
    for got, expected in zip(written, built, strict=True):
        assert torch.equal(got.slot_mapping, expected.slot_mapping)
        assert torch.equal(got.block_table[:, : expected.block_table.shape[1]], expected.block_table)
        assert torch.equal(got.step.cu_seqlens_q, expected.step.cu_seqlens_q)
        assert torch.equal(got.step.seq_lens, expected.step.seq_lens)
    for block_q in (1, 2, 16):
        buffered = written[0].step.triton_tiles(block_q)
        fresh = StepMetadata.build(query_lens, seq_lens).triton_tiles(block_q)
        assert torch.equal(buffered.seq_ids, fresh.seq_ids) and torch.equal(buffered.starts, fresh.starts)


@pytest.mark.parametrize("native", [True, False], ids=["c-fill", "numpy-fill"])
def test_a_row_outside_the_tables_raises(native):
    """A sequence whose table row lies outside the persistent batch's tables fails the step (IndexError) on both
    paths, before anything runs: the C loop checks its rows rather than read past the tables."""
    buffers = StepBuffers(torch.device("cpu"), "torch", 4, 16, {8: (2, 4)})
    if not native:
        buffers.fill = None
    tables = {8: np.ones((2, 3, 4), dtype=np.int32)}
    ones = np.ones(2, dtype=np.int64)
    with pytest.raises(IndexError):
        buffers.step(ones, np.array([5, 9]), np.array([4, 8]), tables, np.array([0, 3]))


@pytest.mark.parametrize("called", ["extension", "ctypes"])
def test_c_fill_writes_what_numpy_writes_on_random_steps(called):
    """step_fill.c (called as the extension module's function, or through ctypes where Python's headers are missing)
    against the numpy path, byte for byte in the buffers they write, over random persistent tables (null, real and
    moved entries), rows in any order, padding rows, decode and mixed steps, two block sizes; the tables are new
    arrays every ten steps, with more rows at times (the persistent batch grows), and the C fill reads the new ones
    (it keeps each array's address and shape)."""
    rng = np.random.default_rng(0)
    shapes = {8: (3, 40), 32: (1, 10)}
    native = StepBuffers(torch.device("cpu"), "torch", 16, 256, shapes)
    numpy_only = StepBuffers(torch.device("cpu"), "torch", 16, 256, shapes)
    assert native.fill is _NATIVE.get().step_fill
    if called == "ctypes":
        native.fill = _FILL.get()
        assert native.fill is not None
    numpy_only.fill = None
    for step in range(40):
        if step % 10 == 0:
            num_rows = int(rng.choice([21, 42]))
            tables = {
                size: rng.integers(-50, 60, size=(groups, num_rows, width), dtype=np.int32)
                for size, (groups, width) in shapes.items()
            }
        num_seqs = int(rng.integers(1, 17))
        seq_lens = rng.integers(1, 321, size=num_seqs)
        query_lens = np.ones(num_seqs, dtype=np.int64) if rng.random() < 0.5 else rng.integers(1, seq_lens + 1)
        query_lens = np.minimum(query_lens, max(1, 256 // num_seqs))
        positions = np.concatenate([np.arange(n - m, n) for m, n in zip(query_lens, seq_lens, strict=True)])
        rows = rng.permutation(num_rows)[:num_seqs].astype(np.int64)
        for buffers in (native, numpy_only):
            buffers.step(query_lens, seq_lens, positions, tables, rows)
        for size, (groups, _) in shapes.items():
            width = -(-int(seq_lens.max()) // size)
            np.testing.assert_array_equal(
                native.slots[size].host[:groups, : len(positions)],
                numpy_only.slots[size].host[:groups, : len(positions)],
            )
            np.testing.assert_array_equal(
                native.tables[size].host[:groups, :num_seqs, :width],
                numpy_only.tables[size].host[:groups, :num_seqs, :width],
            )


@pytest.mark.parametrize("c_inputs", [True, False], ids=["c-inputs", "array-inputs"])
@pytest.mark.parametrize("table_dtype", [np.int32, np.int64], ids=["c-fill", "numpy-fill"])
def test_decode_step_writes_what_fill_inputs_and_step_write(table_dtype, c_inputs):
    """StepBuffers.decode_step (a decode step from its Python lists: read by one C call, or as arrays assigned to
    the buffers' flat views; then the C fill, or numpy for tables the C loop does not take) against fill_inputs +
    step, byte for byte in every buffer a decode step writes and in its metadata, over random decode steps with
    rows in any order and two block sizes."""
    rng = np.random.default_rng(1)
    shapes = {8: (3, 40), 32: (1, 10)}
    lists, arrays = (StepBuffers(torch.device("cpu"), "torch", 16, 64, shapes) for _ in range(2))
    assert lists.fill is not None and lists.decode_inputs is not None  # the extension module builds here
    if not c_inputs:
        lists.decode_inputs = None
    row_of = {f"request {row}": row for row in rng.permutation(21).tolist()}
    tables = {
        size: rng.integers(-50, 60, size=(groups, 21, width)).astype(table_dtype)
        for size, (groups, width) in shapes.items()
    }
    for _ in range(30):
        num_seqs = int(rng.integers(1, 17))
        seq_lens = rng.integers(1, 321, size=num_seqs)
        rows = rng.permutation(21)[:num_seqs]
        input_ids = rng.integers(0, 1000, size=num_seqs)
        logits_rows = np.sort(rng.choice(num_seqs, size=int(rng.integers(1, num_seqs + 1)), replace=False))
        request_ids = [f"request {row}" for row in rows.tolist()]
        by_lists = lists.decode_step(
            input_ids.tolist(), seq_lens.tolist(), request_ids, row_of, logits_rows.tolist(), tables
        )
        arrays.fill_inputs(input_ids, seq_lens - 1, logits_rows)
        by_arrays = arrays.step(np.ones(num_seqs, dtype=np.int64), seq_lens, seq_lens - 1, tables, rows)
        for name in ("input_ids", "positions", "seq_lens"):
            np.testing.assert_array_equal(getattr(lists, name).host[:num_seqs], getattr(arrays, name).host[:num_seqs])
        np.testing.assert_array_equal(lists.logits_rows.host[: len(logits_rows)], logits_rows)
        np.testing.assert_array_equal(lists.cu_seqlens_q.host[: num_seqs + 1], np.arange(num_seqs + 1))
        for size, (groups, _) in shapes.items():
            width = -(-int(seq_lens.max()) // size)
            np.testing.assert_array_equal(
                lists.slots[size].host[:groups, :num_seqs], arrays.slots[size].host[:groups, :num_seqs]
            )
            np.testing.assert_array_equal(
                lists.tables[size].host[:groups, :num_seqs, :width],
                arrays.tables[size].host[:groups, :num_seqs, :width],
            )
            for got, expected in zip(by_lists[size], by_arrays[size], strict=True):
                assert got.step.query_lens_list == expected.step.query_lens_list == [1] * num_seqs
                assert got.step.seq_lens_list == expected.step.seq_lens_list == seq_lens.tolist()
                assert got.step.num_query_tokens == num_seqs
                assert got.block_table.shape == expected.block_table.shape
                assert got.slot_mapping.shape == expected.slot_mapping.shape


def test_decode_step_leaves_what_it_cannot_write_to_step():
    """decode_step returns None, writing nothing, without the C fill or for a step larger than the buffers (the
    runner then calls fill_inputs and step, which raise for a step too large); a row outside the tables raises."""
    buffers = StepBuffers(torch.device("cpu"), "torch", 4, 16, {8: (2, 4)})
    tables = {8: np.ones((2, 3, 4), dtype=np.int32)}
    row_of = {"a": 0, "b": 3}
    assert buffers.decode_step([1] * 5, [9] * 5, ["a"] * 5, row_of, [0], tables) is None  # 5 sequences, 4 rows
    with pytest.raises(IndexError):
        buffers.decode_step([1, 2], [5, 9], ["a", "b"], row_of, [0, 1], tables)
    buffers.fill = None
    assert buffers.decode_step([7], [5], ["a"], row_of, [0], tables) is None
    assert buffers.input_ids.host[0] != 7


@pytest.mark.parametrize("c_inputs", [True, False], ids=["c-inputs", "array-inputs"])
def test_decode_step_refuses_lists_that_do_not_make_a_decode_step(c_inputs):
    """Lists of other lengths, a request without a row of the persistent batch and a value that is not an int are
    refused with the error that names them, by the C call and by the arrays alike; the C call also refuses a
    sequence of no tokens and lists of another type (the runner's are lists)."""
    buffers = StepBuffers(torch.device("cpu"), "torch", 4, 16, {8: (2, 4)})
    if not c_inputs:
        buffers.decode_inputs = None
    tables = {8: np.ones((2, 4, 4), dtype=np.int32)}
    row_of = {"a": 0, "b": 3}
    with pytest.raises(ValueError, match="2 sequences"):
        buffers.decode_step([1], [5, 9], ["a", "b"], row_of, [0, 1], tables)
    with pytest.raises(ValueError, match="2 sequences"):
        buffers.decode_step([1, 2], [5, 9], ["a"], row_of, [0, 1], tables)
    with pytest.raises(KeyError, match="'c'"):
        buffers.decode_step([1, 2], [5, 9], ["a", "c"], row_of, [0, 1], tables)
    with pytest.raises(TypeError):
        buffers.decode_step([1, "2"], [5, 9], ["a", "b"], row_of, [0, 1], tables)
    with pytest.raises(TypeError):
        buffers.decode_step([1, 2], [5, 9], ["a", "b"], row_of, [0, None], tables)
    if c_inputs:
        with pytest.raises(ValueError, match="holds 0 tokens"):
            buffers.decode_step([1, 2], [5, 0], ["a", "b"], row_of, [0, 1], tables)
        with pytest.raises(TypeError, match="must be a list"):
            buffers.decode_step((1, 2), [5, 9], ["a", "b"], row_of, [0, 1], tables)

        class Shrinking:  # an int-like item that empties its list while it is read: an error, never a crash
            def __index__(self) -> int:
                ids.clear()
                return 1

        ids = [Shrinking(), 2]
        with pytest.raises(IndexError):
            buffers.decode_step(ids, [5, 9], ["a", "b"], row_of, [0, 1], tables)
    by_size = buffers.decode_step([1, 2], [5, 9], ["a", "b"], row_of, [0, 1], tables)  # and then it runs
    assert by_size[8][0].step.seq_lens_list == [5, 9]
    np.testing.assert_array_equal(buffers.input_ids.host[:2], [1, 2])


def test_the_engine_writes_its_decode_steps_without_numpy_and_gets_the_same_tokens(patched, monkeypatch):
    """An engine's decode steps go through StepBuffers.decode_step (the C fill built, one device, no graph buckets)
    and give the tokens, and the model's own greedy tokens, that fill_inputs + step give."""
    model = FAMILIES["gemma3_text"]()
    batch = prompts((9, 30, 17, 4))
    written = []
    decode_step = StepBuffers.decode_step

    def counted(self, *args):
        by_size = decode_step(self, *args)
        written.append(by_size is not None)
        return by_size

    monkeypatch.setattr(StepBuffers, "decode_step", counted)
    runs = []
    for plain in (True, False):
        llm = patched(model, block_size=8, max_model_len=128)
        assert llm.core.runner._plain_decode
        llm.core.runner._plain_decode = plain
        runs.append(tokens(llm.generate(batch, GREEDY, use_tqdm=False)))
        hybridkv.unpatch(model)
        if plain:
            assert written and all(written)  # every decode step took the list path
            written.clear()
    assert not written  # and none with it switched off
    assert runs[0] == runs[1] == [hf_greedy(model, p, GREEDY.max_tokens)[0] for p in batch]


@pytest.mark.slow
def test_without_python_headers_the_fill_goes_through_ctypes_and_the_inputs_through_arrays(tmp_path):
    """Where the extension module does not build (here: Python's headers not found), the step buffers call the C
    fill through ctypes and write a decode step's inputs as arrays, and a decode step still writes its buffers."""
    script = textwrap.dedent(
        """
        import sysconfig
        found = sysconfig.get_paths
        sysconfig.get_paths = lambda *args, **kwargs: {**found(*args, **kwargs), "include": "/no/python/headers"}
        import numpy as np, torch
        from hybridkv.kernels import step_buffers
        buffers = step_buffers.StepBuffers(torch.device("cpu"), "torch", 4, 16, {8: (2, 4)})
        tables = {8: np.arange(32, dtype=np.int32).reshape(2, 4, 4)}
        buffers.decode_step([7, 8], [5, 9], ["a", "b"], {"a": 1, "b": 3}, [0, 1], tables)
        print(type(buffers.fill).__name__, buffers.decode_inputs, "Python.h" in step_buffers._NATIVE.failure)
        print(buffers.input_ids.host[:2].tolist(), buffers.slots[8].host[0, :2].tolist())
        """
    )
    env = {**os.environ, "HYBRIDKV_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    # Slots: row 1's entry 4 at position 4 (4 * 8 + 4), row 3's entry 13 at position 8 (13 * 8 + 0).
    assert result.stdout.split("\n")[:2] == ["_FuncPtr None True", "[7, 8] [36, 104]"]
