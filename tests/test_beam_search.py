"""Beam search in the engine against transformers' own `generate(num_beams=k, num_return_sequences=k,
do_sample=False)`, for every family in the zoo: the same k sequences in the same order and the same
scores, with and without EOS in play, with chunked prefill and prefix caching, on tiny pools (preemption
by recompute and by swap), beside other requests in the same batch; `cum_logprob` is the teacher-forced
sum of the sequence's log-probabilities.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.minimax.modeling_minimax import MiniMaxCache, MiniMaxForCausalLM

import hybridkv
from hybridkv import BeamSearchParams, SamplingParams
from hybridkv.memory.integrity import check_coordinator
from hybridkv.patches.own_state import keeps_own_state
from hybridkv.tiny import tiny_model

from model_zoo import ZOO, slow_except
from tiny_models import VOCAB, hf_greedy, new_request_id, prompts

K = 4
MAX_NEW = 8
SCORE_TOL = 1e-4
TIE = 1e-5


class _ReorderedMiniMaxCache(MiniMaxCache):
    """MiniMax's own cache, with its lightning attention states reordered with the beams: transformers' beam search
    calls `reorder_cache`, which `MiniMaxCache` leaves to `DynamicCache` (the attention layers' K/V only), so each
    beam goes on from another beam's state and the beams differ from the 6th token on (the zoo's MiniMax)."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.linear_cache = [
            state if isinstance(state, list) else state.index_select(0, beam_idx.to(state.device))
            for state in self.linear_cache
        ]


class _ReorderedBlockStates(DynamicCache):
    """transformers' cache, with the states RecurrentGemma's recurrent blocks keep on themselves reordered with the
    beams: `reorder_cache` reorders the cache's K/V only, so each beam goes on from another beam's block states (the
    zoo's RecurrentGemma: other beams from the 2nd on)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(config=model.config)
        self.blocks = [module for module in model.modules() if keeps_own_state(module)]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        for block in self.blocks:
            block.conv1d_state = block.conv1d_state.index_select(0, beam_idx)
            block.rg_lru.recurrent_states = block.rg_lru.recurrent_states.index_select(0, beam_idx)


def hf_beam_search(model, prompt, eos=None, max_new=MAX_NEW, **options):
    """transformers' beam search: per sequence, best first, its generated ids (cut after EOS) and score; for a
    model whose states transformers' beam search leaves in the wrong beams, with them reordered."""
    if isinstance(model, MiniMaxForCausalLM):
        options = {"past_key_values": _ReorderedMiniMaxCache(), **options}
    elif any(keeps_own_state(module) for module in model.modules()):
        options = {"past_key_values": _ReorderedBlockStates(model), **options}
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=K,
            num_return_sequences=K,
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=eos,
            # generate() masks prompt tokens equal to the pad id: take one the prompt does not hold.
            pad_token_id=min(set(range(VOCAB)) - set(prompt) - {eos}),
            output_scores=True,
            return_dict_in_generate=True,
            **options,
        )
    results = []
    for row, score in zip(out.sequences[:, len(prompt) :].tolist(), out.sequences_scores.tolist(), strict=True):
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        results.append((row, score))
    return results


def assert_same_beams(output, expected):
    """Same sequences in the same order, same scores; two sequences may trade places only where HF's
    scores tie."""
    got = [(s.output_token_ids, s.score) for s in output.sequences]
    assert len(got) == len(expected) == K
    for (tokens, score), (hf_tokens, hf_score) in zip(got, expected, strict=True):
        if tokens != hf_tokens:
            assert abs(score - hf_score) < TIE, f"beams differ without a tie: got {got}, HF {expected}"
        assert abs(score - hf_score) < SCORE_TOL, f"score {score} vs HF {hf_score}: got {got}, HF {expected}"


def teacher_forced_logprob(model, sequence) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([sequence.tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = sequence.num_prompt_tokens
    return sum(logprobs[i - 1, sequence.tokens[i]].item() for i in range(start, len(sequence.tokens)))


def eos_in_play(model, prompt) -> tuple[int, float, list]:
    """An EOS id and a length penalty with which some of HF's returned sequences end in EOS (tried among
    the tokens its beams generate without one; a smaller penalty favours the shorter sequences EOS makes),
    and HF's result with them."""
    free = hf_beam_search(model, prompt)
    for length_penalty in (1.0, 0.5, 0.0):
        for position in (1, 2, 3):
            for tokens, _ in free:
                eos = tokens[position]
                expected = hf_beam_search(model, prompt, eos=eos, length_penalty=length_penalty)
                if any(row[-1] == eos for row, _ in expected):
                    return eos, length_penalty, expected
    raise AssertionError("no generated token ends one of HF's sequences as EOS")


_models: dict[str, torch.nn.Module] = {}


def zoo_model(name):
    if name not in _models:
        _models[name] = ZOO[name]()
    return _models[name]


@pytest.fixture(params=slow_except(sorted(ZOO)))
def name(request):
    return request.param


def test_beam_search_matches_generate(name, patched):
    """Default settings without EOS, then EOS in play with chunked prefill and prefix caching (run twice:
    the second search takes its prompt from the prefix cache)."""
    model = zoo_model(name)
    short, long = prompts((33, 70), seed=5)
    expected = hf_beam_search(model, short)
    llm = patched(model, block_size=8, max_model_len=256)
    (output,) = llm.beam_search([short], BeamSearchParams(beam_width=K, max_tokens=MAX_NEW), use_tqdm=False)
    assert_same_beams(output, expected)
    # A state layer's decode steps (its recurrence, token by token) sum in another order than its scan over the
    # whole sequence in one forward: the scores part from the one-forward sum by up to 1.8e-3 over 16 tokens
    # (Nemotron-H), while they equal generate's own, which decodes the same way, within SCORE_TOL (above).
    tolerance = SCORE_TOL if not llm.stats()["state_layers"] else 5e-3
    for sequence in output.sequences:
        assert abs(sequence.cum_logprob - teacher_forced_logprob(model, sequence)) < tolerance
    assert llm.stats()["blocks_in_use"] == 0

    eos, length_penalty, expected = eos_in_play(model, long)
    model.generation_config.eos_token_id = eos
    try:
        llm = patched(model, block_size=8, max_model_len=256, max_num_batched_tokens=24)
        params = BeamSearchParams(beam_width=K, max_tokens=MAX_NEW, length_penalty=length_penalty)
        for _ in range(2):
            (output,) = llm.beam_search([long], params, use_tqdm=False)
            assert_same_beams(output, expected)
    finally:
        model.generation_config.eos_token_id = None
    assert any(s.finish_reason == "stop" and s.tokens[-1] == eos for s in output.sequences)
    assert llm.stats()["prefix_cache_hits"] >= 64  # state-layer models too: their hits restore state checkpoints
    assert llm.stats()["blocks_in_use"] == 0


@pytest.mark.fast_if(lambda name, mode, **_: mode == "recompute" or name in ("llama", "lfm2"))  # swap: two kinds' own
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_search_on_a_tiny_pool_beside_other_requests(name, patched, mode):
    """Beam searches and greedy requests in one continuous batch, on a pool too small for all of them:
    requests wait and are preempted (a beam search as a whole), and every result stays exact."""
    model = zoo_model(name)
    beam_prompts, greedy_prompt = TINY_POOL_BEAM_PROMPTS, TINY_POOL_GREEDY_PROMPT
    expected, greedy = tiny_pool_references(name)
    settings = dict(block_size=8, max_model_len=96, max_num_batched_tokens=32, preemption_mode=mode)
    # Room for the larger search alone and little more (found by trying pools from the smallest that holds
    # one request up): the three requests together must wait and preempt.
    params = BeamSearchParams(beam_width=K, max_tokens=MAX_NEW)
    num_blocks = hybridkv.min_num_blocks(model, **settings)
    if mode == "swap":
        settings["swap_space"] = 1 / 64  # GiB: 16 MiB
    while not all(searches_alone(patched, model, settings, num_blocks, p, params) for p in beam_prompts):
        num_blocks += 2
    llm = patched(model, **settings, num_blocks=num_blocks + 2)
    ids = [llm.add_request(new_request_id(), p, params) for p in beam_prompts]
    ids.append(llm.add_request(new_request_id(), greedy_prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW)))
    done = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                done[output.request_id] = output
        check_coordinator(llm.core.coordinator, {r.request_id: r for r in llm.core.scheduler.running})
    for request_id, reference in zip(ids, expected, strict=False):
        assert_same_beams(hybridkv.BeamSearchOutput.of(done[request_id], BeamSearchParams(K)), reference)
    assert done[ids[-1]].outputs[0].token_ids == greedy
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["blocks_in_use"] == 0
    if mode == "swap":  # a model with state layers swaps its states too
        assert stats["num_swaps"] > 0
        assert llm.core.scheduler.swap_space.num_free_blocks == llm.core.scheduler.swap_space.num_blocks


@pytest.mark.parametrize(
    ("length_penalty", "early_stopping"), [(0.5, True), (2.0, "never"), (-0.5, False), (0.0, "never")]
)
def test_length_penalty_and_early_stopping_rank_like_generate(patched, length_penalty, early_stopping):
    model = zoo_model("gemma3")
    prompt = prompts((50,), seed=8)[0]
    eos = hf_beam_search(model, prompt)[0][0][1]
    options = dict(length_penalty=length_penalty, early_stopping=early_stopping)
    expected = hf_beam_search(model, prompt, eos=eos, max_new=12, **options)
    model.generation_config.eos_token_id = eos
    try:
        llm = patched(model, block_size=8, max_model_len=256)
        params = BeamSearchParams(beam_width=K, max_tokens=12, **options)
        (output,) = llm.beam_search([prompt], params, use_tqdm=False)
    finally:
        model.generation_config.eos_token_id = None
    assert_same_beams(output, expected)


def test_ignore_eos_runs_every_beam_to_max_tokens(patched):
    model = zoo_model("gemma3")
    prompt = prompts((50,), seed=8)[0]
    expected = hf_beam_search(model, prompt)
    model.generation_config.eos_token_id = expected[0][0][1]
    try:
        llm = patched(model, block_size=8, max_model_len=256)
        params = BeamSearchParams(beam_width=K, max_tokens=MAX_NEW, ignore_eos=True)
        (output,) = llm.beam_search([prompt], params, use_tqdm=False)
    finally:
        model.generation_config.eos_token_id = None
    assert_same_beams(output, expected)
    assert {s.finish_reason for s in output.sequences} == {"length"}


def searches_alone(patched, model, settings, num_blocks, prompt, params) -> bool:
    """Whether a beam search alone finishes (no error) on a pool of num_blocks."""
    llm = patched(model, **settings, num_blocks=num_blocks)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    hybridkv.unpatch(model)
    return output.error is None


TINY_POOL_BEAM_PROMPTS = prompts((40, 21), seed=6)
TINY_POOL_GREEDY_PROMPT = prompts((30,), seed=7)[0]
_tiny_pool_references: dict[str, tuple] = {}


def tiny_pool_references(name):
    """HF's beams for the tiny-pool test's two searches and its greedy tokens, computed once for both modes."""
    if name not in _tiny_pool_references:
        model = zoo_model(name)
        beams = [hf_beam_search(model, p) for p in TINY_POOL_BEAM_PROMPTS]
        _tiny_pool_references[name] = (beams, hf_greedy(model, TINY_POOL_GREEDY_PROMPT, MAX_NEW)[0])
    return _tiny_pool_references[name]


def peak_blocks(llm, prompt, params) -> int:
    llm.add_request(new_request_id(), prompt, params)
    peak = 0
    while llm.has_unfinished_requests():
        llm.step()
        peak = max(peak, llm.stats()["blocks_in_use"])
    return peak


@pytest.mark.parametrize(
    ("family", "overrides", "ratio"),  # the peaks README.md's Limitations gives
    [
        ("llama", {}, 1.18),
        # Gemma 3's own window, longer than these requests: llama's path with another ratio
        pytest.param("gemma3", {"sliding_window": 512}, 1.29, marks=pytest.mark.slow),
        pytest.param("gemma3", {}, 1.78, marks=pytest.mark.slow),  # a 16-token window: a window for each beam
    ],
)
def test_a_4_beam_search_holds_well_under_twice_one_requests_blocks(patched, family, overrides, ratio):
    """Peak blocks of a 4-beam search over a 200-token prompt (64 new tokens) against one greedy request:
    the beams share the prompt's blocks and their common history, and copy only the partial block they
    diverge in. Beams that diverged more than a window ago each need a window of their own, so a tiny
    window costs the most; 4 forked samples are shown beside."""
    model = tiny_model(family, **overrides)
    prompt = prompts((200,), seed=9)[0]
    llm = patched(model, block_size=16, max_model_len=512)
    one = peak_blocks(llm, prompt, SamplingParams(temperature=0, max_tokens=64))
    beams = peak_blocks(llm, prompt, BeamSearchParams(beam_width=4, max_tokens=64))
    samples = peak_blocks(llm, prompt, SamplingParams(n=4, temperature=1.0, max_tokens=64))
    print(
        f"{family} {overrides}: peak blocks one request {one}, 4 beams {beams} ({beams / one:.2f}x), "
        f"4 samples {samples}"
    )
    assert round(beams / one, 2) == ratio
    assert samples < 4 * one
    assert llm.stats()["blocks_in_use"] == 0


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(patched):
    model = zoo_model("gemma3")
    prompt = prompts((30,), seed=10)[0]
    llm = patched(model, block_size=8, max_model_len=256)
    every = SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=10, logprobs=0)
    (all_five,) = llm.generate([prompt], every, use_tqdm=False)
    (best,) = llm.generate(
        [prompt], SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=10), use_tqdm=False
    )
    ranked = sorted(all_five.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.cumulative_logprob for c in best.outputs] == pytest.approx([c.cumulative_logprob for c in ranked[:2]])
    for completion in all_five.outputs:
        steps = zip(completion.token_ids, completion.logprobs, strict=True)
        assert completion.cumulative_logprob == pytest.approx(sum(entry[token].logprob for token, entry in steps))


def test_beam_search_input_errors(patched):
    model = zoo_model("gemma3")
    llm = patched(model, block_size=8, max_model_len=256, max_num_seqs=4)
    with pytest.raises(ValueError, match="beam search does not stream"):
        llm.stream([1, 2, 3], BeamSearchParams(beam_width=2))
    with pytest.raises(ValueError, match="best_of=3 > n=1 does not stream"):
        llm.stream([1, 2, 3], SamplingParams(best_of=3))
    with pytest.raises(TypeError, match=r"must be a hybridkv\.BeamSearchParams"):
        llm.beam_search([[1, 2, 3]], SamplingParams())
    for bad, message in [
        (dict(beam_width=0), "beam_width must be >= 1"),
        (dict(beam_width=2, early_stopping="sometimes"), "early_stopping must be True, False or 'never'"),
        (dict(beam_width=2, temperature=-1.0), "temperature must be >= 0"),
        (dict(beam_width=2, max_tokens=0), "max_tokens must be >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            BeamSearchParams(**bad)
    with pytest.raises(ValueError, match="best_of must be >= n=3"):
        SamplingParams(n=3, best_of=2)
    # More beams than max_num_seqs can never run: refused with the setting to raise.
    request_id = llm.add_request(new_request_id(), [1, 2, 3], BeamSearchParams(beam_width=5))
    (output,) = llm.step()
    assert output.request_id == request_id and output.finished
    assert "max_num_seqs is 4; raise max_num_seqs" in output.error
    assert llm.stats()["blocks_in_use"] == 0
