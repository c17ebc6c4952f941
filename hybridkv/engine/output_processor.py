"""The output side of the engine: one record per sample (its request, detokenizer, logprobs, generator,
stream offset), the stop decision after each new token, and the `RequestOutput`s the engine returns.

Outputs are built incrementally: each sample's `CompletionOutput` is kept and extended by its new
tokens, so a long generation costs constant work per token. A `RequestOutput` is the request's live
record: later steps update the same object until it is finished.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, StreamDelta
from hybridkv.sampling.sampler import SampledLogprobs, SamplingRow
from hybridkv.sampling.structured_outputs import CompiledGrammar
from hybridkv.scheduling.detokenizer import IncrementalDetokenizer
from hybridkv.scheduling.output import SchedulerOutput
from hybridkv.scheduling.request import Request, RequestStatus, SampleGroup
from hybridkv.scheduling.stopping import StopRules


@dataclass(slots=True)
class SampleState:
    """One sample (`OutputProcessor.samples[request]`): its scheduler request, what the sampler reads for it (`row`:
    params, generator, tokens so far, grammar matcher), its text, its output record, its request's metrics (shared
    by the request's samples), how much of it a stream has yielded, and its request's state (`RequestState`,
    whose output the engine reports: set once that is made)."""

    request: Request
    row: SamplingRow
    detokenizer: IncrementalDetokenizer | None
    completion: CompletionOutput
    metrics: RequestMetrics
    num_streamed_tokens: int = 0
    state: RequestState | None = None


@dataclass(slots=True)
class RequestState:
    """One user request: its samples (a SampleGroup, or several `parts` when it has more than max_num_seqs:
    `SampleGroup.parts`; `group` is the first) and the output record the engine hands out."""

    parts: list[SampleGroup]
    samples: list[SampleState]
    output: RequestOutput

    @property
    def group(self) -> SampleGroup:
        return self.parts[0]

    @property
    def members(self) -> list[Request]:
        return self.group.members if len(self.parts) == 1 else [m for part in self.parts for m in part.members]


class OutputProcessor:
    """Records of every unfinished request, keyed by its id, and of those that ended outside a step
    (`unreported`: rejected when added, failed by an interrupted step), which the next step reports."""

    def __init__(
        self,
        tokenizer: Any,
        stop_rules: StopRules,
        device: torch.device,
        samples: dict[Request, SampleState] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop_rules = stop_rules
        self.device = device
        self.states: dict[str, RequestState] = {}
        # Each unfinished sample's record, by its request (a beam search's beams have none: their search samples).
        self.samples: dict[Request, SampleState] = {} if samples is None else samples
        self.unreported: list[RequestState] = []
        self._decoded: dict[int, str | None] = {}  # token id -> its text alone (Logprob.decoded_token)
        # stats(): the prompt tokens of the requests added, and the samples finished, by finish reason.
        self.num_prompt_tokens = 0
        self.finished_samples: Counter[str] = Counter()

    def add(self, parts: list[SampleGroup], prompt: str | None, grammar: CompiledGrammar | None = None) -> RequestState:
        """Records for a new request's samples, in its groups `parts` (one, but where it has more samples than
        max_num_seqs); a seeded request's sample i draws from seed + i; each sample of a structured-outputs request
        gets its own matcher of `grammar`; a beam search has none: its output lists its hypotheses once it has
        finished."""
        group = parts[0]
        leader = group.leader
        params = leader.params
        prompt_ids = leader.token_ids[: leader.num_prompt_tokens]
        self.num_prompt_tokens += len(prompt_ids)
        metrics = RequestMetrics(arrival_time=time.monotonic())
        samples = []
        members = [m for part in parts for m in part.members] if group.beam is None else []
        held_until_min_tokens = self.stop_rules.held_until_min_tokens(params)
        for request in members:
            index = request.sample_index
            generator = None if params.seed is None else torch.Generator(self.device).manual_seed(params.seed + index)
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_ids,
                    params.stop,
                    params.skip_special_tokens,
                    params.include_stop_str_in_output,
                )
            logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
            matcher = grammar.matcher() if grammar is not None else None
            row = SamplingRow(
                params, generator, request.token_ids, request.num_prompt_tokens, matcher, held_until_min_tokens
            )
            request.greedy_alone = row.plain_greedy and len(members) == 1
            # Implied by greedy_alone (async scheduling's steps of greedy_alone requests take their argmax alone). The
            # min_tokens mask reads the number of output tokens, which a pending token leaves one short: a request
            # overlaps from its min_tokens-th token on (`process`).
            request.overlaps = _overlaps(row, len(members)) and not held_until_min_tokens
            sample = self.samples[request] = SampleState(
                request=request,
                row=row,
                detokenizer=detokenizer,
                completion=CompletionOutput(index=index, text="", token_ids=[], logprobs=logprobs),
                metrics=metrics,
            )
            samples.append(sample)
        prompt_logprobs = getattr(params, "prompt_logprobs", None)
        output = RequestOutput(
            request_id=group.request_id,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            # Filled position by position as the prompt is computed (`record_prompt_logprobs`); the first stays None.
            prompt_logprobs=[None] * len(prompt_ids) if prompt_logprobs is not None else None,
            outputs=[sample.completion for sample in samples],
            finished=False,
            metrics=metrics,
        )
        state = RequestState(parts, samples, output)
        for sample in samples:
            sample.state = state
        self.states[group.request_id] = state
        return state

    def state_of(self, request: Request) -> RequestState:
        return self.states[request.group.request_id]

    def logprob_dict(self, token: int, logprobs: SampledLogprobs) -> dict[int, Logprob]:
        """vLLM's dict for one position: the token with its rank, then the k most likely (ranks 1..k)."""
        decoded = self._decoded_token
        entries = {token: Logprob(logprobs.logprob, logprobs.rank, decoded(token))}
        for rank, (top_id, value) in enumerate(zip(logprobs.top_ids, logprobs.top_logprobs, strict=True), start=1):
            entries[top_id] = Logprob(value, rank, decoded(top_id))
        return entries

    def _decoded_token(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._decoded.get(token)
        if text is None:
            text = self._decoded[token] = self.tokenizer.decode([token])
        return text

    def record_prompt_logprobs(
        self, request: Request, first_position: int, logprobs: Sequence[SampledLogprobs]
    ) -> None:
        """The prompt logprobs of positions `first_position`, `first_position + 1`, ... of a request (a prompt
        computed again after a preemption writes the same values again)."""
        output = self.state_of(request).output
        if output.prompt_logprobs is None:
            return
        tokens = request.token_ids
        for position, entry in enumerate(logprobs, start=first_position):
            output.prompt_logprobs[position] = self.logprob_dict(tokens[position], entry)

    def process(
        self, requests: Sequence[Request], tokens: Sequence[int], logprobs: Sequence[SampledLogprobs | None]
    ) -> list[tuple[Request, RequestStatus, str | None]]:
        """Record each request's new token (already appended to the request) and its logprobs, extend its
        text, advance its grammar, and decide whether it stops (a completed grammar stops it). Returns the
        requests that stop, with their status and error: the caller finishes them in the scheduler. (A step of
        `greedy_alone` requests does this in `record_alone`'s one pass: keep the two alike.)"""
        now = time.monotonic()
        stopped = []
        check = self.stop_rules.check
        records = self.samples
        for request, token, token_logprobs in zip(requests, tokens, logprobs, strict=True):
            sample = records[request]
            completion = sample.completion
            matcher = sample.row.matcher
            if matcher is not None and (error := matcher.accept(token)) is not None:
                # A token its grammar refuses (a grammar the vocabulary cannot write): never part of the output.
                stopped.append((request, RequestStatus.FINISHED_ERROR, f"structured outputs: {error}"))
                continue
            completion.token_ids.append(token)
            if token_logprobs is not None:
                completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + token_logprobs.logprob
                if completion.logprobs is not None:
                    completion.logprobs.append(self.logprob_dict(token, token_logprobs))
            if sample.metrics.first_token_time is None:
                sample.metrics.first_token_time = now
            status = check(request, token, sample.detokenizer)
            if sample.row.min_tokens_ids and len(completion.token_ids) == request.params.min_tokens:
                request.overlaps = _overlaps(sample.row, len(sample.state.samples))
            if status is None and matcher is not None and matcher.is_complete:
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                stopped.append((request, status, None))
        return stopped

    def record_alone(
        self, plan: SchedulerOutput, tokens: list[int], advance: bool
    ) -> tuple[list[RequestOutput], list[tuple[Request, RequestStatus, RequestState]]]:
        """A step whose every request is `greedy_alone` (no beam, fork, grammar or logprobs to record; each is its
        group's only sample, so its report is its own) in one pass: each request advances (`advance`; an async step's
        requests advanced at launch, and each token it appends was pending), takes and records its token and is
        checked for a stop as `Scheduler.update` and `process` would. The reports (live records) and the requests
        that stopped, with their states, not finished yet. With `advance` False a request that finished since the
        step's launch (aborted) is passed over, its token dropped. Most decode steps take it: one pass instead of
        four, each of which met every request's records cold after the forward."""
        check = self.stop_rules.check
        now = time.monotonic()
        next_token = iter(tokens).__next__
        records = self.samples
        reports: list[RequestOutput] = []
        stopped: list[tuple[Request, RequestStatus, RequestState]] = []
        for request, num_new, samples in plan.scheduled:
            if advance:
                request.num_computed_tokens += num_new
            elif request.status.is_finished:
                if samples:
                    next_token()
                continue
            sample = records[request]
            state = sample.state
            reports.append(state.output)  # the live record: a stopped request's is finished by the caller, in place
            if samples:
                token = next_token()
                if not advance:
                    request.num_pending_tokens -= 1
                request.append_token(token)
                sample.completion.token_ids.append(token)
                if sample.metrics.first_token_time is None:
                    sample.metrics.first_token_time = now
                status = check(request, token, sample.detokenizer)
                if status is not None:
                    stopped.append((request, status, state))
                    continue
            if sample.detokenizer is not None:  # what `output` reads into an unfinished record
                sample.completion.text = sample.detokenizer.text
            sample.metrics.num_cached_tokens = request.num_cached_tokens
        return reports, stopped

    def rows(self, requests: Sequence[Request]) -> list[SamplingRow | None]:
        """What the sampler reads for each request (None for a beam: its row goes to its beam search)."""
        return sampling_rows(self.samples, requests)

    def take_unreported(self) -> dict[str, RequestState]:
        """The requests that ended outside a step, by id (the next step's reports start with them)."""
        if not self.unreported:  # most steps
            return {}
        touched = {state.group.request_id: state for state in self.unreported}
        self.unreported = []
        return touched

    def reports(self, plan: SchedulerOutput, touched: dict[str, RequestState]) -> list[RequestOutput]:
        """A step's reports: each request it `touched` (those that ended outside it first), then its own and its
        failed ones, each once; a request reported finished already (e.g. aborted while waiting to be reported) is not
        reported again."""
        states = self.states
        for request in [s.request for s in plan.scheduled] + plan.failed:
            request_id = request.group.request_id
            if request_id not in touched and request_id in states:
                touched[request_id] = states[request_id]
        return [self.output(state) for state in touched.values() if not state.output.finished]

    def output(self, state: RequestState) -> RequestOutput:
        """The request's output as of now; a finished request's records are dropped."""
        output = state.output
        for sample in state.samples:
            request, completion, detokenizer = sample.request, sample.completion, sample.detokenizer
            if request.status.is_finished and completion.finish_reason is None:
                if detokenizer is not None:
                    detokenizer.flush()
                completion.finish_reason = request.status.value
                completion.stop_reason = request.stop_reason
            if detokenizer is not None:
                completion.text = detokenizer.text
        group = state.group
        leader = group.leader
        metrics = output.metrics
        metrics.num_cached_tokens = leader.num_cached_tokens
        metrics.prefix_cache_tiers, metrics.prefix_cache_miss = leader.prefix_cache_tiers, leader.prefix_cache_miss
        if not leader.status.is_finished and len(group.members) == 1 and len(state.parts) == 1:  # nothing has ended
            return output
        members = state.members
        output.error = next((m.error for m in members if m.error), None)
        if all(m.status.is_finished for m in members) and not output.finished:
            params = leader.params
            if group.beam is not None:  # a beam search: its best hypotheses, best first
                output.outputs = group.beam.outputs(self.tokenizer)
            elif params.num_samples > params.n:  # best_of: the n samples of highest cumulative logprob
                ranked = sorted(output.outputs, key=_cumulative_logprob, reverse=True)
                output.outputs = ranked[: params.n]
            output.finished = True
            output.metrics.finished_time = time.monotonic()
            self.finished_samples.update(completion.finish_reason or "error" for completion in output.outputs)
            self.states.pop(group.request_id, None)
            for sample in state.samples:
                self.samples.pop(sample.request, None)
        return output

    def stream_deltas(self, state: RequestState) -> list[StreamDelta]:
        """What each sample produced since the last call: new token ids and text (text that may still
        become a stop string is held back until it cannot)."""
        deltas = []
        for sample in state.samples:
            completion = sample.completion
            start = sample.num_streamed_tokens
            new_tokens = completion.token_ids[start:]
            sample.num_streamed_tokens = len(completion.token_ids)
            finished = completion.finished()
            text = sample.detokenizer.stream_delta(finished) if sample.detokenizer is not None else ""
            if new_tokens or text or finished:
                error = sample.request.error if finished else None
                logprobs = completion.logprobs[start:] if completion.logprobs is not None else None
                deltas.append(
                    StreamDelta(completion.index, new_tokens, text, completion.finish_reason, error, logprobs)
                )
        return deltas


def sampling_rows(samples: dict[Request, SampleState], requests: Sequence[Request]) -> list[SamplingRow | None]:
    """What the sampler reads for each request, from the records `samples` (None for a beam)."""
    get = samples.get
    found: list[SamplingRow | None] = []
    for request in requests:
        sample = get(request)
        found.append(None if sample is None else sample.row)
    return found


def _overlaps(row: SamplingRow, num_samples: int) -> bool:
    """Whether a sample's next token may be drawn on the device before its last is read (`Request.overlaps`): it is
    its request's only sample and its draw needs nothing but its logits (no grammar, penalty or logprobs)."""
    params = row.params
    return num_samples == 1 and row.matcher is None and not params.has_penalties and not params.needs_logprob


def _cumulative_logprob(completion: CompletionOutput) -> float:
    return float("-inf") if completion.cumulative_logprob is None else completion.cumulative_logprob
