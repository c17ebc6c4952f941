import math

import pytest
import torch

from hybridkv.sampling.acceptance import accept
from hybridkv.sampling.sampler import SamplingRow, _apply_penalties, draw_tokens, filtered_probs, greedy_tokens, sample
from hybridkv.scheduling.sampling_params import SamplingParams


def row(generator=None, prompt=(), output=(), **params):
    return SamplingRow(SamplingParams(**params), generator, [*prompt, *output], len(prompt))


def seeded(seed):
    return torch.Generator().manual_seed(seed)


LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    tokens, logprobs = sample(logits, [row(temperature=0), row(temperature=0)])
    assert tokens == [1, 0] and logprobs == [None, None]


def test_top_k_keeps_the_k_most_likely_tokens():
    probs = filtered_probs(LOGITS, [SamplingParams(top_k=2)])
    assert probs[0].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])


def test_top_p_drops_tokens_once_the_mass_above_reaches_p():
    probs = filtered_probs(LOGITS, [SamplingParams(top_p=0.7)])
    assert probs[0].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    assert filtered_probs(LOGITS, [SamplingParams(top_p=0.01)])[0].tolist() == pytest.approx([1, 0, 0, 0])


def test_min_p_drops_tokens_below_a_share_of_the_top_probability():
    probs = filtered_probs(LOGITS, [SamplingParams(min_p=0.5)])
    assert probs[0].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])


def test_temperature_sharpens_the_distribution():
    probs = filtered_probs(LOGITS, [SamplingParams(temperature=0.5)])
    expected = torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 2
    assert probs[0].tolist() == pytest.approx((expected / expected.sum()).tolist())


def test_samples_follow_the_distribution():
    rows = [row(generator=seeded(0))]
    counts = [0, 0, 0, 0]
    for _ in range(4000):
        counts[sample(LOGITS, rows)[0][0]] += 1
    assert [c / 4000 for c in counts] == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.03)


def test_seeded_row_draws_the_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    generator = seeded(7)
    alone = [sample(logits[1:2], [row(generator)])[0][0] for _ in range(20)]
    generator = seeded(7)
    other = seeded(99)
    in_batch = [sample(logits, [row(other), row(generator), row()])[0][1] for _ in range(20)]
    assert in_batch == alone


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, 3.0]])
    out = _apply_penalties(logits, [row(prompt=[0], output=[1], repetition_penalty=2.0)])
    assert out[0].tolist() == [1.0, -4.0, 1.0, 3.0]
    assert logits[0].tolist() == [2.0, -2.0, 1.0, 3.0]  # the caller's logits are untouched


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 4)
    out = _apply_penalties(logits, [row(prompt=[3], output=[1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)])
    assert out[0].tolist() == [0.0, -(0.5 + 0.5), -(0.25 + 0.5), 0.0]


def test_logprobs_are_the_raw_distribution_with_the_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    tokens, logprobs = sample(logits, [row(temperature=0, logprobs=2)])
    expected = torch.log_softmax(logits[0], dim=-1)
    assert tokens == [1]
    assert logprobs[0].logprob == pytest.approx(expected[1].item())
    assert logprobs[0].rank == 1
    assert logprobs[0].top_ids == [1, 2]
    assert logprobs[0].top_logprobs == pytest.approx([expected[1].item(), expected[2].item()])


def test_logprobs_zero_returns_only_the_sampled_token_and_minus_one_every_token():
    _, logprobs = sample(torch.tensor([[0.0, 0.0]]), [row(temperature=0, logprobs=0)])
    assert logprobs[0].top_ids == [] and logprobs[0].logprob == pytest.approx(math.log(0.5))
    assert logprobs[0].rank == 2  # among equals, the last (vLLM's count of those at least as likely)
    _, logprobs = sample(torch.tensor([[1.0, 3.0, 2.0]]), [row(temperature=0, logprobs=-1)])
    assert logprobs[0].top_ids == [1, 2, 0]


def test_a_sampled_tokens_rank_counts_the_tokens_at_least_as_likely():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])
    ranks = set()
    for seed in range(20):
        (token,), (logprobs,) = sample(logits, [row(seeded(seed), temperature=2.0, logprobs=1)])
        assert logprobs.rank == int((logits[0] >= logits[0, token]).sum())
        ranks.add(logprobs.rank)
    assert len(ranks) > 1  # not only the most likely token was drawn: the test sees ranks above 1


def test_logit_bias_shifts_the_logits_of_its_tokens():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert sample(logits, [row(temperature=0, logit_bias={0: 5.0})])[0] == [0]
    assert sample(logits, [row(temperature=0, logit_bias={"2": 1.5})])[0] == [2]
    tokens, logprobs = sample(logits, [row(temperature=0, logit_bias={1: -100.0}, logprobs=1)])
    raw = torch.log_softmax(logits[0], -1)
    assert tokens == [2] and logprobs[0].logprob == pytest.approx(raw[2].item())  # the raw distribution's


def held(outputs, generator=None, **params):
    """A row with prompt [9, 9] and `outputs`, min_tokens 2, holding back token 0 (an EOS), 1 (its stop id) and 300
    (an EOS past this vocabulary)."""
    params = SamplingParams(min_tokens=2, max_tokens=8, stop_token_ids=[1], **params)
    return SamplingRow(params, generator, [9, 9, *outputs], 2, min_tokens_ids=(0, 1, 300))


@pytest.mark.parametrize(("outputs", "greedy", "drawn"), [((5,), [2, 2], {2, 3}), ((5, 5), [0, 0], {0, 1})])
def test_min_tokens_masks_its_held_ids_until_the_sample_has_min_tokens_outputs(outputs, greedy, drawn):
    """Token 0 is the most likely and token 1 next: neither is drawn while the sample has fewer than min_tokens
    output tokens, by greedy, sampled (top 2) or async scheduling's device draw; both are from then on."""
    logits = torch.tensor([[4.0, 3.0, 1.0, 0.0]]).repeat(2, 1)
    assert not held(outputs, temperature=0).plain_greedy
    assert sample(logits, [held(outputs, temperature=0), held(outputs, temperature=0, logprobs=0)])[0] == greedy
    assert draw_tokens(logits, [held(outputs, temperature=0), held(outputs, temperature=0)]).tolist() == greedy
    rows = [held(outputs, top_k=2), held(outputs, seeded(1), top_k=2)]
    assert {token for _ in range(100) for token in sample(logits, rows)[0]} == drawn


def test_a_speculative_checks_rows_are_masked_each_at_its_place():
    """A greedy request one token short of min_tokens: its first row masks its held tokens 0 and 1 (a proposed 0 is
    rejected for the third best, 2), the rows after it are past min_tokens (0, proposed there, is kept)."""
    logits = torch.tensor([[4.0, 3.0, 1.0]]).repeat(3, 1)
    one_short = held([5], temperature=0)
    assert accept(logits, [0, 0], one_short) == [2]
    assert accept(logits, [2, 0], one_short) == [2, 0, 0]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(temperature=-1), "temperature must be >= 0"),
        (dict(top_p=0), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), r"top_k must be 0 or -1 \(off\) or >= 1"),
        (dict(n=0), "n must be >= 1"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens must be in"),
        (dict(stop=[""]), "stop strings must be non-empty"),
        (dict(presence_penalty=3), "presence_penalty must be in"),
    ],
)
def test_invalid_params_name_the_rule(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_stop_accepts_one_string_or_many_kept_as_lists_as_in_vllm():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3, 3]).stop_token_ids == [3]


def test_greedy_ties_go_to_the_first_index_as_in_transformers():
    logits = torch.zeros(2, 1000)
    logits[:, 7] = logits[:, 500] = 1.0
    assert sample(logits, [row(temperature=0), row(temperature=0)])[0] == [7, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_tokens_equal_torch_argmax_with_ties_nans_and_infinities(dtype):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 32_000, generator=generator).to(dtype)
    logits[1, 9] = logits[1, 20_000] = 50  # a tie: the first index
    logits[2, 5], logits[2, 31_000] = float("nan"), float("nan")  # NaN ranks first, the first NaN wins
    logits[3] = float("-inf")
    logits[3, 123] = float("inf")
    logits[4, 700] = logits[4, 900] = float("inf")
    logits[5] = 0.0  # all equal: index 0
    logits[5, 1] = -0.0
    expected = torch.argmax(logits, dim=-1).tolist()
    assert expected[1:] == [9, 5, 123, 700, 0]
    assert torch.as_tensor(greedy_tokens(logits)).tolist() == expected
    # A strided view (rows of a larger batch) and the mixed greedy/random path agree too.
    assert torch.as_tensor(greedy_tokens(logits[::2])).tolist() == expected[::2]
    rows = [row(temperature=0), row(temperature=1.0, seed=1)] * 3
    tokens, _ = sample(logits.float(), rows)
    assert tokens[::2] == expected[::2]
