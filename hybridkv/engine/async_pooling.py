"""`AsyncPoolingLLM`: vLLM v1's `AsyncLLM` over a pooling model (`AsyncLLM.from_engine_args` of arguments that name
one): `async for output in engine.encode(prompt, pooling_params, request_id)` yields the prompt's one
`PoolingRequestOutput`, finished.

One background thread owns the `PoolingEngine` (hybridkv/engine/pooling.py). Requests that arrive while it runs a
batch wait in its inbox and run together next, grouped by what their batch must share (the task, truncation and
tokenizer settings), so that concurrent callers share forwards as vLLM's continuous batching shares them. A request
whose batch fails is run again alone, so that a bad request fails alone. A request aborted before its batch runs is
dropped, its stream ending with no output; one whose caller stops waiting is dropped too.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from hybridkv.engine.pooling import PoolingEngine, PoolingParams
from hybridkv.outputs import PoolingRequestOutput


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: Any
    params: PoolingParams
    task: str
    options: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(repr=False)
    cancelled: bool = False  # aborted, or its caller stopped waiting: its batch passes it over

    @property
    def batch_key(self) -> tuple[Any, ...]:
        """What the requests of one batch share: the task and the call's options."""
        return self.task, repr(sorted(self.options.items()))


class LockedPoolingCalls:
    """A pooling engine's calls between its forwards, as coroutines: each runs in a thread under `lock`, the lock its
    forwards run under (`AsyncPoolingLLM`'s, or the pooling server's: hybridkv/serving/pooling_app.py)."""

    def __init__(self, engine: PoolingEngine, lock: threading.Lock) -> None:
        self.engine, self.lock = engine, lock

    def locked(self, call: Any, *args: Any) -> Any:
        with self.lock:
            return call(*args)

    async def sleep(self, level: int = 1) -> None:
        await asyncio.to_thread(self.locked, self.engine.sleep, level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await asyncio.to_thread(self.locked, self.engine.wake_up, tags)

    async def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    async def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()


class AsyncPoolingLLM(LockedPoolingCalls):
    """vLLM's `AsyncLLM` of a pooling model (the module docstring): `encode`, `abort`, `sleep`, `wake_up`,
    `is_sleeping`, `get_tokenizer`, `shutdown`; `generate` names the generative engine."""

    def __init__(self, engine: PoolingEngine) -> None:
        super().__init__(engine, threading.Lock())  # one engine call at a time: a batch, or sleep / wake_up
        self._inbox: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._queued: dict[str, list[_Request]] = {}  # by id, the requests no batch has taken yet (`abort`)
        self._queued_lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hybridkv-pooling", daemon=True)
        self._thread.start()

    async def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        lora_request: Any = None,
        trace_headers: Any = None,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's `AsyncLLM.encode`: the prompt's pooled output (`pooling_params.task`, else the model's default
        task: "embed", or "classify" for a classifier), yielded once, finished."""
        if self._stopping:
            raise RuntimeError("the engine is shut down")
        if lora_request is not None:
            raise ValueError("a pooling model serves no LoRA adapters here; merge the adapter into the model first")
        params = pooling_params or PoolingParams()
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        loop = asyncio.get_running_loop()
        options = {"truncate_prompt_tokens": truncate_prompt_tokens, "tokenization_kwargs": tokenization_kwargs}
        request = _Request(
            request_id if request_id is not None else f"pool-{uuid.uuid4().hex}",
            prompt,
            params,
            params.task or self.engine.default_task,
            options,
            loop,
            loop.create_future(),
        )
        with self._queued_lock:
            self._queued.setdefault(request.request_id, []).append(request)
        self._inbox.put(request)
        try:
            output = await request.future
        except asyncio.CancelledError:
            request.cancelled = True  # the caller stopped waiting
            raise
        if output is not None:  # None: aborted before its batch ran
            yield output

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise ValueError(
            "this AsyncLLM serves a pooling model (runner='pooling'): it generates nothing; use encode(), or make "
            "the engine from arguments that name a generative model"
        )
        yield  # an async generator, as vLLM's generate is

    async def abort(self, request_id: str | list[str]) -> None:
        """Drop requests not run yet (a running batch finishes; an id that finished or is unknown changes nothing)."""
        with self._queued_lock:
            for one in [request_id] if isinstance(request_id, str) else request_id:
                for request in self._queued.get(one, ()):
                    request.cancelled = True

    @property
    def is_running(self) -> bool:
        return not self._stopping and self._thread.is_alive()

    @property
    def errored(self) -> bool:
        return not self._stopping and not self._thread.is_alive()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the thread; requests still waiting fail with RuntimeError."""
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            first = self._inbox.get()
            waiting = [first]
            while True:  # everything that arrived while the last batch ran goes into this one
                try:
                    waiting.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            requests = [r for r in waiting if r is not None]
            if None in waiting:
                for request in requests:
                    _deliver(request, RuntimeError("the engine is shut down"))
                return
            with self._queued_lock:  # taken into a batch: no longer abortable
                for request in requests:
                    queued = self._queued[request.request_id]
                    queued.remove(request)
                    if not queued:
                        del self._queued[request.request_id]
            groups: dict[tuple[Any, ...], list[_Request]] = {}
            for request in requests:
                if request.cancelled:  # aborted: its stream ends with no output (a caller that gave up waits for none)
                    _deliver(request, None)
                else:
                    groups.setdefault(request.batch_key, []).append(request)
            for group in groups.values():
                self._run_batch(group)

    def _run_batch(self, group: list[_Request]) -> None:
        try:
            outputs = self._encode(group)
        except Exception as error:  # some request of the batch is bad: each runs alone, to fail alone
            if len(group) == 1:
                _deliver(group[0], error)
                return
            for request in group:
                self._run_batch([request])
            return
        for request, output in zip(group, outputs, strict=True):
            output.request_id = request.request_id
            _deliver(request, output)

    def _encode(self, group: list[_Request]) -> list[PoolingRequestOutput]:
        first = group[0]
        with self.lock:
            return self.engine.encode(
                [r.prompt for r in group],
                [r.params for r in group],
                use_tqdm=False,
                pooling_task=first.task,
                **first.options,
            )


def _deliver(request: _Request, result: Any) -> None:
    """The request's output (or error) to its caller's loop, unless the caller gave up waiting."""

    def settle() -> None:
        if request.future.done():
            return
        if isinstance(result, BaseException):
            request.future.set_exception(result)
        else:
            request.future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
        request.loop.call_soon_threadsafe(settle)
