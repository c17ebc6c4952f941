"""Window-only sliding groups in the engine: long prompts, prefilled in chunks of any size, hold only their
windows in sliding groups, so a pool sized for N requests runs N at once; the output stays
transformers' own, with the torch path and the Triton kernels, with KV-sharing layers, and with the
prefix cache on (which keeps old windows and chunk middles only in blocks the pool has to spare)."""

from __future__ import annotations

import pytest

from hybridkv import SamplingParams
from hybridkv.memory.coordinator import blocks_for_request
from hybridkv.memory.integrity import check_coordinator
from hybridkv.memory.window_managers import WindowedManager

from greedy_reference import assert_same_greedy, family
from tiny_models import hf_greedy, new_request_id, prompts

MAX_NEW = 8
SETTINGS = dict(block_size=8, max_model_len=256)


def run_stepwise(llm, batch):
    """Generate step by step, checking the memory manager after every step; returns the outputs and the
    most blocks in use (pool-wide) and running requests seen."""
    ids = [
        llm.add_request(new_request_id(), prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW)) for prompt in batch
    ]
    done, peak_blocks = {}, 0
    while llm.has_unfinished_requests():
        for output in llm.step():
            done[output.request_id] = output
        running = {r.request_id: r for r in llm.core.scheduler.running}
        check_coordinator(llm.core.coordinator, running)
        peak_blocks = max(peak_blocks, llm.stats()["blocks_in_use"])
    return [done[i] for i in ids], peak_blocks


@pytest.mark.fast_if(lambda name, chunk, **_: chunk == 8 or name == "gemma3_text")  # each chunk size on one family
@pytest.mark.parametrize("name", ["gemma3_text", "cohere2", "gemma3n_text", "llama4_text"])
@pytest.mark.parametrize("chunk", [8, 40, 256])
def test_a_pool_sized_for_three_windows_runs_three_long_prompts_at_once_at_any_chunk_size(name, chunk, patched):
    model, _, _ = family(name)
    batch = prompts((150, 140, 130), seed=5)
    references = [hf_greedy(model, prompt, MAX_NEW) for prompt in batch]
    probe = patched(model, **SETTINGS)
    per_request = blocks_for_request(probe.kv_config, 150 + MAX_NEW)
    num_blocks = 1 + 3 * per_request
    # Each request's chunk is `chunk` tokens, and the step's budget holds the three chunks.
    chunks = dict(max_num_batched_tokens=3 * chunk, long_prefill_token_threshold=chunk)
    llm = patched(model, **SETTINGS, num_blocks=num_blocks, **chunks, enable_prefix_caching=False)
    outputs, peak_blocks = run_stepwise(llm, batch)
    assert_same_greedy(outputs, references)
    stats = llm.stats()
    assert (stats["max_num_running"], stats["num_preemptions"]) == (3, 0)
    assert peak_blocks <= num_blocks - 1


def test_sliding_groups_hold_no_more_than_their_window_while_a_chunk_is_computed(patched):
    model, _, _ = family("gemma3_text")
    llm = patched(model, **SETTINGS, max_num_batched_tokens=128, enable_prefix_caching=False)
    llm.add_request(new_request_id(), prompts((250,), seed=6)[0], SamplingParams(temperature=0, max_tokens=2))
    plan = llm.core.scheduler.schedule()  # the first 128 tokens in one chunk
    windowed = [m for m in llm.core.coordinator.managers if isinstance(m, WindowedManager)]
    request_id = plan.scheduled[0].request.request_id
    # W = 16: the query at 128 reads keys from 113 on, blocks 14 and 15 of 8 tokens; 0..13 are in flight only.
    assert all(m.block_table(request_id) == [0] * 14 + m.block_table(request_id)[14:] for m in windowed)
    assert all(m.num_real_blocks(request_id) == 2 for m in windowed)
    llm.core.runner.execute(plan)
    llm.core.scheduler.update(plan, [])
    # 128..249: the query at 250 reads from 235 on, blocks 29..31. Blocks 14 and 15 are read by the
    # chunk's first queries, then move to two of those positions; the third takes a fresh block.
    plan = llm.core.scheduler.schedule()
    table = windowed[0].block_table(request_id)
    assert table[14] < 0 and table[15] < 0 and {-table[14], -table[15]} < set(table[29:])
    assert table[16:29] == [0] * 13
    assert all(m.num_real_blocks(request_id) == 3 for m in windowed)  # ceil((16 - 1) / 8) + 1


@pytest.mark.slow
def test_the_triton_kernels_read_in_flight_and_store_after_as_the_torch_path_does(patched):
    model, _, _ = family("gemma3_text")
    batch = prompts((60, 45), seed=7)
    references = [hf_greedy(model, prompt, 4) for prompt in batch]
    llm = patched(model, **SETTINGS, max_num_batched_tokens=24, enable_prefix_caching=False, attention_backend="triton")
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert_same_greedy(outputs, references)


def test_a_shared_prefix_ending_inside_a_chunk_hits_in_full_when_the_pool_has_room(patched):
    """The first request computes 100 shared + 20 own tokens in one chunk; the second hits all 96 block-
    aligned shared tokens: its sliding windows before 96 were stored, from free blocks, in the middle of the
    first request's chunk, and stayed hashed."""
    model, _, _ = family("gemma3_text")
    first, second = prompts((20, 30), seed=8, shared_prefix=100)
    llm = patched(model, **SETTINGS, max_num_batched_tokens=256)
    references = [hf_greedy(model, prompt, MAX_NEW) for prompt in (first, second)]
    outputs = [llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]
               for prompt in (first, second)]  # fmt: skip
    assert_same_greedy(outputs, references)
    assert outputs[1].metrics.num_cached_tokens == 96
    assert llm.stats()["prefix_cache_hits"] == 96


def test_prompts_sharing_a_prefix_sent_together_hit_it_once_it_is_computed(patched):
    """Three prompts fill the first step's budget; the other three, admitted next step, hit the 96 shared
    block-aligned tokens (the same hits as before sliding groups held windows only)."""
    model, _, _ = family("gemma3_text")
    batch = prompts((20, 30, 12, 25, 40, 9), seed=9, shared_prefix=100)
    llm = patched(model, **SETTINGS, max_num_batched_tokens=256)
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    assert [o.metrics.num_cached_tokens for o in outputs] == [0, 0, 0, 96, 96, 96]
    assert_same_greedy(outputs, [hf_greedy(model, prompt, MAX_NEW) for prompt in batch])


def test_caching_never_costs_concurrency(patched):
    model, _, _ = family("gemma3_text")
    batch = prompts((150, 140, 130), seed=5, shared_prefix=0)
    chunks = dict(max_num_batched_tokens=192, long_prefill_token_threshold=64)
    llm = patched(model, **SETTINGS, **chunks)
    per_request = blocks_for_request(llm.kv_config, 150 + MAX_NEW)
    llm = patched(model, **SETTINGS, num_blocks=1 + 3 * per_request, **chunks)
    outputs, _ = run_stepwise(llm, batch)
    assert_same_greedy(outputs, [hf_greedy(model, prompt, MAX_NEW) for prompt in batch])
    assert (llm.stats()["max_num_running"], llm.stats()["num_preemptions"]) == (3, 0)
