"""The scheduler: which requests run this step, and how many of their tokens.

A request's only progress state is num_computed_tokens. Each step has a token budget
(max_num_batched_tokens) and a sequence cap (max_num_seqs). Running requests come first, in the
order they were admitted (so decodes and unfinished prefill chunks keep going); then waiting requests
in arrival order (FCFS). A prompt that does not fit the remaining budget is cut to what fits, and
long_prefill_token_threshold caps any one request's chunk so a long prompt cannot starve decodes.

When a running request cannot get blocks, the newest running request is preempted by recompute:
all of its blocks in all groups are freed and it goes back to the front of the waiting queue (its
cached prefix makes the redo cheap). No waiting request is admitted in a step that preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from hybridkv.coordinator import KVCacheCoordinator
from hybridkv.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0  # 0 = no per-request cap

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0 turns the cap off)")


@dataclass
class SchedulerOutput:
    """One step: requests to run with their new token counts (in batch order), and what changed."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Waiting and running queues over one KV cache coordinator. Never touches a tensor."""

    def __init__(self, config: SchedulerConfig, coordinator: KVCacheCoordinator) -> None:
        self.config = config
        self.coordinator = coordinator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> bool:
        """Queue a request; False (and the request finished with an error) if it can never run."""
        error = self._never_fits(request)
        if error:
            request.finish(RequestStatus.FINISHED_ERROR, error)
            return False
        self.waiting.append(request)
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
        budget = self.config.max_num_batched_tokens
        cap = self._chunk_cap()
        coordinator = self.coordinator
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, cap, budget)
            while not coordinator.allocate_slots(request, num_new):
                victim = self.running.pop()
                if victim is request and not self.running:
                    self._fail(
                        request,
                        "the request needs more KV blocks than the whole pool holds; raise num_blocks / "
                        "kv_cache_memory or lower max_tokens",
                        out,
                    )
                    break
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                index += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = coordinator.find_longest_cache_hit(request)
            num_new = min(request.num_tokens - hit.num_tokens, cap, budget)
            if not coordinator.allocate_slots(request, num_new, hit):
                break
            self.waiting.popleft()
            request.num_computed_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
        return out

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.coordinator.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _fail(self, request: Request, error: str, out: SchedulerOutput) -> None:
        self.coordinator.free(request.request_id)
        request.finish(RequestStatus.FINISHED_ERROR, error)
        out.failed.append(request)

    def update(self, out: SchedulerOutput, sampled: dict[str, int], eos_token_ids: Iterable[int]) -> list[Request]:
        """Advance every scheduled request by its computed tokens, append sampled tokens, stop and free
        requests that finished. Returns the requests finished this step (failed ones included)."""
        eos = frozenset(eos_token_ids)
        finished = list(out.failed)
        for request, num_new in out.scheduled:
            request.num_computed_tokens += num_new
            token = sampled.get(request.request_id)
            if token is not None:
                request.append_token_ids([token])
            self.coordinator.update_computed(request)
            if token is not None:
                status = self._stop_status(request, token, eos)
                if status is not None:
                    self.finish(request, status)
                    finished.append(request)
        return finished

    def _stop_status(self, request: Request, token: int, eos: frozenset[int]) -> RequestStatus | None:
        params = request.params
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if request.num_output_tokens < params.min_tokens:
            return None
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
            return RequestStatus.FINISHED_STOPPED
        return None

    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """Take a request out of the queues and return every block it holds."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.coordinator.free(request.request_id)
        request.finish(status, error)
