"""Speculative decoding's check of a request's proposals (hybridkv/engine/speculation.py runs it; the proposals come
from hybridkv/sampling/prompt_lookup.py or a draft model).

`accept` checks a request's k proposals against the k + 1 rows of logits its step computed (row i: the distribution
of the token after the i-th proposal's prefix): a greedy request keeps the proposals equal to each row's argmax
and then the first row's argmax that differs (or the last row's), so its tokens are `generate`'s; a sampled request
takes each proposal x with probability p(x) of its row (after temperature, top-k, top-p and min-p) and, at the first
rejection, draws from p with x removed (renormalised), else from the last row. Proposals are deterministic given the
sequence (the proposal distribution is a point mass), and this is the rejection rule that leaves each token
distributed as p (Leviathan et al. 2023, Chen et al. 2023, with q a point mass), whatever the proposer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.sampling.sampler import SamplingRow, filtered_probs, greedy_tokens, mask_before_min_tokens


def accept(logits: torch.Tensor, proposed: Sequence[int], row: SamplingRow) -> list[int]:
    """The tokens a request keeps from a step that checked `proposed` (`logits`: its `len(proposed) + 1` rows,
    float32): the accepted proposals, then one token of the model's own (see the module docstring). Rows under the
    request's min_tokens are masked as the sampler masks them, each at its place."""
    logits = mask_before_min_tokens(logits, [row] * logits.shape[0], range(logits.shape[0]))
    if row.params.greedy:
        chosen = greedy_tokens(logits).tolist()
        kept = 0
        while kept < len(proposed) and proposed[kept] == chosen[kept]:
            kept += 1
        return chosen[: kept + 1]
    probs = filtered_probs(logits, [row.params] * logits.shape[0])
    device = probs.device
    proposal = torch.tensor(list(proposed), dtype=torch.long, device=device)
    generator = row.generator
    uniforms = torch.rand(len(proposed), device=device, generator=generator)
    taken = probs[torch.arange(len(proposed), device=device), proposal]
    rejected = (uniforms >= taken).nonzero()
    if rejected.numel() == 0:
        last = probs[-1]
        return [*proposed, int(torch.multinomial(last, 1, generator=generator))]
    first = int(rejected[0])
    residual = probs[first].clone()
    residual[proposal[first]] = 0.0
    token = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return [*proposed[:first], token]
