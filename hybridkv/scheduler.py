"""The scheduler: which requests run this step, and how many of their tokens.

A request's only progress state is num_computed_tokens. Each step has a token budget
(max_num_batched_tokens) and a sequence cap (max_num_seqs). Running requests come first, in the
order they were admitted (decodes and unfinished prefill chunks keep going); then swapped-out
requests come back; then waiting requests are admitted in arrival order (FCFS). A prompt that does
not fit the remaining budget is cut to what fits, and long_prefill_token_threshold caps any one
request's chunk so a long prompt cannot starve decodes.

When a running request cannot get blocks, the newest running request is preempted, with all of its
blocks in all groups: by recompute (blocks freed, back to the front of the waiting queue; its cached
prefix makes the redo cheap) or by swap (blocks copied to CPU swap space, brought back before any new
request is admitted). No request is admitted or swapped in during a step that preempted.

The n samples of one prompt form a group: the first (the leader) computes the prompt; when it is
done the others join the front of the waiting queue and take the prompt's blocks through the prefix
cache. Preempting any member preempts every running member of its group.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from hybridkv.coordinator import KVCacheCoordinator
from hybridkv.request import Request, RequestStatus, SampleGroup
from hybridkv.swap import SwapRecord, SwapSpace
from hybridkv.validation import check_choice, check_int

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0  # 0 = no per-request cap
    preemption_mode: str = "recompute"
    num_swap_blocks: int = 0

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0, " (0 turns the cap off)")
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        if self.preemption_mode == "swap" and self.num_swap_blocks < 1:
            raise ValueError("preemption_mode='swap' needs swap space: set swap_space (bytes) to hold blocks")


class ScheduledRequest(NamedTuple):
    """One request in a step: its next `num_new_tokens` tokens are computed; `samples` when they reach
    its last known token, so the last row's logits give its next token."""

    request: Request
    num_new_tokens: int
    samples: bool


@dataclass
class SchedulerOutput:
    """One step's plan, everything the model runner needs: the requests to run (in batch order), their
    block-table rows per group (`block_tables[group][i]` for `scheduled[i]`: the managers' own integer
    tables, read before the step's update and never changed by the runner), and the block copies to
    make before the forward: swap_out (device block, CPU block) pairs first, then swap_in (CPU block,
    device block) pairs. `preempted`, `swapped_in` and `failed` say what else changed."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_tables: list[list[list[int]]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    num_tokens: int = 0

    def add(self, request: Request, num_new_tokens: int) -> None:
        samples = request.num_computed_tokens + num_new_tokens == request.num_tokens
        self.scheduled.append(ScheduledRequest(request, num_new_tokens, samples))
        self.num_tokens += num_new_tokens

    def drop(self, requests: list[Request]) -> None:
        """Take requests out of the batch (preempted after they were scheduled)."""
        kept = [s for s in self.scheduled if s.request not in requests]
        self.num_tokens = sum(s.num_new_tokens for s in kept)
        self.scheduled = kept

    @property
    def sampling(self) -> list[Request]:
        """The requests that produce a token this step, in batch order: sampled tokens align with it."""
        return [s.request for s in self.scheduled if s.samples]


class Scheduler:
    """Waiting, running and swapped queues over one KV cache coordinator. Never touches a tensor."""

    def __init__(self, config: SchedulerConfig, coordinator: KVCacheCoordinator) -> None:
        self.config = config
        self.coordinator = coordinator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.swap_space = SwapSpace(config.num_swap_blocks)
        self.swap_records: dict[str, SwapRecord] = {}
        self.num_preemptions = 0
        self.num_swaps = 0
        self.max_num_running = 0

    def add_request(self, request: Request) -> bool:
        """Queue a request (with its group's followers, which wait for it to compute the prompt).
        False, and the whole group finished with an error, if it can never run."""
        error = self._never_fits(request)
        if error:
            for member in request.group.members:
                member.finish(RequestStatus.FINISHED_ERROR, error)
            return False
        self.waiting.append(request)
        request.group.hold_followers()
        return True

    def _never_fits(self, request: Request) -> str | None:
        limit = self.config.max_model_len
        if request.num_tokens > limit:
            return (
                f"prompt has {request.num_tokens:,} tokens but max_model_len is {limit:,}; "
                "raise max_model_len or shorten the prompt"
            )
        needed = self.coordinator.num_blocks_for(request.num_tokens)
        capacity = self.coordinator.pool.num_blocks - 1
        if needed > capacity:
            return (
                f"the prompt needs {needed:,} KV blocks but the pool has {capacity:,}; "
                "raise num_blocks / kv_cache_memory or shorten the prompt"
            )
        return None

    def _chunk_cap(self) -> int:
        threshold = self.config.long_prefill_token_threshold
        budget = self.config.max_num_batched_tokens
        return min(threshold, budget) if threshold else budget

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring); the plan carries the block-table rows."""
        out = SchedulerOutput()
        self._schedule(out)
        # Every allocation of the step is made: what the pool has left stores windows' middles for caching.
        self.coordinator.use_slack_for_caching()
        out.block_tables = self.coordinator.block_tables([s.request.request_id for s in out.scheduled])
        self.max_num_running = max(self.max_num_running, len(self.running))
        return out

    def _schedule(self, out: SchedulerOutput) -> None:
        cap = self._chunk_cap()
        coordinator = self.coordinator
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted with its group earlier in this loop
            budget = self.config.max_num_batched_tokens - out.num_tokens
            if budget <= 0:
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, cap, budget)
            while not coordinator.allocate_slots(request, num_new):
                victim = self.running[-1]
                if victim is request and len(self.running) == 1:
                    error = (
                        "the request needs more KV blocks than the whole pool holds; raise num_blocks / "
                        "kv_cache_memory or lower max_tokens"
                    )
                    out.failed.extend(self.finish_group(request.group, RequestStatus.FINISHED_ERROR, error))
                    break
                self._preempt(victim, out)
                if request.status is not RequestStatus.RUNNING:
                    break
            else:
                out.add(request, num_new)
        if out.preempted:
            return
        budget = self._swap_in(out, self.config.max_num_batched_tokens - out.num_tokens, cap)
        if self.swapped:
            return
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = coordinator.find_longest_cache_hit(request)
            num_new = min(request.num_tokens - hit.num_tokens, cap, budget)
            if not coordinator.allocate_slots(request, num_new, hit):
                break
            self.waiting.popleft()
            request.num_computed_tokens = hit.num_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.add(request, num_new)
            budget -= num_new

    def _swap_in(self, out: SchedulerOutput, budget: int, cap: int) -> int:
        """Bring swapped requests back (oldest first) while blocks and sequence slots allow, and
        schedule them in this step when the budget and the pool allow."""
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            record = self.swap_records[request.request_id]
            restored = self.coordinator.restore(request.request_id, record.layout)
            if restored is None:
                break
            self.swapped.popleft()
            del self.swap_records[request.request_id]
            out.swap_in.extend(zip(record.cpu_block_ids, restored, strict=True))
            out.swapped_in.append(request)
            self.swap_space.free(record.cpu_block_ids)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, cap, budget)
            if num_new > 0 and self.coordinator.allocate_slots(request, num_new):
                out.add(request, num_new)
                budget -= num_new
        return budget

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Preempt the victim and every other running member of its group, newest first."""
        members = victim.group.running()
        # A member already scheduled earlier in this step leaves the step's batch.
        out.drop(members)
        for member in sorted(members, key=self.running.index, reverse=True):
            self.running.remove(member)
            member.num_preemptions += 1
            self.num_preemptions += 1
            out.preempted.append(member)
            if self.config.preemption_mode == "swap" and self._swap_out(member, out):
                continue
            self.coordinator.free(member.request_id)
            member.num_computed_tokens = 0
            member.status = RequestStatus.WAITING
            self.waiting.appendleft(member)

    def _swap_out(self, request: Request, out: SchedulerOutput) -> bool:
        # A member scheduled earlier in this step leaves it: its blocks go back to what its last step left.
        self.coordinator.truncate(request.request_id, request.num_computed_tokens)
        layout = self.coordinator.layout(request.request_id)
        device_ids = [bid for row in self.coordinator.block_ids(request.request_id) for bid in row if bid]
        cpu_ids = self.swap_space.allocate(len(device_ids))
        if cpu_ids is None:
            return False
        out.swap_out.extend(zip(device_ids, cpu_ids, strict=True))
        self.swap_records[request.request_id] = SwapRecord(layout, cpu_ids)
        self.coordinator.free(request.request_id)
        request.status = RequestStatus.SWAPPED
        self.swapped.append(request)
        self.num_swaps += 1
        return True

    def update(self, out: SchedulerOutput, sampled_tokens: Sequence[int]) -> None:
        """After the step ran: advance every scheduled request by its computed tokens, append the sampled
        tokens (aligned with `out.sampling`), cache blocks that became full and return blocks that left a
        window, and queue the followers of a leader that has just computed its prompt (right behind the
        running requests, ahead of every other waiting request). Stopping is the caller's: `finish`."""
        tokens = iter(sampled_tokens)
        for request, num_new, samples in out.scheduled:
            request.num_computed_tokens += num_new
            if samples:
                request.append_token_ids([next(tokens)])
                if len(request.group.members) > 1:
                    self.waiting.extendleft(reversed(request.group.release_followers(request)))
            self.coordinator.update_computed(request)

    def finish_group(self, group: SampleGroup, status: RequestStatus, error: str | None = None) -> list[Request]:
        """Finish every unfinished sample of a group (aborted or failed together); returns them."""
        members = group.unfinished()
        for member in members:
            if not member.status.is_finished:  # a leader's finish ends the followers it holds
                self.finish(member, status, error)
        return members

    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """Take a request out of every queue and return every block it holds, device and CPU."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.swap_space.free(self.swap_records.pop(request.request_id).cpu_block_ids)
        self.coordinator.free(request.request_id)
        for follower in request.group.held_followers(request):
            follower.finish(status, error)
        request.finish(status, error)
