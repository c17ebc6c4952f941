"""`RequestStream`: one streamed request, iterated delta by delta; closing or dropping it aborts it."""

from __future__ import annotations

import contextlib
from collections import deque
from typing import TYPE_CHECKING, Protocol

from hybridkv.outputs import StreamDelta

if TYPE_CHECKING:
    from hybridkv.engine.output_processor import RequestState


class StreamingEngine(Protocol):
    """What a stream asks of its engine (`LLMEngine`; named here, not imported: the engine imports this module)."""

    def advance_stream(self, state: RequestState) -> tuple[list[StreamDelta], bool]: ...

    def release_stream(self, request_id: str) -> None: ...


class RequestStream:
    """What `LLMEngine.stream` returns: iterate it for each sample's `StreamDelta`s until the request
    ends (the last delta of each sample carries its finish reason, and its error if it failed).

    `close()` (or leaving a `with` block, breaking out of a loop over it and then dropping it, or
    garbage collection) aborts the request if it has not finished, so it holds no blocks and computes
    nothing more. Iterating it runs engine steps: other requests progress meanwhile.
    """

    def __init__(self, engine: StreamingEngine, state: RequestState) -> None:
        self.request_id = state.group.request_id
        self._engine = engine
        self._state = state
        self._pending: deque[StreamDelta] = deque()
        self._finished = False

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> StreamDelta:
        while not self._pending:
            if self._finished:
                raise StopIteration
            deltas, self._finished = self._engine.advance_stream(self._state)
            self._pending.extend(deltas)
        return self._pending.popleft()

    def close(self) -> None:
        """Stop streaming; the request is aborted unless it already finished."""
        if not self._finished:
            self._finished = True
            self._pending.clear()
            self._engine.release_stream(self.request_id)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown the engine may be half torn down
            self.close()
