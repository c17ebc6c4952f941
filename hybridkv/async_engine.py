"""`AsyncLLMEngine`: one `LLMEngine` served to any number of callers, from threads or asyncio loops.

One background thread owns the engine and runs its step loop while there is work. Callers never touch
the engine: `submit` checks a request in the caller's thread (bad input raises there, at once) and puts
it in the thread's inbox; results come back through a `RequestHandle`: a future for the final output
(`handle.result()` from a thread, `await handle` from any running event loop, Jupyter's included),
the request's `StreamDelta`s (`async for delta in handle.deltas()`) and its `RequestOutput`s (`async for output in
handle.outputs()`, what vLLM's `AsyncLLM.generate` yields: `engine.generate` is that), each holding what the request's
`output_kind` says: everything so far, only what is new, or only the final one.
Abandoning a stream (closing it, cancelling its task, dropping it) or `handle.abort()` aborts the request and
returns its blocks; a handle aborts only its own request, never another that holds the same id (a refused
duplicate, or a later request that took a finished one's id). A failing step fails only its requests (the
engine's rule); an unexpected error in the loop fails the requests in flight and the loop keeps serving.
`shutdown()` aborts what runs and stops the thread.

`AsyncLLM` is the same engine under vLLM v1's name, made from `AsyncEngineArgs` (`AsyncLLM.from_engine_args`), with
vLLM's coroutine `abort`; arguments that name a pooling model give an `AsyncPoolingLLM` (`encode`,
hybridkv/engine/async_pooling.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import queue
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

from hybridkv.engine.async_pooling import AsyncPoolingLLM
from hybridkv.engine.binding import unbind_engine
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.outputs import CompletionOutput, RequestOutput, StreamDelta
from hybridkv.sampling.beam_search import BeamSearchParams
from hybridkv.scheduling.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from hybridkv.engine.arg_utils import EngineArgs
    from hybridkv.engine.output_processor import RequestState
    from hybridkv.execution.inputs import Prompt


class RequestHandle:
    """One submitted request: its id, its final output (a future), its deltas and its outputs as they come."""

    def __init__(
        self, engine: AsyncLLMEngine, request_id: str, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    ) -> None:
        self.request_id = request_id
        self.output_kind = output_kind
        self._engine = engine
        self._future: concurrent.futures.Future[RequestOutput] = concurrent.futures.Future()
        self._deltas: deque[StreamDelta] = deque()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._lock = threading.Lock()
        self._done = False
        # With a reader of `outputs()`: a copy of the request's output as of its latest step, and how many steps
        # changed it (the engine thread updates the live record in place, so a reader gets copies).
        self._wants_outputs = False
        self._latest: RequestOutput | None = None
        self._version = 0
        self.state: RequestState | None = None  # set by the engine thread when the request is queued

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The finished request's output (blocks this thread until then); raises what failed its submission."""
        return self._future.result(timeout)

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()

    def abort(self) -> None:
        """Stop this handle's request; its blocks return to the pool (thread-safe). Nothing if it already finished or
        was refused: a request that took its id since, or holds it still (a refused duplicate's), runs on."""
        self._engine._post(("abort", self))

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        """Each sample's new tokens and text as the engine produces them, until the request ends. Leaving
        the loop early (break, cancellation, closing the iterator) aborts the request."""
        async with self._waiting() as event:
            while True:
                while self._deltas:
                    yield self._deltas.popleft()
                if self._done and not self._deltas:
                    return
                await event.wait()
                event.clear()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The request's output after each step that changed it, the last one finished: what vLLM's `AsyncLLM.generate`
        yields. As its `output_kind` says: cumulative (each holds everything so far: a reader slower than the engine
        gets the latest), deltas (each holds only the tokens, text and logprobs new since the last, of the samples
        that have some; the last holds every sample with its finish reason), or the final output alone. Leaving the
        loop early aborts the request; a failed submission raises here."""
        if self.output_kind is RequestOutputKind.DELTA:
            async for output in self._delta_outputs():
                yield output
            return
        self._wants_outputs = self.output_kind is RequestOutputKind.CUMULATIVE
        seen = 0
        async with self._waiting() as event:
            while not self._done:
                if self._version != seen:
                    seen = self._version
                    latest = self._latest
                    if latest is not None and not latest.finished:
                        yield latest
                await event.wait()
                event.clear()
            yield await asyncio.wrap_future(self._future)

    async def _delta_outputs(self) -> AsyncIterator[RequestOutput]:
        """`outputs()` for `RequestOutputKind.DELTA`: the deltas that came since the last output, as one."""
        first = True
        async with self._waiting() as event:
            while True:
                done = self._done  # read first: a request's last deltas are queued before it is done
                deltas = [self._deltas.popleft() for _ in range(len(self._deltas))]
                if done:
                    yield self._delta_output(deltas, await asyncio.wrap_future(self._future), first)
                    return
                if deltas:
                    yield self._delta_output(deltas, None, first)
                    first = False
                await event.wait()
                event.clear()

    def _delta_output(self, deltas: list[StreamDelta], final: RequestOutput | None, first: bool) -> RequestOutput:
        """One output of the `deltas` (the request's `final` output, finished, when it ended); the prompt's logprobs
        come with the first output only."""
        samples: dict[int, CompletionOutput] = {}
        for delta in deltas:
            sample = samples.get(delta.index)
            if sample is None:
                sample = samples[delta.index] = CompletionOutput(delta.index, "", [])
            sample.text += delta.text
            sample.token_ids += delta.token_ids
            if delta.logprobs is not None:
                sample.logprobs = (sample.logprobs or []) + delta.logprobs
            sample.finish_reason = delta.finish_reason or sample.finish_reason
        # The live record's prompt fields are set once, before any delta; the engine thread updates the rest.
        source = final if final is not None else self.state.output if self.state is not None else None
        assert source is not None, "a delta comes only for a queued request"
        if final is not None:  # every sample, with its finish, and what was new of it
            for done in final.outputs:
                sample = samples.setdefault(done.index, CompletionOutput(done.index, "", []))
                sample.cumulative_logprob = done.cumulative_logprob
                sample.finish_reason, sample.stop_reason = done.finish_reason, done.stop_reason
            samples = {done.index: samples[done.index] for done in final.outputs}
        return RequestOutput(
            source.request_id,
            source.prompt,
            list(source.prompt_token_ids),
            copy.deepcopy(source.prompt_logprobs) if first else None,
            list(samples.values()),
            final is not None,
            copy.deepcopy(source.metrics),
            final.error if final is not None else None,
        )

    @contextlib.asynccontextmanager
    async def _waiting(self) -> AsyncIterator[asyncio.Event]:
        """An event the engine thread sets whenever the request has news; leaving before the request ended aborts
        it."""
        event = asyncio.Event()
        waiter = (asyncio.get_running_loop(), event)
        with self._lock:
            self._waiters.append(waiter)
        try:
            yield event
        finally:
            with self._lock:
                self._waiters.remove(waiter)
            if not self._done:
                self.abort()

    # ---- called by the engine thread ----------------------------------------------------------

    def _push(self, deltas: list[StreamDelta], output: RequestOutput | None) -> None:
        self._deltas.extend(deltas)
        if output is not None and self._wants_outputs and not output.finished:
            self._latest = copy.deepcopy(output)
            self._version += 1
        if output is not None and output.finished:
            self._done = True
            self._future.set_result(output)
        self._wake_waiters()

    def _fail(self, exc: BaseException) -> None:
        self._done = True
        if not self._future.done():
            self._future.set_exception(exc)
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for loop, event in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)


class AsyncLLMEngine:
    """Serves `llm` from a background thread (see the module docstring). Use `submit` / `generate`, not
    `llm`'s own methods, while it runs: the engine refuses a second thread."""

    def __init__(self, llm: LLMEngine) -> None:
        self.llm = llm
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._handles: dict[str, RequestHandle] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None,
        lora_request: Any = None,
    ) -> RequestHandle:
        """Queue a request; returns its handle at once. Bad input raises here (ValueError / TypeError
        naming the fix), before anything is queued. A beam search's handle has no deltas: its sequences
        come with the finished output (`BeamSearchOutput.of(output, params)`)."""
        if self._stopping or self.llm.closed:
            raise RuntimeError(
                "this AsyncLLMEngine was shut down (or its model unpatched); make a new one over a patched model"
            )
        request_id = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        checked = self.llm.check_request(
            prompt, sampling_params, request_id, follow_model=False, lora_request=lora_request
        )
        output_kind = RequestOutputKind.CUMULATIVE
        if isinstance(sampling_params, SamplingParams):
            output_kind = sampling_params.output_kind
            if output_kind is RequestOutputKind.DELTA and sampling_params.num_samples > sampling_params.n:
                raise ValueError(
                    f"best_of={sampling_params.best_of} > n={sampling_params.n} has no deltas: the best samples are "
                    "known only at the end; use output_kind=RequestOutputKind.FINAL_ONLY, or best_of=n"
                )
        handle = RequestHandle(self, request_id, output_kind)
        self._post(("add", handle, checked))
        return handle

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None,
        lora_request: Any = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's `AsyncLLM.generate`: submit, then yield the request's cumulative output after each step that changed
        it, the last one finished (`RequestHandle.outputs`). `await engine.submit(...)` waits for the final output
        alone. `lora_request` runs it with that LoRA adapter (enable_lora). `priority` changes nothing here."""
        async for output in self.submit(prompt, sampling_params, request_id, lora_request).outputs():
            yield output

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def stats(self, timeout: float | None = 10.0) -> dict[str, Any]:
        """`llm.stats()`, taken by the engine thread between two steps (safe from any thread)."""
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._post(("call", self.llm.stats, future))
        return future.result(timeout)

    async def sleep(self, level: int = 1) -> None:
        """vLLM's `AsyncLLM.sleep`: `LLMEngine.sleep`, by the engine thread between two steps (the same errors)."""
        await self._between_steps(functools.partial(self.llm.sleep, level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's `AsyncLLM.wake_up`: `LLMEngine.wake_up`, by the engine thread between two steps."""
        await self._between_steps(functools.partial(self.llm.wake_up, tags))

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_disk: bool = False) -> bool:
        """vLLM's `AsyncLLM.reset_prefix_cache`: `LLMEngine.reset_prefix_cache`, by the engine thread between two
        steps (for a change to the model that no check sees)."""
        reset = functools.partial(self.llm.reset_prefix_cache, reset_running_requests, reset_disk)
        return await self._between_steps(reset)

    async def add_lora(self, lora_request: Any) -> bool:
        """vLLM's `AsyncLLM.add_lora`: read an adapter into the host cache ahead of its requests, in a worker thread
        while the engine keeps stepping (the adapter cache has its own lock, as `submit`'s check relies on); a
        ValueError names what is wrong with it. True."""
        await asyncio.to_thread(self.llm.core.adapter, lora_request)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        """vLLM's `AsyncLLM.remove_lora`: `LLMEngine.remove_lora`, by the engine thread between two steps (a request
        running the adapter keeps it); whether it was in the host cache."""
        return await self._between_steps(functools.partial(self.llm.remove_lora, lora_id))

    async def list_loras(self) -> set[int]:
        """vLLM's `AsyncLLM.list_loras`: the `lora_int_id`s of the adapters in the host cache."""
        return await self._between_steps(self.llm.list_loras)

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """vLLM's `AsyncLLM.collective_rpc`: `LLMEngine.collective_rpc`, by the engine thread between two steps."""
        return await self._between_steps(functools.partial(self.llm.collective_rpc, method, timeout, args, kwargs))

    async def is_sleeping(self) -> bool:
        """vLLM's `AsyncLLM.is_sleeping`."""
        return await self._between_steps(self.llm.is_sleeping)

    async def _between_steps(self, function: Callable[[], Any]) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._post(("call", function, future))
        return await asyncio.wrap_future(future)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort every request, stop the thread and wait for it (idempotent)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> AsyncLLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ---- the engine thread ----------------------------------------------------------------------

    def _post(self, message: tuple[Any, ...]) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _run(self) -> None:
        llm = self.llm
        # Held for the thread's life: a direct call on `llm` from another thread gets the engine's clear
        # "in use by another thread" error instead of racing this loop.
        with llm._lock:
            self._loop(llm)

    def _loop(self, llm: LLMEngine) -> None:
        while True:
            self._wake.clear()
            self._drain_inbox()
            if self._stopping or llm.closed:  # shut down, or the model was unpatched under us
                self._stopping = True
                break
            if not llm.has_unfinished_requests():
                self._wake.wait()
                continue
            try:
                outputs = llm.step()
            except Exception as exc:  # a bug outside what a step handles itself: fail what is in flight
                self._fail_all(RuntimeError(f"the engine loop failed: {type(exc).__name__}: {exc}"))
                continue
            for output in outputs:
                self._deliver(output)
        self._fail_all(RuntimeError("the AsyncLLMEngine was shut down"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = message[0]
            if kind == "add":
                self._add(*message[1:])
            elif kind == "abort":
                self._abort(message[1])
            else:
                self._call(*message[1:])

    def _add(self, handle: RequestHandle, checked: tuple[Any, ...]) -> None:
        request_id = checked[0]
        if request_id in self._handles or request_id in self.llm.outputs.states:
            handle._fail(ValueError(f"request id {request_id!r} is already in use; give each request its own id"))
            return
        try:
            self.llm.enqueue(checked)
        except Exception as exc:
            handle._fail(exc)
            return
        handle.state = self.llm.outputs.states[request_id]
        self._handles[request_id] = handle

    def _abort(self, target: str | RequestHandle) -> None:
        """Abort a request by its id, or a handle's own request: one that is still the running holder of its id."""
        if isinstance(target, RequestHandle):
            if self._handles.get(target.request_id) is not target:
                return
            target = target.request_id
        self._deliver(self.llm.abort(target))

    def _call(self, function: Callable[[], Any], future: concurrent.futures.Future) -> None:
        try:
            future.set_result(function())
        except Exception as exc:
            future.set_exception(exc)

    def _deliver(self, output: RequestOutput | None) -> None:
        if output is None:
            return
        handle = self._handles.get(output.request_id)
        if handle is None or handle.state is None:
            return
        if output.finished:
            del self._handles[output.request_id]
        handle._push(self.llm.outputs.stream_deltas(handle.state), output)

    def _fail_all(self, error: RuntimeError) -> None:
        """Abort every request in flight; its handle gets the aborted output, or `error` if none comes."""
        for request_id in list(self._handles):
            with contextlib.suppress(Exception):  # a closed engine (unpatched under us) refuses the abort
                self._deliver(self.llm.abort(request_id))
            handle = self._handles.pop(request_id, None)
            if handle is not None:
                handle._fail(error)


class AsyncLLM(AsyncLLMEngine):
    """vLLM v1's `AsyncLLM` (`vllm.v1.engine.async_llm`): an `AsyncLLMEngine` made from `AsyncEngineArgs`, whose
    `abort` is a coroutine taking one id or several, as vLLM's is."""

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, usage_context: Any = None, stat_loggers: Any = None, **_: Any
    ) -> AsyncLLM | AsyncPoolingLLM:
        """Load the checkpoint `engine_args` names, bind an engine to it and serve it (vLLM's other arguments change
        nothing here). `shutdown()` stops the engine; `hybridkv.unpatch(engine.llm.model)` frees the model's KV.
        Arguments that name a pooling model (`runner="pooling"`, a classifier's checkpoint) give an
        `AsyncPoolingLLM`, whose `encode` pools (hybridkv/engine/async_pooling.py)."""
        if engine_args.pooling_kind():
            return AsyncPoolingLLM(engine_args.create_pooling_engine())
        return cls(LLMEngine.from_engine_args(engine_args), owns_model=True)

    def __init__(self, llm: LLMEngine, owns_model: bool = False) -> None:
        super().__init__(llm)
        self.owns_model = owns_model  # made from engine args: `shutdown` frees the model it loaded too

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread (`AsyncLLMEngine.shutdown`); an engine made from engine args also frees its model's
        KV cache and engine (`hybridkv.unpatch`)."""
        super().shutdown(timeout)
        if self.owns_model:
            unbind_engine(self.llm.model)

    async def abort(self, request_id: str | Iterable[str]) -> None:  # type: ignore[override]
        """Abort a request, or several, by id (nothing for an id that finished)."""
        for one in [request_id] if isinstance(request_id, str) else request_id:
            super().abort(one)

    async def get_tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    @property
    def is_running(self) -> bool:
        return not self._stopping and self._thread.is_alive()

    @property
    def errored(self) -> bool:
        """Whether the engine thread ended without being shut down (a step's failure fails its requests alone)."""
        return not self._stopping and not self._thread.is_alive()
