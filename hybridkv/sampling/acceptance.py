"""Speculative decoding's check of a request's proposals (hybridkv/engine/speculation.py runs it; the proposals come
from hybridkv/sampling/prompt_lookup.py or a draft model).

`accept` checks a request's k proposals against the k + 1 rows of logits its step computed (row i: the distribution
of the token after the i-th proposal's prefix). Each row gives the token the sampler would give it: a greedy request's
argmax, a sampled request's draw from p (after temperature, top-k, top-p and min-p) by the sampler's own exponential
race. The request keeps the proposals equal to their rows' tokens and then the first row's token that differs (or the
last row's). For a sampled request this is the rejection rule that leaves each token distributed as p (Leviathan et
al. 2023, Chen et al. 2023, with q a point mass: proposals are deterministic given the sequence), whatever the
proposer: a proposal x is kept with probability p(x), and a race that x did not win is won by a token distributed as p
with x removed, renormalised.

A seeded request's race at each output position takes the next vocabulary of draws from its generator, as the sampler
does: the rows past its first differing one give their draws back (the generator is rewound), so output position i
always takes the i-th draws, and its tokens are the ones it samples without speculation, whatever the proposals and
however many the step's budget let it check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.sampling.sampler import SamplingRow, filtered_probs, greedy_tokens, mask_before_min_tokens, race


def accept(logits: torch.Tensor, proposed: Sequence[int], row: SamplingRow) -> list[int]:
    """The tokens a request keeps from a step that checked `proposed` (`logits`: its `len(proposed) + 1` rows,
    float32): the accepted proposals, then one token of the model's own (see the module docstring). Rows under the
    request's min_tokens are masked as the sampler masks them, each at its place."""
    logits = mask_before_min_tokens(logits, [row] * logits.shape[0], range(logits.shape[0]))
    generator = row.generator
    states = []
    if row.params.greedy:
        chosen = greedy_tokens(logits).tolist()
    else:
        probs = filtered_probs(logits, [row.params] * logits.shape[0])
        winners = []
        for position in range(len(probs)):  # a row after another, as the sampler's steps would draw them
            if generator is not None:
                states.append(generator.get_state())
            winners.append(race(probs[position : position + 1], [generator]))
        chosen = torch.cat(winners).tolist()
    kept = 0
    while kept < len(proposed) and proposed[kept] == chosen[kept]:
        kept += 1
    if kept + 1 < len(states):  # the draws of the rows past the last kept token are the next positions'
        generator.set_state(states[kept + 1])
    return chosen[: kept + 1]
