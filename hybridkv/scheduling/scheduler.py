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

The samples of one prompt form a group (hybridkv/scheduling/request.py): the first (the leader) computes the prompt; in
the step it samples its first token every other sample is forked from it (hybridkv/memory/coordinator.py: all
blocks shared, nothing recomputed) and draws its own first token from the same logits. A request
writing into a block another one holds gets a copy first (copy-on-write: `blocks_to_copy` in the plan).
A group takes its seats (max_num_seqs) as a whole when its first member is admitted. Preempting a beam
preempts every beam of its search, which comes back as a whole, its shared blocks shared again (a beam
search preempted by recompute starts again from its prompt: hybridkv/sampling/beam_search.py); a sample is
preempted alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridkv.memory.block_pool import NULL_BLOCK_ID
from hybridkv.memory.coordinator import KVCacheCoordinator
from hybridkv.memory.state_slots import StateSlots
from hybridkv.memory.swap import SwapRecord, SwapSpace
from hybridkv.scheduling.output import ScheduledRequest, SchedulerOutput
from hybridkv.scheduling.request import Request, RequestStatus, SampleGroup
from hybridkv.scheduling.validation import check_choice, check_int

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0  # 0 = no per-request cap
    preemption_mode: str = "recompute"
    num_swap_blocks: int = 0
    # A model with state layers: CPU state slots for swapped requests (0: its requests are recomputed).
    num_swap_state_slots: int = 0
    # LoRA adapters that may run at once (enable_lora's max_loras; 0: requests have none).
    max_loras: int = 0

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0, " (0 turns the cap off)")
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        if self.preemption_mode == "swap" and self.num_swap_blocks < 1:
            raise ValueError("preemption_mode='swap' needs swap space: set swap_space (GiB) to hold blocks")


class Scheduler:
    """Waiting, running and swapped queues over one KV cache coordinator. Never touches a tensor."""

    def __init__(self, config: SchedulerConfig, coordinator: KVCacheCoordinator) -> None:
        self.config = config
        self.coordinator = coordinator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.swap_space = SwapSpace(config.num_swap_blocks)
        # A swapped request's state, in a CPU state slot of its own (slot 0 unused).
        self.swap_states = StateSlots(config.num_swap_state_slots + 1) if config.num_swap_state_slots else None
        self.swap_records: dict[str, SwapRecord] = {}
        self.num_preemptions = 0
        self.num_swaps = 0
        self.max_num_running = 0
        # Speculative decoding is on (the engine's): running requests' proposals join their steps (`_propose`); with
        # `stores_proposals` (a model of full-attention groups only) their rows store K/V into blocks allocated for
        # them, and a kept proposal's stays (else they store nothing: hybridkv/engine/speculation.py).
        self.speculative = False
        self.stores_proposals = False
        # Called with each request `finish` ends, however it ends (the engine's speculator ends the request's draft
        # model request with it: hybridkv/engine/speculation.py).
        self.on_finish: Callable[[Request], None] | None = None
        # The last plan, when it was a decode batch (`_decode_batch_of`): its requests and their scheduled entries.
        self._decode_batch: tuple[list[Request], list[ScheduledRequest]] | None = None

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
        seats = request.group.seats
        if seats > self.config.max_num_seqs:
            return (
                f"the request runs {seats} sequences at once (n, best_of or beam_width) but max_num_seqs is "
                f"{self.config.max_num_seqs}; raise max_num_seqs or ask for fewer"
            )
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

    def chunk_cap(self) -> int:
        """The most tokens one request computes in a step: max_num_batched_tokens, or less with
        long_prefill_token_threshold."""
        threshold = self.config.long_prefill_token_threshold
        budget = self.config.max_num_batched_tokens
        return min(threshold, budget) if threshold else budget

    def may_admit(self) -> bool:
        """Whether the next plan may admit a waiting request: one waits and a seat is free. A group's seats count
        its unfinished samples, running or waiting (a beam search's, its width), so with max_num_seqs sequences
        running no seat is left for anyone, a sample waiting for its running leader included."""
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring); the plan carries the block-table rows."""
        out = SchedulerOutput()
        if self.coordinator.state_slots is not None:  # forks' copies, before this plan frees or gives a slot
            out.state_fork_copies = self.coordinator.take_state_copies()
        out.spec_stored = self.stores_proposals
        if not self._schedule_decode_batch(out):
            self._schedule(out)
            self._decode_batch = self._decode_batch_of(out)
        # Every allocation of the step is made: what the pool has left stores windows' middles for caching.
        self.coordinator.use_slack_for_caching()
        out.blocks_to_copy = self.coordinator.take_copies()
        if out.scheduled or out.swap_out or out.swap_in or out.state_swap_out:  # the plan reaches the model runner
            out.table_updates = self.coordinator.take_table_updates()
            out.state_copies = self.coordinator.take_state_copies()
            if self.coordinator.state_checkpoints is not None:
                out.state_checkpoints = self.coordinator.plan_state_checkpoints(out.scheduled)
            # Last: planning the checkpoints evicts kept ones, whose copies must run before this step's forward.
            if self.coordinator.tiers is not None and (out.scheduled or out.swap_out or out.swap_in):
                out.tier_copies, out.state_tier_copies = self.coordinator.take_tier_copies()
        elif out.state_fork_copies:  # a plan that reaches no runner: they wait for the next one
            self.coordinator.requeue_state_copies(out.state_fork_copies)
            out.state_fork_copies = []
        self.max_num_running = max(self.max_num_running, len(self.running))
        return out

    def _decode_batch_of(self, out: SchedulerOutput) -> tuple[list[Request], list[ScheduledRequest]] | None:
        """The plan as a decode batch that the next plan may repeat (`_schedule_decode_batch`): every running
        request, in order, each `greedy_alone` and computing one token from which it samples; else None."""
        scheduled = out.scheduled
        if (
            not scheduled
            or not out.greedy_alone
            or out.num_tokens != len(scheduled)
            or len(scheduled) != len(self.running)
            or not all(s.samples for s in scheduled)
        ):
            return None
        return [s.request for s in scheduled], list(scheduled)

    def _schedule_decode_batch(self, out: SchedulerOutput) -> bool:
        """Plan the last decode batch again, its entries as they were, when `_schedule` would plan just that: the same
        requests run, in the same order, nothing waits or is swapped out, and each is again one token short of its
        known tokens (its one new token is its last sampled one; within the budget, as it was). The coordinator
        says in one pass which of them start a block (`decode_needs`), and only those are allocated for; False, with
        nothing else changed, where the batch is not the same or an allocation fails (`_schedule` then preempts and
        finds what was allocated here in place). This is most decode steps: a step with no call per request."""
        batch = self._decode_batch
        if batch is None or self.waiting or self.swapped:
            return False
        requests, scheduled = batch
        if requests != self.running or (self.speculative and any(r.spec_token_ids for r in requests)):
            return False
        needs = self.coordinator.decode_needs(requests)
        if needs is None:
            return False
        allocate = self.coordinator.allocate_slots
        for request in needs:
            if not allocate(request, 1):
                return False
        out.scheduled = list(scheduled)
        out.num_tokens = len(scheduled)
        return True

    def _schedule(self, out: SchedulerOutput) -> None:
        cap = self.chunk_cap()
        coordinator = self.coordinator
        allocate, running, max_tokens = (
            coordinator.allocate_slots,
            RequestStatus.RUNNING,
            self.config.max_num_batched_tokens,
        )
        for request in list(self.running):
            if request.status is not running:
                continue  # preempted with its group earlier in this loop
            budget = max_tokens - out.num_tokens
            if budget <= 0:
                break
            num_known = len(request.token_ids) + request.num_pending_tokens  # a pending token: async scheduling
            num_new = min(num_known - request.num_computed_tokens, cap, budget)
            if request.multimodal is not None:
                num_new = _fit(request, request.num_computed_tokens, num_new)
            if num_new == 0:
                continue  # a beam waiting for the rest of its group's next-token scores, or an image for the budget
            while not allocate(request, num_new):
                victim = self.running[-1]
                if self._alone(victim, request):
                    error = (
                        "the request needs more KV blocks than the whole pool holds; raise num_blocks / "
                        "kv_cache_memory or lower max_tokens"
                    )
                    failed = self.finish_group(request.group, RequestStatus.FINISHED_ERROR, error)
                    out.drop(failed)  # a beam search's beams scheduled earlier in this loop
                    out.failed.extend(failed)
                    break
                self._preempt(victim, out)
                if request.status is not RequestStatus.RUNNING:
                    break
            else:
                out.add(request, num_new)
                if request.spec_token_ids and request.num_computed_tokens + num_new == num_known:
                    self._propose(request, num_new, out)
        if out.preempted or not (self.swapped or self.waiting):
            return
        seated = {id(r.group): r.group for r in self.running}
        seats = self.config.max_num_seqs - sum(group.seats for group in seated.values())
        budget, seats = self._swap_in(out, self.config.max_num_batched_tokens - out.num_tokens, cap, seated, seats)
        if self.swapped:
            return
        # LoRA: the adapters running; a request of another adapter waits, when max_loras run, for one to finish, and
        # those behind it go first (vLLM's rule).
        adapters = self._adapters_running() if self.config.max_loras else None
        passed: list[Request] = []
        while self.waiting and budget > 0:
            request = self.waiting[0]
            group = request.group
            needed = 0 if id(group) in seated else group.seats
            if needed > seats:
                break
            if adapters is not None and request.lora is not None:
                name = request.lora.request.lora_name, request.lora.key
                if name not in adapters and len(adapters) >= self.config.max_loras:
                    passed.append(self.waiting.popleft())
                    continue
            if request.model_key != coordinator.model_key and not self._take_model_key(request, out):
                continue
            hit = coordinator.find_longest_cache_hit(request)
            num_new = _fit(request, hit.num_tokens, min(request.num_tokens - hit.num_tokens, cap, budget))
            if num_new == 0 or not coordinator.allocate_slots(request, num_new, hit):
                break
            seats -= needed
            seated[id(group)] = group
            self.waiting.popleft()
            request.num_computed_tokens = hit.num_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = hit.num_tokens
                request.prefix_cache_miss = hit.miss
                if hit.num_tokens:
                    below = hit.host_tokens + hit.disk_tokens
                    request.prefix_cache_tiers = {
                        "device": hit.num_tokens - below,
                        "host": hit.host_tokens,
                        "disk": hit.disk_tokens,
                    }
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.add(request, num_new)
            budget -= num_new
            if adapters is not None and request.lora is not None:
                adapters.add((request.lora.request.lora_name, request.lora.key))
        self.waiting.extendleft(reversed(passed))

    def _adapters_running(self) -> set[tuple[str, bytes]]:
        """The LoRA adapters of the running requests, by name and key (a name read again from another folder is
        another adapter)."""
        return {(r.lora.request.lora_name, r.lora.key) for r in self.running if r.lora is not None}

    def _propose(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        """A request whose step reaches its last token checks the tokens proposed for it too, as many as the step's
        token budget and max_model_len leave room for (their rows store nothing: no block is allocated for them)."""
        room = min(self.config.max_num_batched_tokens - out.num_tokens, self.config.max_model_len - request.num_tokens)
        proposed = request.spec_token_ids[: max(0, room)]
        request.spec_token_ids = []
        # Stored proposals take blocks for their K/V too, or there is no proposal (never a preemption).
        if proposed and self.stores_proposals and not self.coordinator.allocate_slots(request, num_new + len(proposed)):
            proposed = []
        if proposed:
            out.spec_tokens[request.request_id] = proposed
            out.num_tokens += len(proposed)

    def _take_model_key(self, request: Request, out: SchedulerOutput) -> bool:
        """A request about to be admitted that was hashed under another model (the model changed after it was added,
        or while it ran before a preemption by recompute): hash it, and the followers waiting for it, under the
        model as it is now, so that no block another model computed is hit. A request whose images were encoded
        by another model fails instead (their embeddings are that model's); False then, the request gone."""
        key = self.coordinator.model_key
        if request.multimodal is not None and request.multimodal.model_key != key:
            error = (
                "the model changed (weights or adapters) after this request's images were encoded, so their "
                "embeddings are the old model's; submit the request again"
            )
            out.failed.extend(self.finish_group(request.group, RequestStatus.FINISHED_ERROR, error))
            return False
        for member in (request, *request.group.held_followers(request)):
            member.rekey(key)
        return True

    def _alone(self, victim: Request, request: Request) -> bool:
        """Whether preempting `victim` to make room for `request` cannot help: the request runs alone, or
        its group must run together (a beam search) and nothing else runs."""
        if victim is request and len(self.running) == 1:
            return True
        group = request.group
        return group.runs_together and victim.group is group and all(r.group is group for r in self.running)

    def _swap_in(
        self, out: SchedulerOutput, budget: int, cap: int, seated: dict[int, SampleGroup], seats: int
    ) -> tuple[int, int]:
        """Bring swapped groups back as a whole (oldest first) while blocks and seats allow, and schedule
        their members in this step when the budget and the pool allow (and, with LoRA, while its adapter runs or
        fewer than max_loras do)."""
        while self.swapped:
            group = self.swapped[0].group
            needed = 0 if id(group) in seated else group.seats
            if needed > seats:
                break
            lora = self.swapped[0].lora
            if self.config.max_loras and lora is not None:
                adapters = self._adapters_running()
                if (lora.request.lora_name, lora.key) not in adapters and len(adapters) >= self.config.max_loras:
                    break
            members = [r for r in self.swapped if r.group is group]
            tables = {r.request_id: self.swap_records[r.request_id].tables for r in members}
            restored = self.coordinator.restore(tables)
            if restored is None:
                break
            out.swap_in.extend(restored)
            seats -= needed
            seated[id(group)] = group
            for request in members:
                self.swapped.remove(request)
                self.swap_space.free(self.swap_records.pop(request.request_id).cpu_block_ids)
                if self.swap_states is not None:  # its state, into the device slot restore gave it
                    cpu_slot = self.swap_states.held[request.request_id]
                    out.state_swap_in.append((cpu_slot, self.coordinator.state_slots.held[request.request_id]))
                    self.swap_states.release(request.request_id)
                out.swapped_in.append(request)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
            for request in members:
                num_new = min(request.num_tokens - request.num_computed_tokens, cap, budget)
                num_new = _fit(request, request.num_computed_tokens, num_new)
                if num_new > 0 and self.coordinator.allocate_slots(request, num_new):
                    out.add(request, num_new)
                    budget -= num_new
        return budget, seats

    def recompute_all(self) -> None:
        """Send every running and swapped-out request back to wait, holding nothing, to compute its tokens again
        (`LLMEngine.reset_prefix_cache(reset_running_requests=True)`), ahead of the requests already waiting; a
        beam search starts again from its prompt."""
        while self.swapped:
            group = self.swapped[-1].group
            members = [r for r in self.swapped if r.group is group]
            for member in members:
                self.swapped.remove(member)
                self.swap_space.free(self.swap_records.pop(member.request_id).cpu_block_ids)
                if self.swap_states is not None:
                    self.swap_states.release(member.request_id)
            self._back_to_waiting(members)
        while self.running:
            self._preempt(self.running[-1], SchedulerOutput(), recompute=True)

    def _preempt(self, victim: Request, out: SchedulerOutput, recompute: bool = False) -> None:
        """Preempt the victim (by the configured mode, or by `recompute`), with every other running beam of its
        search when it is a beam: samples go alone (they need not run together, and a group that cannot fit at
        once must not keep preempting itself)."""
        group = victim.group
        members = sorted(group.running(), key=self.running.index) if group.runs_together else [victim]
        # A member already scheduled earlier in this step leaves the step's batch (its copies with it).
        out.drop(members)
        for member in members:
            self.running.remove(member)
            member.num_preemptions += 1
            self.num_preemptions += 1
            out.preempted.append(member)
        if not recompute and self.config.preemption_mode == "swap" and self._swap_out(members, out):
            return
        self._back_to_waiting(members)

    def _back_to_waiting(self, members: list[Request]) -> None:
        """Members of one group, out of the running or swapped queue, to the front of the waiting queue, holding no
        block: they compute their tokens again (a beam search from its prompt)."""
        for member in members:
            self.coordinator.free(member.request_id)
            member.num_computed_tokens = 0
            member.status = RequestStatus.WAITING
        group = members[0].group
        if group.beam is not None:
            members = self._restart_beam_search(group, members)
        self.waiting.extendleft(reversed(members))

    def _restart_beam_search(self, group: SampleGroup, members: list[Request]) -> list[Request]:
        """A beam search preempted by recompute starts again from its prompt: its beams end (without a
        report) and one request, holding nothing, computes the prompt again."""
        prompt = group.beam.restart()
        for member in members:
            if member is not prompt:
                member.finish(RequestStatus.FINISHED_ABORTED)
        return [prompt]

    def _swap_out(self, members: list[Request], out: SchedulerOutput) -> bool:
        """Copy the members' blocks to swap space (a block they share once), and their states to CPU state slots
        (a model with state layers), and free them; False, nothing changed, when swap space lacks the room."""
        state_slots = self.coordinator.state_slots
        if state_slots is not None and (self.swap_states is None or self.swap_states.num_free < len(members)):
            return False
        # A member scheduled earlier in this step leaves it: its blocks go back to what its last step left.
        for member in members:
            self.coordinator.truncate(member.request_id, member.num_computed_tokens)
        tables = {m.request_id: self.coordinator.swap_table(m.request_id) for m in members}
        device_ids = dict.fromkeys(b for rows in tables.values() for row in rows for b in row if b != NULL_BLOCK_ID)
        cpu_ids = self.swap_space.allocate(len(device_ids))
        if cpu_ids is None:
            return False
        to_cpu = dict(zip(device_ids, cpu_ids, strict=True))
        out.swap_out.extend(to_cpu.items())
        for member in members:
            rows = tables[member.request_id]
            record = SwapRecord([[None if b == NULL_BLOCK_ID else to_cpu[b] for b in row] for row in rows])
            self.swap_space.hold(record.cpu_block_ids)
            self.swap_records[member.request_id] = record
            if state_slots is not None:  # copied out before the step's forward, so the freed slot can be reused
                out.state_swap_out.append(
                    (state_slots.held[member.request_id], self.swap_states.take(member.request_id))
                )
            self.coordinator.free(member.request_id)
            member.status = RequestStatus.SWAPPED
            self.swapped.append(member)
            self.num_swaps += 1
        return True

    def block_tables(self, out: SchedulerOutput) -> list[list[list[int]]]:
        """`block_tables(out)[group][i]`: the block-table row of `out.scheduled[i]` in each group, the managers' live
        lists (read them before the step's update; the model runner needs none of them: `out.table_updates`)."""
        return self.coordinator.block_tables([s.request.request_id for s in out.scheduled])

    def update(self, out: SchedulerOutput, sampled_tokens: Sequence[int | None]) -> None:
        """After the step ran: advance every scheduled request by its computed tokens, append the sampled
        tokens (aligned with `out.sampling`; None for a beam, whose token the beam search chooses), cache
        blocks that became full and return blocks that left a window, and fork the samples that drew
        their first token from a leader's logits. Stopping is the caller's: `finish`. (A step of `greedy_alone`
        requests is advanced in `OutputProcessor.record_alone`'s one pass instead: keep the two alike.)"""
        tokens = iter(sampled_tokens)
        forks = []
        for request, num_new, samples in out.scheduled:
            request.num_computed_tokens += num_new
            if samples:
                token = next(tokens)
                if token is not None:
                    request.append_token(token)
                if len(samples) > 1:
                    forks.append((request, [(follower, next(tokens)) for follower in samples[1:]]))
        self.update_blocks(out)
        for request, followers in forks:
            for follower, token in followers:
                self.fork(request, follower)
                follower.append_token(token)

    def update_blocks(self, out: SchedulerOutput) -> None:
        """The KV side of a step's update, once its requests have advanced (`update`; the engine's one-pass update
        calls it itself): cache the blocks that became full, return those that left a window, and keep the state
        checkpoints the step wrote."""
        self.coordinator.update_computed_many([s.request for s in out.scheduled])
        if self.coordinator.state_checkpoints is not None:
            self.coordinator.state_checkpoints.commit()  # the step wrote them

    def fork(self, parent: Request, child: Request) -> None:
        """Make `child` (holding nothing, with the same computed tokens as `parent`) run beside `parent`,
        sharing all of its blocks; it runs right after the parent's group members already running."""
        self.coordinator.fork(parent.request_id, child.request_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        index = self.running.index(parent) + 1
        while index < len(self.running) and self.running[index].group is parent.group:
            index += 1
        self.running.insert(index, child)

    def check_plan(self, out: SchedulerOutput) -> None:
        """Assert that no block the plan writes is shared (tests call it after every schedule): each
        request writes only blocks it alone holds, and no two copies write one block."""
        for s in out.scheduled:
            request = s.request
            self.coordinator.check_writable(request.request_id, request.num_computed_tokens, s.num_new_tokens)
        destinations = [dst for _, dst in out.blocks_to_copy]
        assert len(set(destinations)) == len(destinations), f"two copies write one block: {out.blocks_to_copy}"

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
            if self.swap_states is not None:
                self.swap_states.release(request.request_id)
        self.coordinator.keep_prefix_end(request)
        self.coordinator.free(request.request_id)
        for follower in request.group.held_followers(request):
            follower.finish(status, error)
        request.finish(status, error)
        if self.on_finish is not None:
            self.on_finish(request)


def _fit(request: Request, start: int, num_new: int) -> int:
    """`num_new` tokens from `start`, cut so that a prefill chunk never splits an image whose tokens attend
    both ways (hybridkv/execution/multimodal.py): 0 when the chunk cannot reach the end of such an image this step."""
    multimodal = request.multimodal
    if multimodal is None or start >= request.num_prompt_tokens:
        return num_new
    return multimodal.fit(start, num_new)
