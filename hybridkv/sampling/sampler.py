"""The sampler: next tokens for a batch of logit rows, vectorised over the batch.

Order of operations (vLLM's): a structured-outputs row's grammar mask (disallowed tokens at -inf), then the
min_tokens mask (a row with fewer output tokens than its min_tokens has its EOS and stop ids at -inf, as vLLM's
MinTokensLogitsProcessor and transformers' MinNewTokensLengthLogitsProcessor do), then logit biases, then
penalties, then greedy rows take the argmax; other rows are divided by their temperature, filtered by
top-k, top-p and min-p, and sampled. Sampling is an exponential race (argmax of probs / q with q ~
Exp(1)), equivalent to drawing from probs; a seeded row draws its q from its own generator, so its
tokens do not depend on the rest of the batch. Logprobs are those of the model's raw distribution
(log_softmax of the unmodified logits), given for rows that ask for them and for best_of samples (ranked
by their sum).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.sampling.structured_outputs import GrammarMatcher, apply_bitmasks
from hybridkv.scheduling.sampling_params import SamplingParams


@dataclass(slots=True)
class SampledLogprobs:
    """A sampled token's raw logprob and rank (1: the most likely; among equals, the last), and the ids and logprobs
    of the k most likely tokens, most likely first (what `SamplingParams.logprobs` asks for; -1: every token)."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True, eq=False)
class SamplingRow:
    """One row of logits to sample: its params, its own generator if seeded, its tokens so far
    (prompt then outputs; read by the penalties and, for its count, by the min_tokens mask, so nothing is copied per
    step), for structured outputs its grammar matcher (which the output processor advances), and the ids it may not
    draw before its min_tokens-th output token (`StopRules.held_until_min_tokens`: its stop ids and, unless
    ignore_eos, the model's EOS ids; empty without min_tokens). Rows compare by identity (a batch's check for a
    missing row, `None in rows`, calls no Python)."""

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: Sequence[int]
    num_prompt_tokens: int
    matcher: GrammarMatcher | None = None
    min_tokens_ids: tuple[int, ...] = ()
    # Greedy with nothing else to compute (no penalty, bias, logprob, grammar or min_tokens mask): its argmax.
    plain_greedy: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.params
        self.plain_greedy = (
            params.greedy
            and not params.has_penalties
            and not params.logit_bias
            and not params.needs_logprob
            and self.matcher is None
            and not self.min_tokens_ids
        )

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def holds_back(self, ahead: int = 0) -> bool:
        """Whether the min_tokens mask applies to the row's token `ahead` places after its next one (a speculative
        check's rows): the sample has fewer than min_tokens output tokens before it."""
        num_before = len(self.token_ids) - self.num_prompt_tokens + ahead
        return bool(self.min_tokens_ids) and num_before < self.params.min_tokens


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[list[int], list[SampledLogprobs | None]]:
    """One token per row of `logits` ([num_rows, vocab], float32), and its logprobs where asked."""
    if all(r.plain_greedy for r in rows):
        return greedy_tokens(logits).tolist(), [None] * len(rows)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(r.params.needs_logprob for r in rows) else None
    constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
    if constrained:
        logits = apply_bitmasks(logits, constrained, [rows[i].matcher for i in constrained])
    token_list = draw_tokens(logits, rows).tolist()
    logprobs: list[SampledLogprobs | None] = [None] * len(rows)
    if raw_logprobs is not None:
        for i, row in enumerate(rows):
            if row.params.needs_logprob:
                logprobs[i] = token_logprobs(raw_logprobs[i], token_list[i], row.params.logprobs)
    return token_list, logprobs


def draw_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One token per row, on the logits' device, with nothing read back to the host (what async scheduling takes
    for rows without a grammar, penalty or logprobs: `sample` applies those): the min_tokens mask, logit biases,
    penalties, then each row's argmax or draw."""
    logits = mask_before_min_tokens(logits, rows)
    logits = _apply_logit_bias(logits, rows)
    logits = _apply_penalties(logits, rows)
    if all(r.params.greedy for r in rows):
        return torch.as_tensor(greedy_tokens(logits), device=logits.device)
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        index = torch.tensor(greedy, device=logits.device)
        tokens[index] = torch.as_tensor(greedy_tokens(logits[index]), device=logits.device)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        probs = filtered_probs(logits[index], [rows[i].params for i in random_rows])
        tokens[index] = race(probs, [rows[i].generator for i in random_rows])
    return tokens


def token_logprobs(raw: torch.Tensor, token: int, num_top: int | None) -> SampledLogprobs:
    """`token`'s logprob and rank in one row of raw logprobs `[vocab]`, and its `num_top` most likely tokens (None
    or 0: none, as best_of alone needs; -1: every token)."""
    value = raw[token]
    k = raw.shape[-1] if num_top == -1 else (num_top or 0)
    values, ids = raw.topk(k) if k else (raw[:0], raw[:0])
    # vLLM's rank: how many tokens are at least as likely (so the most likely is 1).
    rank = int((raw >= value).sum())
    return SampledLogprobs(value.item(), rank, ids.tolist(), values.tolist())


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor | np.ndarray:
    """Each row's first maximal index (argmax). float32 rows on the CPU go to numpy's argmax, which is
    vectorised and faster than torch's ``max(dim)`` and ``argmax`` (benchmarks/RESULTS.md, choices in the code); NaN
    ranks first in both, as in torch."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy(force=True).argmax(axis=-1)
    return logits.max(dim=-1).indices


def sample_each(
    logits: torch.Tensor, rows: Sequence[SamplingRow]
) -> tuple[list[int | None], list[SampledLogprobs | None], list[Exception | None]]:
    """`sample`, but a row that fails fails alone: its token is None and its error says why, and every
    other row gets the token `sample` would have given it (seeded generators are rewound before the
    rows are sampled one by one)."""
    if all(row.plain_greedy for row in rows):  # each row's argmax, which no row fails alone
        return greedy_tokens(logits).tolist(), [None] * len(rows), [None] * len(rows)
    seeded = [(row.generator, row.generator.get_state()) for row in rows if row.generator is not None]
    try:
        tokens, logprobs = sample(logits, rows)
        return list(tokens), logprobs, [None] * len(rows)
    except Exception:
        for generator, state in seeded:
            generator.set_state(state)
    results: tuple[list[int | None], list[SampledLogprobs | None], list[Exception | None]] = ([], [], [])
    for index, row in enumerate(rows):
        try:
            (token,), (token_logprobs,) = sample(logits[index : index + 1], [row])
            error = None
        except Exception as exc:
            token, token_logprobs, error = None, None, exc
        for values, value in zip(results, (token, token_logprobs, error), strict=True):
            values.append(value)
    return results


def mask_before_min_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], ahead: Sequence[int] | None = None
) -> torch.Tensor:
    """`logits` with each row's `min_tokens_ids` at -inf where its sample has fewer than min_tokens output tokens
    before it (`ahead[i]`: how many places after its row's next token row i's token is; a speculative check's rows),
    a copy when anything is masked. An id past the vocabulary is never drawn, so it is left out."""
    vocab = logits.shape[-1]
    places: tuple[list[int], list[int]] = ([], [])
    for index, row in enumerate(rows):
        if row.min_tokens_ids and row.holds_back(0 if ahead is None else ahead[index]):
            ids = [token for token in row.min_tokens_ids if token < vocab]
            places[0].extend([index] * len(ids))
            places[1].extend(ids)
    if not places[0]:
        return logits
    logits = logits.clone()
    logits[torch.tensor(places[0], device=logits.device), torch.tensor(places[1], device=logits.device)] = float("-inf")
    return logits


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Each row's `logit_bias` added to its tokens' logits (an id past the vocabulary is an error of its row)."""
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i in biased:
        bias = rows[i].params.logit_bias
        ids = list(bias)
        if max(ids) >= vocab:
            raise ValueError(f"logit_bias names token id {max(ids)}, outside the vocabulary [0, {vocab})")
        values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        logits[i, torch.tensor(ids, device=logits.device)] += values
    return logits


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (transformers' rule: positive logits are
    divided, negative ones multiplied); presence and frequency penalties over output tokens (OpenAI's
    rule: logit -= frequency * count + presence * [count > 0])."""
    penalised = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not penalised:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i in penalised:
        params = rows[i].params
        row = logits[i]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(rows[i].token_ids)), dtype=torch.long)
            seen = seen.to(row.device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        output_token_ids = rows[i].output_token_ids
        if (params.presence_penalty or params.frequency_penalty) and output_token_ids:
            output = torch.tensor(output_token_ids, dtype=torch.long, device=row.device)
            counts = torch.bincount(output, minlength=vocab).to(row.dtype)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax of logits / temperature after top-k, top-p and min-p, row by row settings."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temperature
    if any(p.top_k_on or p.top_p < 1.0 for p in params):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if p.top_k_on else vocab for p in params], device=device)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        drop = ranks >= top_k.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):  # read from the params: a device tensor's would wait for the device
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1): a draw from each row of probs. A seeded row takes its q from its own generator,
    one vocabulary of draws per row (so one per output position, in the speculative check too: acceptance.py)."""
    q = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        q[unseeded] = torch.empty(len(unseeded), probs.shape[-1], device=probs.device).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            q[i] = torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=generator)
    return (probs / q).argmax(dim=-1)
