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
from collections.abc import Iterable
from dataclasses import dataclass, field

from hybridkv.coordinator import KVCacheCoordinator
from hybridkv.request import Request, RequestStatus
from hybridkv.swap import SwapRecord, SwapSpace

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
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0 turns the cap off)")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.num_swap_blocks < 1:
            raise ValueError("preemption_mode='swap' needs swap space: set swap_space (bytes) to hold blocks")


@dataclass
class SchedulerOutput:
    """One step: requests to run with their new token counts (in batch order), what changed, and the
    block copies to make before the forward: swap_out (device block, CPU block) pairs first, then
    swap_in (CPU block, device block) pairs."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


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

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def add_request(self, request: Request) -> bool:
        """Queue a request (with its group's other members, which wait for it to finish the prompt).
        False, and the whole group finished with an error, if it can never run."""
        error = self._never_fits(request)
        members = request.group or [request]
        if error:
            for member in members:
                member.finish(RequestStatus.FINISHED_ERROR, error)
            return False
        self.waiting.append(request)
        for member in members[1:]:
            member.status = RequestStatus.WAITING_FOR_LEADER
        return True

    def _never_fits(self, request: Request) -> str | None:
        limit = self.config.max_model_len
        if request.num_tokens > limit:
            return (
                f"prompt has {request.num_tokens:,} tokens but max_model_len is {limit:,}; "
                "raise max_model_len or shorten the prompt"
            )
        chunk = min(request.num_tokens, self._chunk_cap())
        needed = self.coordinator.num_blocks_for(request.num_tokens, chunk)
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
        out = SchedulerOutput()
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
                    self._fail(
                        request,
                        "the request needs more KV blocks than the whole pool holds; raise num_blocks / "
                        "kv_cache_memory or lower max_tokens",
                        out,
                    )
                    break
                self._preempt(victim, out)
                if request.status is not RequestStatus.RUNNING:
                    break
            else:
                out.scheduled.append((request, num_new))
        if out.preempted:
            return out
        budget = self._swap_in(out, self.config.max_num_batched_tokens - out.num_tokens, cap)
        if self.swapped:
            return out
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
            out.scheduled.append((request, num_new))
            budget -= num_new
        self.max_num_running = max(self.max_num_running, len(self.running))
        return out

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
            device_ids = [block_id for group in restored for block_id in group]
            out.swap_in.extend(zip(record.cpu_block_ids, device_ids, strict=True))
            self.swap_space.free(record.cpu_block_ids)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, cap, budget)
            if num_new > 0 and self.coordinator.allocate_slots(request, num_new):
                out.scheduled.append((request, num_new))
                budget -= num_new
        return budget

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Preempt the victim and every other running member of its group, newest first."""
        members = [m for m in (victim.group or [victim]) if m.status is RequestStatus.RUNNING]
        # A member already scheduled earlier in this step leaves the step's batch.
        out.scheduled = [(r, n) for r, n in out.scheduled if r not in members]
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
        layout = self.coordinator.layout(request.request_id)
        device_ids = [bid for group in self.coordinator.block_ids(request.request_id) for bid in group if bid]
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

    def _fail(self, request: Request, error: str, out: SchedulerOutput) -> None:
        for member in request.group or [request]:
            if not member.status.is_finished:
                self.finish(member, RequestStatus.FINISHED_ERROR, error)
                out.failed.append(member)

    def update(self, out: SchedulerOutput, sampled: dict[str, int], eos_token_ids: Iterable[int]) -> list[Request]:
        """Advance every scheduled request by its computed tokens, append sampled tokens, stop and free
        requests that finished, release group members whose leader finished the prompt. Returns the
        requests finished this step (failed ones included)."""
        eos = frozenset(eos_token_ids)
        finished = list(out.failed)
        for request, num_new in out.scheduled:
            request.num_computed_tokens += num_new
            token = sampled.get(request.request_id)
            if token is not None:
                request.append_token_ids([token])
                if request.group and request is request.group[0] and request.num_output_tokens == 1:
                    self._release_followers(request)
            self.coordinator.update_computed(request)
            if token is not None:
                status = self._stop_status(request, token, eos)
                if status is not None:
                    self.finish(request, status)
                    finished.append(request)
        return finished

    def _release_followers(self, leader: Request) -> None:
        """The leader's prompt is computed and cached: its group's other samples queue right behind
        the running requests, ahead of every other waiting request."""
        for member in reversed(leader.group[1:]):
            if member.status is RequestStatus.WAITING_FOR_LEADER:
                member.status = RequestStatus.WAITING
                self.waiting.appendleft(member)

    def _stop_status(self, request: Request, token: int, eos: frozenset[int]) -> RequestStatus | None:
        params = request.params
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if request.num_output_tokens < params.min_tokens:
            return None
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
            request.stop_reason = token if token in params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        return None

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
        request.finish(status, error)
        if request.group and request is request.group[0]:
            # A leader that ends before its followers were released takes them with it.
            for member in request.group[1:]:
                if member.status is RequestStatus.WAITING_FOR_LEADER:
                    member.finish(status, error)
