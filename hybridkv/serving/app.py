"""`build_app`: the FastAPI app of an OpenAI-compatible server over an `AsyncLLMEngine`.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (`stream: true` gives server-sent
events ending with `data: [DONE]`), `GET /health`, `GET /metrics` (Prometheus text), and vLLM's routes:
`POST /tokenize` and `POST /detokenize`; `POST /v1/completions/render` and `POST /v1/chat/completions/render` (the
token ids the endpoint would run, which vllm-router asks for to route by a prompt's cached prefix; a chat with images
is a 400); `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (plain text answers; enable_lora is all
they need, where vLLM also asks for VLLM_ALLOW_RUNTIME_LORA_UPDATING=true); `GET /kv_event_sources` (where the KV
events are published, with kv_events_config). And SGLang's `GET /get_server_info` (the KV events' block size and this
instance's id, which vllm-router's kv_aware discovery reads) and `GET /get_model_info`. With `VLLM_SERVER_DEV_MODE=1`,
vLLM's development endpoints too (`/sleep`, `/wake_up`, `/is_sleeping`, `/reset_prefix_cache`, `/collective_rpc`:
hybridkv/serving/dev_endpoints.py).

Every refusal is OpenAI's error body `{"error": {"message", "type", "param", "code"}}` with a 4xx status: a body that
is not JSON or does not fit the schema is a 400 (not FastAPI's 422), an unknown model a 404. A field the schema does
not know is ignored with one warning naming it, as vLLM does (`strict_fields`: a 400 instead).

A completion's or chat's id (a render's too) is the client's `X-Request-Id` header, else the body's `request_id`, else
the server's own (vLLM's order); the response (a refusal too, a stream too) names it in its `X-Request-Id` header, as
vLLM's --enable-request-id-headers does (hybridkv/serving/request_ids.py: two requests in flight may share one).

With an API key, every route but `/health` asks for `Authorization: Bearer <key>` (compared in constant
time); a request without it is a 401 with OpenAI's `invalid_api_key` body.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from hybridkv.serving.dev_endpoints import add_dev_endpoints, dev_mode
from hybridkv.serving.endpoints import OpenAIServing
from hybridkv.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    error_body,
)
from hybridkv.serving.request_ids import chosen_request_id, id_headers

if TYPE_CHECKING:
    from hybridkv.async_engine import AsyncLLMEngine
    from hybridkv.lora import LoRARequest


def build_app(
    engine: AsyncLLMEngine,
    model_name: str,
    api_key: str | None = None,
    tool_call_parser: str | None = None,
    fetch_images: bool = False,
    lora_modules: Sequence[LoRARequest] = (),
    strict_fields: bool = False,
) -> FastAPI:
    """The server's app: requests for `model_name` run on `engine`, which the caller owns (and shuts
    down). `app.state.serving` is the `OpenAIServing` behind the routes. `api_key`: see the module docstring.
    `tool_call_parser`: the format tool_choice "auto" parses (hybridkv/serving/tool_calls.py; by default the one the
    chat template shows). `fetch_images`: image_url parts may name http(s) URLs, which the server fetches
    (hybridkv/serving/images.py); off, only data URLs are taken. `lora_modules`: LoRA adapters served from the start
    (vLLM's --lora-modules), a request's `model` naming one by its lora_name; each is read here, and a ValueError
    names the fix for one the engine cannot serve (hybridkv/serving/served_models.py). `strict_fields`: a body's field
    the server does not know is a 400 naming it, not ignored with a warning (OpenAIServing.accept_fields)."""
    serving = OpenAIServing(engine, model_name, tool_call_parser, fetch_images, lora_modules, strict_fields)
    app = FastAPI(title="hybridkv", description="An OpenAI-compatible server over a hybridkv engine")
    if dev_mode():
        add_dev_endpoints(app, engine)
    app.state.serving = serving

    guard(app, api_key)

    # A plain function: FastAPI runs it in its thread pool, so waiting for the engine's stats never
    # blocks the event loop.
    @app.get("/metrics")
    def metrics() -> Response:
        return Response(serving.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return serving.server_info()

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> dict[str, Any]:
        return serving.kv_event_sources()

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return serving.model_info()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return serving.models()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        serving.accept_fields(body, request.url.path)
        request_id = _name(request, body.request_id, "cmpl")
        return _respond(await serving.completion(body, request, request_id), request_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        serving.accept_fields(body, request.url.path)
        request_id = _name(request, body.request_id, "chatcmpl")
        return _respond(await serving.chat(body, request, request_id), request_id)

    # Plain functions, as /tokenize: a long prompt is tokenized in FastAPI's thread pool, never on the event loop.
    @app.post("/v1/completions/render")
    def render_completion(body: CompletionRequest, request: Request) -> JSONResponse:
        serving.accept_fields(body, request.url.path)
        request_id = _name(request, body.request_id, "cmpl")
        return JSONResponse(serving.render_completion(body, request_id), headers=id_headers(request_id))

    @app.post("/v1/chat/completions/render")
    def render_chat(body: ChatCompletionRequest, request: Request) -> JSONResponse:
        serving.accept_fields(body, request.url.path)
        request_id = _name(request, body.request_id, "chatcmpl")
        return JSONResponse(serving.render_chat(body, request_id), headers=id_headers(request_id))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
        serving.accept_fields(body, request.url.path)
        return PlainTextResponse(await serving.load_lora_adapter(body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
        serving.accept_fields(body, request.url.path)
        return PlainTextResponse(await serving.unload_lora_adapter(body))

    # Plain functions: a long prompt is tokenized in FastAPI's thread pool, never on the event loop.
    @app.post("/tokenize")
    def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        serving.accept_fields(body, request.url.path)
        return serving.tokenize(body)

    @app.post("/detokenize")
    def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        serving.accept_fields(body, request.url.path)
        return serving.detokenize(body)

    return app


def guard(app: FastAPI, api_key: str | None) -> None:
    """What every hybridkv server has: the API key asked of every route but `GET /health` (which this adds), and
    OpenAI's error body for every refusal (a schema error a 400, anything unexpected a 500)."""
    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authenticate(request: Request, call_next: Any) -> Any:
            given = request.headers.get("authorization", "").encode()
            if request.url.path != "/health" and not hmac.compare_digest(given, expected):
                message = "invalid or missing API key: send the header 'Authorization: Bearer <key>'"
                body = error_body(message, "invalid_request_error", code="invalid_api_key")
                return JSONResponse(body, status_code=401)
            return await call_next(request)

    @app.exception_handler(APIError)
    async def refused(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=_named(request))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error.errors())
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        message = f"the server failed: {type(error).__name__}: {error}"
        return JSONResponse(error_body(message, "server_error"), status_code=500, headers=_named(request))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(error.detail), "invalid_request_error"), status_code=error.status_code)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}


def _name(request: Request, body_id: str | None, prefix: str) -> str:
    """The request's id (hybridkv/serving/request_ids.py), kept on the request for the X-Request-Id of a refusal."""
    request.state.request_id = chosen_request_id(body_id, request.headers, prefix)
    return request.state.request_id


def _named(request: Request) -> dict[str, str]:
    """The X-Request-Id header of a refused request that was named before the refusal."""
    request_id = getattr(request.state, "request_id", None)
    return {} if request_id is None else id_headers(request_id)


def _respond(result: Any, request_id: str) -> Any:
    headers = id_headers(request_id)
    if isinstance(result, dict):
        return JSONResponse(result, headers=headers)
    headers["Cache-Control"] = "no-cache"
    return StreamingResponse(result, media_type="text/event-stream", headers=headers)


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The first schema error as a sentence and the field it names (pydantic's own wording otherwise)."""
    error = errors[0]
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if error["type"] == "json_invalid":
        reason = error.get("ctx", {}).get("error", "not JSON")
        return f"the request body is not valid JSON ({reason}); send a JSON object", None
    if error["type"] == "missing":
        return f"the field {param!r} is required", param
    if param is None:
        return f"the request body must be a JSON object: {error['msg']}", None
    return f"{param}: {error['msg']}", param
