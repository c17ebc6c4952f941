"""The engine: requests in (`add_request`, `abort`, `abort_all`), the step loop (schedule -> swap copies ->
one forward -> sample -> update -> outputs) and `stats`.

What comes before and after a step lives beside it: `inputs.py` (prompts into checked ids),
`output_processor.py` (text, logprobs, stop decisions, outputs), `loops.py` (`generate`, `chat`,
`stream`: loops over steps), `stream.py` (a streamed request), `sizing.py` (the pool's size).

Every public call is `exclusive` (one thread at a time; none after `unpatch`). Nothing is lost on the
way out: a request whose call fails or is interrupted (KeyboardInterrupt) is aborted, and every block it
held returns to the pool.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from hybridkv.config import EngineConfig
from hybridkv.coordinator import KVCacheCoordinator
from hybridkv.exclusive import exclusive
from hybridkv.inputs import InputProcessor, Prompt, eos_token_ids
from hybridkv.loops import RunLoops
from hybridkv.model_runner import ModelRunner
from hybridkv.output_processor import OutputProcessor, RequestState
from hybridkv.outputs import RequestOutput, TokenLogprobs
from hybridkv.request import Request, RequestStatus, SampleGroup
from hybridkv.sampler import sample_each
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from hybridkv.sizing import kv_layout, min_num_blocks, num_kv_blocks
from hybridkv.stats import engine_stats
from hybridkv.stopping import StopRules

__all__ = ["EngineConfig", "LLMEngine", "Prompt", "min_num_blocks"]


class LLMEngine(RunLoops):
    """A continuous-batching engine bound to one Hugging Face model (see `hybridkv.patch`); `generate`,
    `chat` and `stream` come from `RunLoops` (hybridkv/loops.py)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.layer_dtypes, layout, self.kv_config, self.max_model_len = kv_layout(model, config)
        self.bytes_per_block = self.kv_config.block_bytes
        num_blocks = num_kv_blocks(model, config, self.kv_config, self.max_model_len)
        num_swap_blocks = min(config.swap_space // self.bytes_per_block, num_blocks - 1)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            preemption_mode=config.preemption_mode,
            num_swap_blocks=num_swap_blocks,
        )
        self.coordinator = KVCacheCoordinator(self.kv_config, num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.coordinator)
        self.runner = ModelRunner(
            model, self.kv_config, layout.module_names, num_blocks, self.layer_dtypes, config.attention_backend
        )
        self.runner.allocate_swap_space(num_swap_blocks)
        self.inputs = InputProcessor(model, tokenizer)
        stop_rules = StopRules(eos_token_ids(model, tokenizer), self.max_model_len)
        self.outputs = OutputProcessor(tokenizer, stop_rules, self.runner.input_device)
        # Requests that ended outside a step's outputs (rejected at add, failed by an interrupted step):
        # the next step reports them.
        self._unreported: list[RequestState] = []
        self._unclaimed: list[RequestOutput] = []
        # Streams dropped while an engine call was under way: aborted when the next call begins.
        self._pending_aborts: deque[str] = deque()
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._depth = 0  # engine calls under way in the owning thread (they nest)
        self._closed = False
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.step_seconds = 0.0
        self.schedule_seconds = 0.0
        self.update_seconds = 0.0

    # ---- requests -----------------------------------------------------------------------------

    @exclusive
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request (text needs the tokenizer given to patch); returns its id. A request that
        can never run finishes at once with an error, reported by the next step."""
        return self._enqueue(*self._checked_request(prompt, params, request_id))

    def _checked_request(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None
    ) -> tuple[str, str | None, list[int], SamplingParams]:
        """Everything add_request checks, before anything is queued: a ValueError or TypeError naming the fix."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a hybridkv.SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = next(i for i in map(str, self._ids) if i not in self.outputs.states)
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}: pass str(...)")
        elif request_id in self.outputs.states:
            raise ValueError(f"request id {request_id!r} is already in use; give each request its own id")
        prompt_text, prompt_ids = self.inputs.tokenize(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to hybridkv.patch, or use stop_token_ids")
        vocab_size = self.inputs.vocab_size
        if params.logprobs is not None and params.logprobs > vocab_size:
            raise ValueError(
                f"logprobs={params.logprobs} asks for more tokens than the vocabulary has ({vocab_size}); "
                f"ask for at most {vocab_size}"
            )
        return request_id, prompt_text, prompt_ids, params

    def _enqueue(self, request_id: str, prompt_text: str | None, prompt_ids: list[int], params: SamplingParams) -> str:
        block_size = self.config.block_size if self.config.enable_prefix_caching else None
        group = SampleGroup.of(request_id, prompt_ids, params, block_size)
        state = self.outputs.add(group, prompt_text)
        if not self.scheduler.add_request(group.leader):
            self._unreported.append(state)
        return request_id

    @exclusive
    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; every block it held, on the device or in swap space, is returned."""
        return self._abort(request_id)

    @exclusive
    def abort_all(self) -> list[RequestOutput]:
        """Abort every unfinished request (e.g. after an interrupted loop of your own); returns their outputs."""
        return [self._abort(request_id) for request_id in list(self.outputs.states)]

    def _abort(self, request_id: str) -> RequestOutput | None:
        state = self.outputs.states.get(request_id)
        if state is None:
            return None
        self.scheduler.finish_group(state.group, RequestStatus.FINISHED_ABORTED)
        return self.outputs.output(state)

    def _release_stream(self, request_id: str) -> None:
        """A stream was closed or dropped before its request finished: abort the request now if no engine
        call is under way, else when the next call begins (a stream can be collected by the garbage
        collector in the middle of a call, or in another thread)."""
        if self._closed:
            return
        if not self._lock.acquire(blocking=False):
            self._pending_aborts.append(request_id)
            return
        try:
            if self._depth:
                self._pending_aborts.append(request_id)
            else:
                self._abort(request_id)
        finally:
            self._lock.release()

    def _abort_released_streams(self) -> None:
        """Called by `exclusive` when a call begins: the aborts `_release_stream` had to put off."""
        while self._pending_aborts:
            self._abort(self._pending_aborts.popleft())

    def close(self) -> None:
        """Release the pool's blocks now: they link each other, so only the cycle collector would
        free them otherwise, in a pause of its own choosing (measured 250 ms for ~24k blocks)."""
        self.coordinator.pool.close()
        self._closed = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.states)

    # ---- the step -----------------------------------------------------------------------------

    @exclusive
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step. Returns the state of every request that produced tokens or
        finished in it (finished ones for the last time): each request's live record, updated in place
        by later steps."""
        start = time.perf_counter()
        touched = {state.group.request_id: state for state in self._unreported}
        self._unreported = []
        plan = self.scheduler.schedule()
        self.schedule_seconds += time.perf_counter() - start
        try:
            tokens, logprobs = self._execute(plan)
        except Exception as exc:  # the model or a kernel failed: fail this step's requests, keep serving
            self._fail(plan, [s.request for s in plan.scheduled], f"the step failed: {type(exc).__name__}: {exc}")
            tokens, logprobs = [], []
        except BaseException as exc:  # interrupted (Ctrl-C): the step's copies and tokens may be half done,
            # so its requests fail, and so do those whose swap copies it made.
            swapped_out = [r for r in plan.preempted if r.status is RequestStatus.SWAPPED]
            touched_by_step = [*(s.request for s in plan.scheduled), *plan.swapped_in, *swapped_out]
            self._fail(plan, touched_by_step, f"the step was interrupted ({type(exc).__name__})")
            self._unreported.extend(touched.values())
            self._unreported.extend(self.outputs.state_of(request) for request in plan.failed)
            raise
        update_start = time.perf_counter()
        sampling = plan.sampling
        self.scheduler.update(plan, tokens)
        for request, status in self.outputs.process(sampling, tokens, logprobs):
            self.scheduler.finish(request, status)
        for request in itertools.chain((s.request for s in plan.scheduled), plan.failed):
            state = self.outputs.state_of(request)
            touched.setdefault(state.group.request_id, state)
        end = time.perf_counter()
        self.update_seconds += end - update_start
        self.step_seconds += end - start
        unclaimed, self._unclaimed = self._unclaimed, []
        # A request reported finished already (e.g. aborted while waiting to be reported) is not reported again.
        return unclaimed + [self.outputs.output(state) for state in touched.values() if not state.output.finished]

    def _execute(self, plan: SchedulerOutput) -> tuple[list[int], Sequence[TokenLogprobs | None]]:
        """Swap copies, the forward and sampling: the sampled tokens align with `plan.sampling` (a
        request whose sampling fails is failed and leaves the plan)."""
        self.runner.swap(plan.swap_out, plan.swap_in)
        if not plan.scheduled:
            return [], []
        logits = self.runner.execute(plan)
        self.num_steps += 1
        sampling = plan.sampling
        if not sampling:
            return [], []
        tokens, logprobs = self._sample(logits, plan, sampling)
        self.num_generated_tokens += len(tokens)
        return tokens, logprobs

    def _sample(
        self, logits: torch.Tensor, plan: SchedulerOutput, sampling: list[Request]
    ) -> tuple[list[int], Sequence[TokenLogprobs | None]]:
        """Tokens for the requests still in `sampling` afterwards; one request's parameters never fail the
        others: a request whose row fails is failed with its samples and leaves the plan, and so do the
        tokens its samples drew."""
        tokens, logprobs, errors = sample_each(logits, self.outputs.sampling_rows(sampling))
        for request, error in zip(sampling, errors, strict=True):
            if error is not None and not request.status.is_finished:
                self._fail(plan, [request], f"sampling failed: {type(error).__name__}: {error}")
        kept = [i for i, request in enumerate(sampling) if not request.status.is_finished]
        return [tokens[i] for i in kept], [logprobs[i] for i in kept]

    def _fail(self, plan: SchedulerOutput, requests: Sequence[Request], error: str) -> None:
        """Fail the requests with every sample of their groups, and take them out of the plan."""
        failed = []
        for request in requests:
            failed.extend(self.scheduler.finish_group(request.group, RequestStatus.FINISHED_ERROR, error))
        plan.failed.extend(failed)
        plan.drop(failed)

    # ---- stats --------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """KV usage, prefix-cache use, preemptions and throughput since the engine was built."""
        return engine_stats(self)
