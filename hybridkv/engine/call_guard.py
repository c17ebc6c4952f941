"""`exclusive`: the guard on every public engine call.

An engine's queues and step state are not thread-safe. Each public call takes the engine's re-entrant
lock without waiting, so a second thread gets a clear error instead of corrupting them (the engine's own
calls nest), a closed engine (after `hybridkv.unpatch`) refuses every call, and so does a worker rank of a
tensor-parallel engine (hybridkv/execution/distributed.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

CLOSED_MESSAGE = "this engine was closed by hybridkv.unpatch(model); call hybridkv.patch(model) again"
BUSY_MESSAGE = (
    "this engine is in use by another thread; an LLMEngine serves one thread at a time: call it from one "
    "thread (give each thread its own model and engine, or let one thread serve the others' requests)"
)

WORKER_MESSAGE = (
    "rank {rank} of a tensor-parallel engine is a worker: call llm.run_worker() there (it returns when rank 0 "
    "unpatches its model); rank 0 takes requests and returns outputs"
)

Method = TypeVar("Method", bound=Callable[..., Any])


def exclusive(method: Method) -> Method:
    """A public entry point: refuses a closed engine and a second thread (the lock is re-entrant, so the
    engine's own calls nest); the outermost call begins with the engine's `_begin_call` (it aborts the streams
    dropped during earlier calls, the model may have changed since the last call, and a model in training mode is
    served with eval semantics) and ends with its `_end_call` (the model's modes put back)."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError(CLOSED_MESSAGE)
        if self.core.worker_rank is not None:
            raise RuntimeError(WORKER_MESSAGE.format(rank=self.core.worker_rank))
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(BUSY_MESSAGE)
        try:
            if self._depth == 0:
                self._begin_call()
            self._depth += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._end_call()
        finally:
            self._lock.release()

    return guarded  # type: ignore[return-value]
