"""Which keys a query may see, read from a transformers mask.

transformers builds every attention mask through the mask interface from a
`mask_function(batch_idx, head_idx, q_idx, kv_idx) -> bool` (causal, sliding-window and chunked overlays,
combined with `and_masks` / `or_masks`). `visibility_of_function` evaluates such a function for a few
queries far beyond any prompt, so a 4,096-token window shows up without a 4,096-token forward;
`visibility_of_tensor` reads a materialized mask instead (what a model that builds its own mask
passes), which only shows windows shorter than the mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Visibility:
    """Which earlier keys a query sees: "causal" (all of them), "window" (the last `window` positions),
    "chunked" (those of its own chunk of `chunk` positions: [chunk * (i // chunk), i]), "bidirectional"
    (later keys too) or "other". `exact` is False when only the probe's own tokens were seen, so a
    window or chunk longer than the probe would still read as "causal"."""

    kind: str
    window: int | None = None
    exact: bool = True
    chunk: int | None = None


def visibility_of_function(mask_function: Any, horizon: int) -> Visibility | None:
    """Evaluate a transformers mask function for four queries near `horizon` over every key from 0 to
    one past the query; None when the function cannot be evaluated there (it reads a tensor sized to
    the probe, e.g. a padding mask)."""
    queries = torch.arange(horizon - 4, horizon)
    lengths = queries + 2
    q_idx = torch.repeat_interleave(queries, lengths)
    kv_idx = torch.cat([torch.arange(n) for n in lengths.tolist()])
    zeros = torch.zeros_like(q_idx)
    try:
        with torch.no_grad():
            visible = torch.as_tensor(mask_function(zeros, zeros, q_idx, kv_idx)).to("cpu").bool()
        visible = visible.expand(q_idx.shape)
    except Exception:  # any failure only means: read the materialized mask instead
        return None
    rows = list(visible.split(lengths.tolist()))
    visibility = _visibility_of_rows(rows, queries.tolist(), exact=True)
    if visibility.kind == "other":
        return _chunked_visibility(mask_function, horizon - 1) or visibility
    return visibility


def _first_visible_key(mask_function: Any, query: int) -> int | None:
    """The first key `query` sees when it sees a contiguous run of keys ending at itself, else None."""
    kv_idx = torch.arange(query + 2)
    zeros = torch.zeros_like(kv_idx)
    with torch.no_grad():
        row = torch.as_tensor(mask_function(zeros, zeros, torch.full_like(kv_idx, query), kv_idx)).bool()
    row = row.expand(kv_idx.shape)
    seen = row.nonzero()
    if row[query + 1] or len(seen) == 0 or not row[int(seen[0]) : query + 1].all():
        return None
    return int(seen[0])


def _chunked_visibility(mask_function: Any, last_query: int) -> Visibility | None:
    """Chunked local attention, if the mask is one: the chunk the last query sits in starts at f, the
    query before f sees from the start of the chunk before, and every row checked agrees with it."""
    start = _first_visible_key(mask_function, last_query)
    if not start:
        return None
    previous = _first_visible_key(mask_function, start - 1)
    if previous is None or previous >= start:
        return None
    chunk = start - previous
    checks = {previous, previous + 1, start - 2, start - 1, start, start + 1, last_query - 1, last_query}
    for query in checks:
        if 0 <= query <= last_query and _first_visible_key(mask_function, query) != query // chunk * chunk:
            return None
    return Visibility("chunked", exact=True, chunk=chunk)


def visibility_of_tensor(mask: torch.Tensor) -> Visibility:
    """Read a materialized [batch, 1 or heads, q, kv] mask (bool, or float with 0 where visible)."""
    plane = mask[0, 0]
    visible = plane if plane.dtype == torch.bool else plane == 0
    num_queries, num_keys = visible.shape
    offset = num_keys - num_queries  # queries are the last positions
    rows = [visible[q] for q in range(num_queries)]
    return _visibility_of_rows(rows, [offset + q for q in range(num_queries)], exact=False)


def _visibility_of_rows(rows: list[torch.Tensor], positions: list[int], exact: bool) -> Visibility:
    spans = set()
    firsts = []
    for row, position in zip(rows, positions, strict=True):
        if row[position + 1 :].any():
            return Visibility("bidirectional")
        seen = row[: position + 1].nonzero()
        if len(seen) == 0:
            return Visibility("other")
        first = int(seen[0])
        if not row[first : position + 1].all():
            return Visibility("other")
        firsts.append(first)
        spans.add(None if first == 0 else position - first + 1)
    windows = spans - {None}
    if not windows:
        return Visibility("causal", exact=exact)
    if len(windows) > 1:
        # Rows of a materialized mask that cross a chunk boundary show the chunk size.
        chunk = min(first for first in firsts if first)
        if not exact and all(
            first == position // chunk * chunk for first, position in zip(firsts, positions, strict=True)
        ):
            return Visibility("chunked", exact=True, chunk=chunk)
        return Visibility("other")
    window = windows.pop()
    # A row that still sees position 0 must be one the window has not passed yet.
    if None in spans and any(row[0] and position >= window for row, position in zip(rows, positions, strict=True)):
        return Visibility("other")
    return Visibility("window", window)
