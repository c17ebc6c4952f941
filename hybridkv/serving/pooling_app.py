"""`build_pooling_app`: the server of a pooling model (`hybridkv serve PATH --runner pooling`, or a classifier's
checkpoint), over a `PoolingEngine` (hybridkv/engine/pooling.py).

Routes, in OpenAI's and vLLM's shapes: `POST /v1/embeddings` (OpenAI's: `input` a text, texts, token ids or lists of
them; `encoding_format` "float" or "base64", little-endian float32 as OpenAI sends; `dimensions` for a matryoshka
model), vLLM's `POST /classify` (each input's `probs` and its most likely `label`), `POST /score` and `/v1/score`
(`text_1` against `text_2`), `POST /rerank`, `/v1/rerank` (`query`, `documents`, `top_n`: Jina's and Cohere's shape)
and `POST /pooling` (any pooling `task`, the model's default otherwise: each input's values, one vector or one per
token, as floats or base64), with `GET /v1/models` and `GET /health`; vLLM's development endpoints (`/sleep`,
`/wake_up`, `/is_sleeping`) under `VLLM_SERVER_DEV_MODE=1`. The generating routes answer a 400 naming the fix. The
calls run in FastAPI's thread pool, one forward at a time (a lock), so the event loop never waits on the model.
"""

from __future__ import annotations

import base64
import threading
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel

from hybridkv.engine.async_pooling import LockedPoolingCalls
from hybridkv.engine.pooling import PoolingEngine, PoolingParams
from hybridkv.serving.app import guard
from hybridkv.serving.dev_endpoints import add_dev_endpoints, dev_mode
from hybridkv.serving.protocol import APIError

Inputs = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(BaseModel):
    input: Inputs
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None


class ClassificationRequest(BaseModel):
    input: Inputs
    model: str | None = None
    truncate_prompt_tokens: int | None = None


class ScoreRequest(BaseModel):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: int | None = None


class PoolingRequest(BaseModel):
    input: Inputs
    model: str | None = None
    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None


class RerankRequest(BaseModel):
    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None
    truncate_prompt_tokens: int | None = None


class PoolingDevCalls(LockedPoolingCalls):
    """What vLLM's development endpoints call (hybridkv/serving/dev_endpoints.py) on a pooling engine, under the
    server's lock: `sleep`, `wake_up` and `is_sleeping` are the engine's (`LockedPoolingCalls`); a pooling model caches
    no prefix (`reset_prefix_cache` has nothing to reset) and has no worker to call."""

    async def reset_prefix_cache(self) -> bool:
        return True

    async def collective_rpc(self, method: str, timeout: float | None, args: tuple, kwargs: dict[str, Any]) -> list:
        raise RuntimeError("a pooling model is served without a worker: collective_rpc has nothing to call")


def build_pooling_app(engine: PoolingEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The pooling server's app (the module docstring): requests for `model_name` run on `engine`; vLLM's development
    endpoints too under `VLLM_SERVER_DEV_MODE=1` (`PoolingDevCalls`)."""
    app = FastAPI(title="hybridkv", description="An OpenAI-compatible server over a pooling model")
    guard(app, api_key)
    lock = threading.Lock()
    if dev_mode():
        add_dev_endpoints(app, PoolingDevCalls(engine, lock))  # type: ignore[arg-type]

    def run(call: Any, *args: Any, **kwargs: Any) -> Any:
        with lock:
            if engine.is_sleeping():
                raise APIError(503, "the engine is asleep (POST /sleep): POST /wake_up before embed, classify, score "
                               "or pooling (the engine's wake_up())")  # fmt: skip
            try:
                return call(*args, use_tqdm=False, **kwargs)
            except (ValueError, TypeError) as error:
                raise APIError(400, str(error)) from None

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {model_name!r}", param="model")

    def answer(kind: str, data: list[dict[str, Any]], prompt_tokens: int) -> dict[str, Any]:
        return {
            "id": f"{kind}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": model_name,
            "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "owned_by": "hybridkv", "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/embeddings")
    def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        check_model(body.model)
        params = PoolingParams(dimensions=body.dimensions)
        outputs = run(engine.embed, body.input, params, truncate_prompt_tokens=body.truncate_prompt_tokens)
        data = [
            {"object": "embedding", "index": index, "embedding": _encoded(out.outputs.embedding, body.encoding_format)}
            for index, out in enumerate(outputs)
        ]
        reply = answer("embd", data, sum(len(out.prompt_token_ids) for out in outputs))
        del reply["id"], reply["created"]  # OpenAI's embeddings list has neither
        return reply

    @app.post("/classify")
    def classify(body: ClassificationRequest) -> dict[str, Any]:
        check_model(body.model)
        outputs = run(engine.classify, body.input, truncate_prompt_tokens=body.truncate_prompt_tokens)
        labels = getattr(engine.model.config, "id2label", None) or {}
        data = []
        for index, out in enumerate(outputs):
            probs = out.outputs.probs
            best = int(np.argmax(probs))
            data.append(
                {"index": index, "label": labels.get(best, str(best)), "probs": probs, "num_classes": len(probs)}
            )
        return answer("classify", data, sum(len(out.prompt_token_ids) for out in outputs))

    @app.post("/pooling")
    def pooling(body: PoolingRequest) -> dict[str, Any]:
        check_model(body.model)
        task = body.task or engine.default_task
        params = PoolingParams(dimensions=body.dimensions, task=task)
        outputs = run(engine.encode, body.input, params, truncate_prompt_tokens=body.truncate_prompt_tokens)
        data = []
        for index, out in enumerate(outputs):
            values = out.outputs.data  # one vector, or one per token (token_embed, token_classify)
            encoded = _encoded(values.flatten().tolist(), "base64") if body.encoding_format == "base64" else None
            data.append({"index": index, "object": "pooling", "data": encoded or values.tolist()})
        return answer("pool", data, sum(len(out.prompt_token_ids) for out in outputs))

    def score(body: ScoreRequest) -> dict[str, Any]:
        check_model(body.model)
        outputs = run(engine.score, body.text_1, body.text_2, truncate_prompt_tokens=body.truncate_prompt_tokens)
        data = [{"index": index, "object": "score", "score": out.outputs.score} for index, out in enumerate(outputs)]
        return answer("score", data, sum(len(out.prompt_token_ids) for out in outputs))

    app.post("/score")(score)
    app.post("/v1/score")(score)

    def rerank(body: RerankRequest) -> dict[str, Any]:
        check_model(body.model)
        if not body.documents:
            raise APIError(400, "documents is empty; give at least one", param="documents")
        if body.top_n is not None and body.top_n < 1:
            raise APIError(400, f"top_n must be at least 1, got {body.top_n}", param="top_n")
        outputs = run(engine.score, body.query, body.documents, truncate_prompt_tokens=body.truncate_prompt_tokens)
        ranked = sorted(range(len(outputs)), key=lambda i: -outputs[i].outputs.score)[: body.top_n or len(outputs)]
        results = [
            {"index": i, "document": {"text": body.documents[i]}, "relevance_score": outputs[i].outputs.score}
            for i in ranked
        ]
        tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model_name, "usage": {"total_tokens": tokens},
                "results": results}  # fmt: skip

    app.post("/rerank")(rerank)
    app.post("/v1/rerank")(rerank)

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def generating() -> None:
        raise APIError(
            400,
            f"{model_name!r} is served as a pooling model (embeddings, classify, score, rerank): it generates nothing; "
            "serve a generative checkpoint without --runner pooling to complete or chat",
        )

    return app


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as floats, or as OpenAI's base64 of its little-endian float32 bytes."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode()
