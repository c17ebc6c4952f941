"""Prompt lookup, speculative decoding's proposer without a model (vLLM's `ngram` method, transformers'
`prompt_lookup_num_tokens`): the longest run of the sequence's last tokens (`prompt_lookup_max` down to
`prompt_lookup_min` tokens) found earlier in it, at its earliest place, and the tokens that followed it there.
hybridkv/engine/speculation.py proposes with it; hybridkv/sampling/acceptance.py checks the proposals.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ngram_proposal(token_ids: Sequence[int], k: int, low: int, high: int) -> list[int]:
    """Up to `k` tokens that followed the earliest earlier occurrence of the longest suffix of `token_ids` of
    `high` down to `low` tokens (fewer when the sequence ends sooner after it; none without a match)."""
    length = len(token_ids)
    if length <= low or k < 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(high, length - 1), low - 1, -1):
        # Windows that end before the last token: an occurrence of the suffix followed by at least one token.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        found = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if found.size:
            start = int(found[0]) + n
            return tokens[start : start + k].tolist()
    return []
