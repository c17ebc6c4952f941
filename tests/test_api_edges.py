"""The API's edges: bad input is a clear error that queues nothing, a stream or a call that ends early
leaves nothing behind, and after every case the engine serves a normal request exactly with no block
in use."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

import hybridkv
from hybridkv import SamplingParams
from hybridkv.sampling.sampler import SamplingRow, sample, sample_each
from hybridkv.tiny import tiny_model

from tiny_models import VOCAB, hf_greedy, new_request_id, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def gemma3():
    model = tiny_model("gemma3")
    batch = prompts((9, 30, 41))
    return model, batch, [hf_greedy(model, p, 8)[0] for p in batch]


def serves_exactly(llm, gemma3):
    """Nothing left over, and a normal greedy request gives the model's own tokens."""
    _, batch, expected = gemma3
    assert not llm.has_unfinished_requests()
    assert llm.stats()["blocks_in_use"] == 0
    (output,) = llm.generate([batch[0]], GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == expected[0]
    assert llm.stats()["blocks_in_use"] == 0
    return True


def test_logprobs_beyond_the_vocabulary_is_refused_at_add_request(gemma3, patched):
    model, batch, _ = gemma3
    llm = patched(model, max_model_len=128)
    with pytest.raises(ValueError, match=f"logprobs={VOCAB + 1} asks for more tokens than the vocabulary"):
        llm.add_request(new_request_id(), batch[0], SamplingParams(logprobs=VOCAB + 1))
    assert serves_exactly(llm, gemma3)


def test_a_row_whose_sampling_fails_fails_alone_and_the_others_get_their_tokens():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=1.0, seed=3)
    rows = [
        SamplingRow(seeded, torch.Generator().manual_seed(3), [1, 2], 2),
        # Unchecked params (built around SamplingParams' checks) that make topk fail for this row only.
        SamplingRow(SamplingParams(temperature=0, logprobs=VOCAB + 5), None, [1], 1),
        SamplingRow(SamplingParams(temperature=0), None, [1], 1),
    ]
    tokens, _, errors = sample_each(logits, rows)
    assert tokens[1] is None and "out of range" in str(errors[1]) and errors[0] is None and errors[2] is None
    # The seeded row draws what it draws alone from a fresh generator: the failed batch attempt was rewound.
    fresh = SamplingRow(seeded, torch.Generator().manual_seed(3), [1, 2], 2)
    assert tokens[0] == sample(logits[0:1], [fresh])[0][0]
    assert tokens[2] == sample(logits[2:3], [rows[2]])[0][0]


def test_a_bad_prompt_in_generate_queues_nothing(gemma3, patched):
    model, batch, _ = gemma3
    llm = patched(model, max_model_len=128)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([batch[0], [1, VOCAB + 3], batch[1]], GREEDY, use_tqdm=False)
    assert serves_exactly(llm, gemma3)


def test_a_request_id_that_is_not_a_string_is_refused_at_once(gemma3, patched):
    model, batch, _ = gemma3
    llm = patched(model, max_model_len=128)
    with pytest.raises(TypeError, match=r"vLLM's order: request_id must be a str, got int 5"):
        llm.add_request(5, batch[0], GREEDY)
    assert serves_exactly(llm, gemma3)


def test_closing_breaking_out_of_or_dropping_a_stream_aborts_its_request(gemma3, patched):
    model, batch, _ = gemma3
    llm = patched(model, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=20)
    stream = llm.stream(batch[1], params)
    assert stream.request_id in llm.outputs.states
    next(stream)
    stream.close()
    assert serves_exactly(llm, gemma3)
    for _ in llm.stream(batch[1], params):
        break
    gc.collect()
    assert serves_exactly(llm, gemma3)
    with llm.stream(batch[2], params) as stream:
        next(stream)
    assert serves_exactly(llm, gemma3)
    llm.stream(batch[2], params)  # never iterated, dropped at once
    gc.collect()
    assert serves_exactly(llm, gemma3)


def test_aborting_a_streamed_request_ends_its_stream_with_abort(gemma3, patched):
    model, batch, _ = gemma3
    llm = patched(model, max_model_len=128)
    stream = llm.stream(batch[1], SamplingParams(temperature=0, max_tokens=20))
    first = next(stream)
    llm.abort(stream.request_id)
    rest = list(stream)
    assert first.finish_reason is None and rest[-1].finish_reason == "abort"
    assert serves_exactly(llm, gemma3)


def test_a_second_thread_gets_a_clear_error_instead_of_corrupting_the_engine(gemma3, patched, monkeypatch):
    model, batch, expected = gemma3
    llm = patched(model, max_model_len=128)
    inside, release = threading.Event(), threading.Event()
    execute = llm.core.runner.execute

    def slow(*args, **kwargs):
        inside.set()
        release.wait(30)
        return execute(*args, **kwargs)

    monkeypatch.setattr(llm.core.runner, "execute", slow)
    results = []
    worker = threading.Thread(target=lambda: results.append(llm.generate(batch, GREEDY, use_tqdm=False)))
    worker.start()
    assert inside.wait(30)
    for call in (lambda: llm.generate(batch[:1], GREEDY, use_tqdm=False), llm.step, lambda: llm.abort("0")):
        with pytest.raises(RuntimeError, match="in use by another thread"):
            call()
    release.set()
    worker.join(60)
    assert [o.outputs[0].token_ids for o in results[0]] == expected
    monkeypatch.undo()
    assert serves_exactly(llm, gemma3)


def test_a_closed_engine_refuses_every_call(gemma3):
    model, batch, _ = gemma3
    llm = hybridkv.patch(model, max_model_len=128)
    request_id = llm.add_request(new_request_id(), batch[0], GREEDY)
    hybridkv.unpatch(model)
    for call in (llm.step, lambda: llm.abort(request_id), llm.abort_all, lambda: llm.stream(batch[0])):
        with pytest.raises(RuntimeError, match=r"closed by hybridkv.unpatch\(model\); call hybridkv.patch"):
            call()


def test_two_models_built_from_one_config_object_are_patched_and_unpatched_independently(gemma3):
    base, batch, expected = gemma3
    first, second = (type(base)(base.config).eval() for _ in range(2))
    for copy in (first, second):
        copy.load_state_dict(base.state_dict())
    original = base.config._attn_implementation
    ids = torch.tensor([batch[0]])
    with torch.inference_mode():
        reference = base(ids).logits
    llm_first = hybridkv.patch(first, max_model_len=128)
    llm_second = hybridkv.patch(second, max_model_len=128)
    try:
        with torch.inference_mode():
            assert torch.allclose(first(ids).logits, reference, atol=1e-5)  # no recursion into hybridkv
        hybridkv.unpatch(first)
        with torch.inference_mode():
            assert torch.allclose(first(ids).logits, reference, atol=1e-5)
        assert llm_second.generate([batch[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected[0]
        assert llm_first is not llm_second
    finally:
        hybridkv.unpatch(first)
        hybridkv.unpatch(second)
    assert base.config._attn_implementation == original


def test_prompts_as_tensors_arrays_and_batches(gemma3, patched):
    model, batch, expected = gemma3
    llm = patched(model, max_model_len=128)

    def tokens(outputs):
        return [o.outputs[0].token_ids for o in outputs]

    same_length = [batch[1][:30], batch[2][:30]]
    reference = tokens(llm.generate(same_length, GREEDY, use_tqdm=False))
    assert tokens(llm.generate(torch.tensor(batch[0]), GREEDY, use_tqdm=False)) == expected[:1]
    assert tokens(llm.generate(np.array(batch[0]), GREEDY, use_tqdm=False)) == expected[:1]
    assert tokens(llm.generate(torch.tensor([batch[0]]), GREEDY, use_tqdm=False)) == expected[:1]
    assert tokens(llm.generate(torch.tensor(same_length), GREEDY, use_tqdm=False)) == reference
    assert tokens(llm.generate([np.array(p) for p in same_length], GREEDY, use_tqdm=False)) == reference
    request_id = llm.add_request(new_request_id(), torch.tensor([batch[0]]), GREEDY)
    done = {}
    while llm.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    assert done[request_id].outputs[0].token_ids == expected[0]
    assert serves_exactly(llm, gemma3)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (None, "a prompt is a string, a list of token ids"),
        ([1, [2, 3]], "token ids must be integers, got \\[2, 3\\]"),
        ([1, "x"], "token ids must be integers, got 'x'"),
        ([1, 2.0], "token ids must be integers, got 2.0"),
        ([True, 2], "token ids must be integers, got True"),
        (torch.ones(2, 2, 2, dtype=torch.long), "must be 1-D or \\[1, N\\]"),
    ],
)
def test_malformed_prompts_are_clear_type_errors(gemma3, patched, prompt, message):
    model, _, _ = gemma3
    llm = patched(model, max_model_len=128)
    with pytest.raises(TypeError, match=message):
        llm.add_request(new_request_id(), prompt, GREEDY)
    assert serves_exactly(llm, gemma3)


def test_ctrl_c_inside_generate_aborts_what_it_queued(gemma3, patched, monkeypatch):
    model, batch, _ = gemma3
    llm = patched(model, max_model_len=128, max_num_batched_tokens=16)
    execute = llm.core.runner.execute
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return execute(*args, **kwargs)

    monkeypatch.setattr(llm.core.runner, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(batch, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert serves_exactly(llm, gemma3)


def test_an_interrupted_step_fails_its_requests_and_abort_all_clears_the_rest(gemma3, patched, monkeypatch):
    model, batch, _ = gemma3
    llm = patched(model, max_model_len=128, max_num_seqs=1)
    ids = [llm.add_request(new_request_id(), p, GREEDY) for p in batch]
    llm.step()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.core.runner, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    monkeypatch.undo()
    (failed,) = [o for o in llm.step() if o.finished]
    assert failed.request_id == ids[0] and "interrupted (KeyboardInterrupt)" in failed.error
    aborted = llm.abort_all()
    assert sorted(o.request_id for o in aborted) == ids[1:]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in aborted)
    assert serves_exactly(llm, gemma3)


def test_a_streamed_request_that_fails_reports_its_error_in_the_last_delta(gemma3, patched, monkeypatch):
    model, batch, _ = gemma3
    llm = patched(model, max_model_len=128)

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(llm.core.runner, "execute", broken)
    deltas = list(llm.stream(batch[0], GREEDY))
    monkeypatch.undo()
    assert deltas[-1].finish_reason == "error" and "injected fault" in deltas[-1].error
    assert serves_exactly(llm, gemma3)


def test_patching_again_with_other_settings_refuses_to_drop_unfinished_requests(gemma3, patched):
    model, batch, _ = gemma3
    llm = patched(model, max_model_len=128)
    llm.add_request(new_request_id(), batch[0], GREEDY)
    with pytest.raises(RuntimeError, match=r"1 unfinished requests.*abort_all\(\)"):
        hybridkv.patch(model, max_model_len=96)
    llm.abort_all()
    assert serves_exactly(llm, gemma3)
    assert patched(model, max_model_len=96) is not llm


def test_a_stream_closed_during_an_engine_call_is_aborted_when_the_next_call_begins(gemma3, patched, monkeypatch):
    model, batch, expected = gemma3
    llm = patched(model, max_model_len=128)
    stream = llm.stream(batch[1], SamplingParams(temperature=0, max_tokens=20))
    next(stream)
    other = llm.add_request(new_request_id(), batch[0], GREEDY)
    execute = llm.core.runner.execute

    def collecting(*args, **kwargs):
        stream.close()  # as the garbage collector may, in the middle of a step
        return execute(*args, **kwargs)

    monkeypatch.setattr(llm.core.runner, "execute", collecting)
    llm.step()
    monkeypatch.undo()
    assert stream.request_id in llm.outputs.states  # never aborted mid-step
    done = {}
    while llm.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    assert stream.request_id not in done and done[other].outputs[0].token_ids == expected[0]
    assert serves_exactly(llm, gemma3)


def test_a_sample_whose_row_fails_takes_its_group_out_and_the_others_keep_their_tokens(gemma3, patched, monkeypatch):
    model, batch, expected = gemma3
    llm = patched(model, max_model_len=128)
    real = hybridkv.engine.core.sample_each
    failed_once = []

    def failing(logits, rows):
        tokens, logprobs, errors = real(logits, rows)
        pair_rows = [i for i, row in enumerate(rows) if row.params.n == 2]
        if len(pair_rows) == 2 and not failed_once:  # both samples in one step: fail the second's row
            failed_once.append(pair_rows[1])
            tokens[pair_rows[1]], errors[pair_rows[1]] = None, RuntimeError("injected row fault")
        return tokens, logprobs, errors

    monkeypatch.setattr(hybridkv.engine.core, "sample_each", failing)
    pair = SamplingParams(n=2, temperature=0, max_tokens=8)
    ids = [
        llm.add_request(new_request_id(), batch[0], GREEDY),
        llm.add_request(new_request_id(), batch[1], pair),
        llm.add_request(new_request_id(), batch[2], GREEDY),
    ]
    done = {}
    while llm.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    assert failed_once and "injected row fault" in done[ids[1]].error
    assert all(c.finish_reason == "error" for c in done[ids[1]].outputs)
    assert [done[ids[0]].outputs[0].token_ids, done[ids[2]].outputs[0].token_ids] == [expected[0], expected[2]]
    monkeypatch.undo()
    assert serves_exactly(llm, gemma3)
