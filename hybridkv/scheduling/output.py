"""A step's plan as the scheduler hands it on (`Scheduler.schedule`): the requests to run with their token counts,
the block and state copies to make before the forward, and what else changed. It holds the requests themselves and
integers, never the scheduler's or the memory manager's objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from hybridkv.memory.coordinator import TableUpdates
from hybridkv.memory.tiers import TierCopies
from hybridkv.scheduling.request import Request


class ScheduledRequest(NamedTuple):
    """One request in a step: its next `num_new_tokens` tokens are computed. When they reach its last
    known token, the last row's logits give the next token of each request in `samples`: the request
    itself, then the samples of its group forked from it in this step (empty when it does not sample)."""

    request: Request
    num_new_tokens: int
    samples: tuple[Request, ...]


_new_tuple = tuple.__new__


@dataclass
class SchedulerOutput:
    """One step's plan, everything the model runner needs: the requests to run (in batch order) and the block
    copies to make before the forward, in this order: swap_out (device block, CPU block) pairs, swap_in (CPU block,
    device block) pairs, then blocks_to_copy (source, destination) pairs (copy-on-write). `table_updates`:
    what changed in the block tables since the last plan that ran (the runner's persistent batch applies it;
    a plan with nothing to run leaves them for the next). `preempted`, `swapped_in` and `failed` say what
    else changed."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # A model with state layers, in this order before the forward: the state-slot copies (source, destination)
    # of the forks made since the last step, swapped states ((device slot, CPU slot) out, then (CPU slot, device
    # slot) in: a slot freed by a swap-out may be given again in the same step), and the copies made while this
    # plan was made (checkpoints that prefix-cache hits restore); then per request, the checkpoints its step
    # writes (tokens into the step, checkpoint slot).
    state_fork_copies: list[tuple[int, int]] = field(default_factory=list)
    state_swap_out: list[tuple[int, int]] = field(default_factory=list)
    state_swap_in: list[tuple[int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    state_checkpoints: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    table_updates: TableUpdates = field(default_factory=TableUpdates)
    # The host tier's copies made while this plan was made (hybridkv/memory/tiers.py): blocks the pool evicted,
    # read before the swap copies, and blocks copied back, written after them.
    tier_copies: TierCopies = field(default_factory=TierCopies)
    # The same for state checkpoints: (checkpoint slot, host slot) out and back, before `state_copies`.
    state_tier_copies: TierCopies = field(default_factory=TierCopies)
    num_tokens: int = 0
    # Whether every request added is `greedy_alone` (its token its row's argmax, no other sample in its group):
    # the engine then samples and updates the step in one pass (`OutputProcessor.record_alone`).
    greedy_alone: bool = True
    # Speculative decoding: per request id, the proposed tokens its step checks after its last token (rows beyond
    # `num_new_tokens`, counted in `num_tokens`; they store nothing and take no block).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Whether the proposals' rows store their K/V (`Scheduler.stores_proposals`).
    spec_stored: bool = False

    def add(self, request: Request, num_new_tokens: int) -> None:
        samples: tuple[Request, ...] = ()
        if request.num_computed_tokens + num_new_tokens == len(request.token_ids) + request.num_pending_tokens:
            members = request.group.members
            samples = (request,) if len(members) == 1 else (request, *request.group.held_followers(request))
        if not request.greedy_alone:
            self.greedy_alone = False
        # tuple.__new__: a NamedTuple's own constructor is a Python function, and this runs per request and step.
        self.scheduled.append(_new_tuple(ScheduledRequest, (request, num_new_tokens, samples)))
        self.num_tokens += num_new_tokens

    def drop(self, requests: list[Request]) -> None:
        """Take requests out of the batch (preempted after they were scheduled), with their proposals."""
        kept = [s for s in self.scheduled if s.request not in requests]
        for request in requests:
            self.spec_tokens.pop(request.request_id, None)
        self.num_tokens = sum(s.num_new_tokens for s in kept) + sum(map(len, self.spec_tokens.values()))
        self.scheduled = kept

    @property
    def sampling(self) -> list[Request]:
        """The requests that produce a token this step, in batch order: sampled tokens align with it."""
        return [request for s in self.scheduled for request in s.samples]
