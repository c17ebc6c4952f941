"""vLLM's development endpoints, served when `VLLM_SERVER_DEV_MODE=1` is set (vLLM's switch; never expose them to
users): what an RL trainer drives a rollout server with between batches.

- `POST /sleep?level=1` (or 2): `sleep(level)`; `POST /wake_up` with optional `?tags=weights&tags=kv_cache`:
  `wake_up(tags)`; `GET /is_sleeping`: `{"is_sleeping": bool}`. A server loads its model itself, so level 2 discards
  the weights on a GPU and `wake_up` loads them again from the checkpoint (hybridkv/execution/weight_memory.py).
- `POST /reset_prefix_cache`: `reset_prefix_cache()`, for weights changed in a way no check sees.
- `POST /collective_rpc` with `{"method": name, "args": [...], "kwargs": {...}, "timeout": seconds}`: the worker's
  method of that name (`reload_weights`, or one of `--worker-extension-cls`), `{"results": [one per rank]}`; the
  results must be JSON (vLLM's shape).
Each runs on the engine thread between two steps; one the engine refuses (sleep with requests unfinished, an unknown
method) is a 400 naming why.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Query
from pydantic import BaseModel, Field

from hybridkv.serving.protocol import APIError

if TYPE_CHECKING:
    from hybridkv.async_engine import AsyncLLMEngine


class CollectiveRPCRequest(BaseModel):
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None


def dev_mode() -> bool:
    """Whether `VLLM_SERVER_DEV_MODE` asks for the development endpoints (vLLM's: "1")."""
    return os.environ.get("VLLM_SERVER_DEV_MODE", "0") == "1"


def add_dev_endpoints(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """The module docstring's routes on `app`, over `engine`."""

    async def refused_as_400(call: Any) -> Any:
        try:
            return await call
        except (RuntimeError, ValueError, TypeError, AttributeError) as error:
            raise APIError(400, f"{type(error).__name__}: {error}") from None

    @app.post("/sleep")
    async def sleep(level: int = 1) -> dict[str, Any]:
        await refused_as_400(engine.sleep(level))
        return {}

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(default=None)) -> dict[str, Any]:  # noqa: B008 (FastAPI's way)
        await refused_as_400(engine.wake_up(tags))
        return {}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await engine.is_sleeping()}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        await refused_as_400(engine.reset_prefix_cache())
        return {}

    @app.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRPCRequest) -> dict[str, Any]:
        results = await refused_as_400(engine.collective_rpc(body.method, body.timeout, tuple(body.args), body.kwargs))
        return {"results": results}
