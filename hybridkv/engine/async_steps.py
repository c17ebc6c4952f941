"""Async scheduling (vLLM's `async_scheduling`): the host plans, prepares and launches step N+1 while the device
runs step N, and reads step N's tokens after that: outputs, stop checks and streams run one step behind.

Launching a step (`AsyncSteps._launch`) queues its forward and its sampling on the device and starts copying the
tokens to the host without waiting for them. Its requests advance at once: each has computed its step's tokens
(`num_computed_tokens`), and each that sampled holds one more token that is not in `token_ids` yet
(`num_pending_tokens`). The KV side of the update is made then too (`Scheduler.update_blocks`: full blocks cached,
blocks left out of windows returned, state checkpoints kept): the device computes a step's blocks before any later
step reads or writes them (one stream), and a block is cached only once every token in it is known. The next plan
counts a pending token as one more to compute; its row's input id is written on the device from the tokens the
step before drew (`ModelRunner.pending_tokens`).

Finishing a step (`_finish`) reads its tokens (the one wait), appends them, and records and stops them as the
synchronous update does (`OutputProcessor.process`). A request that stopped there while the step in flight computes
for it is taken back first: that step's token is dropped and its computed count restored, and finishing returns
every block and state slot it holds, as it would have with nothing in flight.

Step N+1 is planned before step N finishes only where nothing it plans can depend on N's tokens
(`AsyncSteps._may_overlap`):
- every request that sampled in N draws its next token from nothing but its logits (`Request.overlaps`: no grammar,
  penalty, logprobs, beam search or other sample of its group), and drew on the device;
- nothing is swapped out (a swap-in reads what it finishes). A plan made ahead may preempt a request whose token
  is pending: by recompute it waits with its token still to come, which is appended when its step finishes
  (before it is planned again); by swap its blocks are copied once the step in flight has written them (the copy
  waits for the device);
- with state checkpoints, no request's pending token ends a checkpoint interval (the checkpoint's hash needs it);
- the model needs no check this call (`LLMEngine.follow_model` runs with nothing in flight).
Otherwise N finishes first, and a plan whose sampling needs the host (forks, beams) runs synchronously
(`LLMEngine.run_plan`). Either way each `step()` finishes one step and returns its reports, as the synchronous
engine's does; the tokens are the same (tests/test_async_scheduling.py), except unseeded sampling's, which draw from
torch's global generator in the order the steps make.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridkv.engine.core import NOTHING_SAMPLED, EngineCore, PromptLogprobs, SampledTokens
from hybridkv.engine.output_processor import OutputProcessor, RequestState
from hybridkv.outputs import RequestOutput
from hybridkv.sampling import sampler
from hybridkv.sampling.sampler import SampledLogprobs, draw_tokens
from hybridkv.scheduling.output import SchedulerOutput
from hybridkv.scheduling.request import Request


class StepFront(Protocol):
    """What async scheduling asks of the engine's front (`LLMEngine`, which owns an `AsyncSteps`; named here, not
    imported: the front imports this module), through its public calls: whether the model must be checked before
    the next plan, the check, a plan run synchronously, a step's update once its tokens are read, and the list of
    reports no caller claimed yet."""

    unclaimed: list[RequestOutput]

    def model_check_due(self) -> bool: ...

    def follow_model(self) -> None: ...

    def run_plan(self, plan: SchedulerOutput) -> list[RequestOutput]: ...

    def record_prompt_logprobs(self, prompt_logprobs: list[PromptLogprobs]) -> None: ...

    def finish_step(
        self, plan: SchedulerOutput, sampled: SampledTokens, touched: dict[str, RequestState]
    ) -> list[RequestOutput]: ...


@dataclass(slots=True)
class PendingTokens:
    """The tokens a launched step drew, on the device (`tokens[i]` is `request_ids[i]`'s): what the next step's rows
    of those requests read as their input ids (`ModelRunner._place_pending_tokens`)."""

    tokens: torch.Tensor
    request_ids: list[str]
    _index: dict[str, int] | None = None

    @property
    def index(self) -> dict[str, int]:
        """Request id -> position in `tokens` (made on first use: a steady decode batch needs none)."""
        if self._index is None:
            self._index = {request_id: i for i, request_id in enumerate(self.request_ids)}
        return self._index


@dataclass(slots=True)
class InFlightStep:
    """A launched step: its plan, the requests that sampled in it, their tokens (on the device; `listed` when the
    host already has them), and the copy to the host under way."""

    plan: SchedulerOutput
    sampling: list[Request] = field(default_factory=list)
    tokens: torch.Tensor | None = None
    listed: list[int] | None = None
    logprobs: list[SampledLogprobs | None] | None = None
    # Whether the next step may be planned before this one's tokens are read (every sampler `overlaps`, drew on
    # the device); the other conditions are the engine's state then (`AsyncSteps._may_overlap`).
    overlaps: bool = True
    # Every request of the plan `overlaps` and drew on the device: its finish is one pass (`record_alone`).
    alone: bool = False
    _host: torch.Tensor | None = None
    _copied: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        """Start copying the tokens to the host (on a GPU: into pinned memory, an event marking the end)."""
        tokens = self.tokens
        if tokens is None or self.listed is not None or tokens.device.type != "cuda":
            return
        self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        self._host.copy_(tokens, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def host_tokens(self) -> list[int]:
        """The tokens, waiting for the device only as long as the copy takes to arrive."""
        if self.listed is None:
            if self._copied is not None:
                self._copied.synchronize()
                self.listed = self._host.tolist()
            else:
                self.listed = [] if self.tokens is None else self.tokens.tolist()
        return self.listed


class AsyncSteps:
    """An engine's steps with async scheduling: at most one step in flight between calls (`in_flight`). It composes
    the core's steps (`EngineCore`) with the front's records (`OutputProcessor`) and calls (`StepFront`)."""

    def __init__(self, core: EngineCore, outputs: OutputProcessor, front: StepFront) -> None:
        self.core = core
        self.outputs = outputs
        self.front = front
        self.update_seconds = 0.0  # the host updating finished steps' requests (`stats()` adds the front's)
        self.in_flight: InFlightStep | None = None
        self.num_overlapped = 0  # steps planned while the one before ran (`stats()`)
        self.wait_seconds = 0.0  # the host waiting for sampled tokens

    def step(self) -> list[RequestOutput]:
        """Finish one step and return its reports; the next is launched before, where it may be."""
        front = self.front
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            if front.model_check_due():
                front.follow_model()
            plan = self.core.schedule()
            if not self._launchable(plan):
                return front.run_plan(plan)
            in_flight, reports = self._start(plan, None)
            if in_flight is None:
                return reports
        elif front.model_check_due():
            return self._finish(in_flight)
        if not self._may_overlap(in_flight):
            return self._finish(in_flight)
        plan = self.core.schedule()
        if not self._launchable(plan):  # finish the step in flight, then run this plan as the synchronous engine
            reports = self._finish(in_flight)
            plan.drop([s.request for s in plan.scheduled if s.request.status.is_finished])
            return _merged(reports, front.run_plan(plan))
        self.num_overlapped += 1
        following, failed = self._start(plan, in_flight)
        if following is None:  # it failed: the step in flight was finished first (`_start`)
            return failed
        self.in_flight = following
        return self._finish(in_flight)

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight, its reports for the next `step()` (before the engine's state is changed
        outside a step: a model check, a reset of the prefix cache, a preemption of every request). `close` drops
        it instead: its tokens would go to no one."""
        in_flight, self.in_flight = self.in_flight, None
        return [] if in_flight is None else self._finish(in_flight)

    def _launchable(self, plan: SchedulerOutput) -> bool:
        """Whether the plan's tokens can be left on the device at launch: each request samples alone (a fork's
        followers and a beam search's choice take their tokens on the host); a greedy_alone plan always can."""
        if plan.greedy_alone:
            return True
        sampling = [s for s in plan.scheduled if s.samples]
        return all(len(s.samples) < 2 for s in sampling) and None not in self.outputs.rows(
            [s.request for s in sampling]
        )

    def _may_overlap(self, step: InFlightStep) -> bool:
        """Whether the next step may be planned before `step` finishes (see the module docstring)."""
        if not step.overlaps:
            return False
        core = self.core
        if core.scheduler.swapped:
            return False
        checkpoints = core.coordinator.state_checkpoints
        if checkpoints is not None:
            interval = checkpoints.interval
            if any((request.num_computed_tokens + 1) % interval == 0 for request in step.sampling):
                return False
        return True

    def _start(
        self, plan: SchedulerOutput, in_flight: InFlightStep | None
    ) -> tuple[InFlightStep | None, list[RequestOutput]]:
        """Launch the plan. Where it fails, the step in flight finishes first (its tokens were drawn before), then
        the plan's requests fail as a synchronous step's do: (None, the reports of both)."""
        front, outputs = self.front, self.outputs
        try:
            return self._launch(plan), []
        except BaseException as exc:
            reports = []
            if in_flight is not None:
                reports = self._finish(in_flight)
                # A request that stopped there ended with its own reason: it leaves the failed plan.
                plan.drop([s.request for s in plan.scheduled if s.request.status.is_finished])
            interrupted = not isinstance(exc, Exception)
            reason = (
                f"the step was interrupted ({type(exc).__name__})"
                if interrupted
                else f"the step failed: {type(exc).__name__}: {exc}"
            )
            self.core.fail_step(plan, reason)
            # A request failed here is reported once, with its failure (not also with the step in flight's reports).
            failed = {request.group.request_id for request in plan.failed}
            reports = [report for report in reports if report.request_id not in failed]
            if interrupted:
                front.unclaimed.extend(reports)
                outputs.unreported.extend(outputs.state_of(request) for request in plan.failed)
                raise
            return None, _merged(reports, front.finish_step(plan, NOTHING_SAMPLED, outputs.take_unreported()))

    def _launch(self, plan: SchedulerOutput) -> InFlightStep:
        """Queue the plan's forward and sampling, advance its requests, make the KV side of its update."""
        core = self.core
        step = InFlightStep(plan)
        output = core.execute(plan)
        self.front.record_prompt_logprobs(output.prompt_logprobs)
        logits = output.logits
        if logits is not None and plan.sampling:
            self._draw(step, logits)
        for request, num_new, _ in plan.scheduled:
            request.num_computed_tokens += num_new
        # Every greedy_alone request overlaps: such a plan (most decode steps) needs no pass to say so.
        step.alone = step.overlaps and (plan.greedy_alone or all(s.request.overlaps for s in plan.scheduled))
        for request in step.sampling:
            request.num_pending_tokens += 1
        if step.tokens is not None:
            core.runner.pending_tokens = PendingTokens(step.tokens, [request.request_id for request in step.sampling])
            step.start_copy()
        core.update_blocks(plan)
        return step

    def _draw(self, step: InFlightStep, logits: torch.Tensor) -> None:
        """The step's tokens: drawn on the device where every row can be, else sampled as the synchronous engine
        samples (a row that fails fails its request alone: `EngineCore.sample_rows`)."""
        core = self.core
        sampling = step.plan.sampling
        if step.plan.greedy_alone:  # every row its argmax (what the synchronous engine's one-pass step takes)
            step.tokens = torch.as_tensor(sampler.greedy_tokens(logits), device=logits.device)
            step.sampling = sampling
            core.num_generated_tokens += len(sampling)
            return
        rows = self.outputs.rows(sampling)
        if all(request.overlaps for request in sampling):
            seeded = [(row.generator, row.generator.get_state()) for row in rows if row.generator is not None]
            try:
                step.tokens = draw_tokens(logits, rows)
                step.sampling = sampling
                core.num_generated_tokens += len(sampling)
                return
            except Exception:  # one row's parameters: sampled again row by row, from the same draws
                for generator, state in seeded:
                    generator.set_state(state)
        sampling, tokens, logprobs = core.sample_rows(logits, step.plan, sampling)
        core.num_generated_tokens += len(tokens)
        step.sampling, step.listed, step.logprobs, step.overlaps = sampling, tokens, list(logprobs), False
        step.tokens = torch.tensor(tokens, dtype=torch.long, device=logits.device)

    def _finish(self, step: InFlightStep) -> list[RequestOutput]:
        """Read the step's tokens and update its requests as the synchronous engine's update does; a request that
        stops is first taken back from the step launched after this one (`in_flight`). The step's reports."""
        core, outputs = self.core, self.outputs
        wait_start = time.perf_counter()
        tokens = step.host_tokens()
        start = time.perf_counter()
        self.wait_seconds += start - wait_start
        following = self.in_flight
        if step.alone and not outputs.unreported and not step.plan.failed:
            # Every request sampled alone with nothing but its token to record: one pass (`record_alone`).
            reports, stopped = outputs.record_alone(step.plan, tokens, advance=False)
            for request, status, state in stopped:
                if following is not None:
                    self._take_back(following, request)
                core.finish(request, status)
                outputs.output(state)
            self._drop_if_taken_back()
            self.update_seconds += time.perf_counter() - start
            return reports
        logprobs = step.logprobs or [None] * len(tokens)
        live: list[Request] = []
        live_tokens: list[int] = []
        live_logprobs: list[SampledLogprobs | None] = []
        for request, token, token_logprobs in zip(step.sampling, tokens, logprobs, strict=True):
            if request.status.is_finished:  # aborted, or failed, since its launch
                continue
            request.num_pending_tokens -= 1
            request.append_token(token)
            live.append(request)
            live_tokens.append(token)
            live_logprobs.append(token_logprobs)
        for request, status, error in outputs.process(live, live_tokens, live_logprobs):
            if following is not None:
                self._take_back(following, request)
            core.finish(request, status, error)
        self._drop_if_taken_back()
        reports = outputs.reports(step.plan, outputs.take_unreported())
        self.update_seconds += time.perf_counter() - start
        return reports

    def _drop_if_taken_back(self) -> None:
        """A step in flight whose every request finished computes nothing anyone reads: dropped, so that an engine
        with no unfinished request has nothing in flight."""
        following = self.in_flight
        if following is not None and all(s.request.status.is_finished for s in following.plan.scheduled):
            self.in_flight = None

    @staticmethod
    def _take_back(following: InFlightStep, request: Request) -> None:
        """A request stopped while `following` computes for it: its count goes back to before that step, whose
        token it drops (its blocks and state slot go when it finishes)."""
        for scheduled, num_new, samples in following.plan.scheduled:
            if scheduled is request:
                request.num_computed_tokens -= num_new
                if samples:
                    request.num_pending_tokens -= 1
                return


def _merged(first: list[RequestOutput], second: list[RequestOutput]) -> list[RequestOutput]:
    """Two steps' reports as one call's: a request reported by both (its live record, updated in place) once."""
    seen = {id(report) for report in first}
    return first + [report for report in second if id(report) not in seen]
