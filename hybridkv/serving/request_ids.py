"""Request ids: the one a client names, or a new one, and the engine's ids for it.

A completion's or chat's id is the client's `X-Request-Id` header (which vllm-router forwards), else the body's
`request_id`, else a new `cmpl-<hex>` / `chatcmpl-<hex>`: vLLM's order (its `_base_request_id`). The response's `id`
and its `X-Request-Id` header are that id. Clients retry with the same header and routers pass it on, so two requests
in flight may name one id, while the engine refuses a request whose id a running one holds: `EngineIds` gives the
first the id itself as its engine id and a later one the id with a random suffix, as vLLM suffixes its internal ids.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping

REQUEST_ID_HEADER = "X-Request-Id"
SUFFIX_HEX_DIGITS = 8
# What an HTTP header value may hold: visible ASCII, single spaces inside (no CR or LF to split a response with).
_HEADER_VALUE = re.compile(r"[!-~]+(?: [!-~]+)*")


def new_request_id(prefix: str) -> str:
    """A server-made id: `prefix-<32 hex digits>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def chosen_request_id(body_id: str | None, headers: Mapping[str, str], prefix: str) -> str:
    """A request's id: the `X-Request-Id` header, else the body's `request_id`, else a new `prefix-<hex>` (vLLM's
    order)."""
    return headers.get(REQUEST_ID_HEADER) or body_id or new_request_id(prefix)


def id_headers(request_id: str) -> dict[str, str]:
    """The response headers that name the request: `X-Request-Id`, unless the id cannot be a header value (a body's
    `request_id` with line breaks or non-ASCII text is still the response's `id`)."""
    return {REQUEST_ID_HEADER: request_id} if _HEADER_VALUE.fullmatch(request_id) else {}


class EngineIds:
    """The engine request ids of a server's requests in flight, each unique. Called from the event loop only."""

    def __init__(self) -> None:
        self._in_flight: set[str] = set()

    def claim(self, wanted: str) -> str:
        """`wanted` if no request in flight holds it, else `wanted-<8 hex digits>`; held until `release`."""
        engine_id = wanted
        while engine_id in self._in_flight:
            engine_id = f"{wanted}-{uuid.uuid4().hex[:SUFFIX_HEX_DIGITS]}"
        self._in_flight.add(engine_id)
        return engine_id

    def release(self, engine_id: str) -> None:
        """Free an id whose request has ended (or was never queued)."""
        self._in_flight.discard(engine_id)
