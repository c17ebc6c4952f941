"""`serve`: the OpenAI-compatible server in a background thread of this process (notebooks, tests)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import uvicorn

from hybridkv.async_engine import AsyncLLMEngine
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.lora import LoRARequest
from hybridkv.serving.app import build_app

STARTUP_TIMEOUT_SECONDS = 30.0


@dataclass
class ServerHandle:
    """A running server: `url` is its base (`http://127.0.0.1:8000`; the OpenAI client's base_url is
    `url + "/v1"`), `engine` the `AsyncLLMEngine` it serves; `stop()` ends it."""

    url: str
    engine: AsyncLLMEngine
    server: uvicorn.Server
    thread: threading.Thread
    owns_engine: bool

    def stop(self, timeout: float = 10.0) -> None:
        """Stop answering, wait for the server thread, and shut down the async engine if `serve` made
        it (one passed in stays running). Idempotent."""
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.owns_engine:
            self.engine.shutdown()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def serve(
    llm: LLMEngine | AsyncLLMEngine,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    log_level: str = "warning",
    api_key: str | None = None,
    tool_call_parser: str | None = None,
    fetch_images: bool = False,
    lora_modules: Sequence[LoRARequest] = (),
    strict_fields: bool = False,
) -> ServerHandle:
    """Serve `llm` (an engine from `hybridkv.patch`, or an `AsyncLLMEngine`) with OpenAI's API from a
    background thread, and return once it accepts connections. `port=0` takes a free port (the handle's
    url names it). `model_name` is the name clients pass as `model`: by default the model's
    `name_or_path`, else "hybridkv". An LLMEngine gets an AsyncLLMEngine that `stop()` shuts down. `api_key`:
    every route but `/health` then asks for `Authorization: Bearer <api_key>` (hybridkv/serving/app.py).
    `tool_call_parser`: the tool-call format of tool_choice "auto" (hybridkv/serving/tool_calls.py's PARSER_NAMES; by
    default the one the chat template shows). `fetch_images`: fetch http(s) image URLs (off: data URLs only).
    `lora_modules`: LoRA adapters (`LoRARequest`s; the engine patched with enable_lora) that a request's `model` names
    by their lora_name, each read here (a ValueError names the fix for one the engine cannot serve); more are loaded
    and unloaded at run time through `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`. `strict_fields`: a request
    field the server does not know is a 400 naming it (by default: ignored with one warning, as vLLM does)."""
    owns_engine = isinstance(llm, LLMEngine)
    engine = AsyncLLMEngine(llm) if owns_engine else llm
    name = model_name or default_model_name(engine.llm)
    try:
        app = build_app(engine, name, api_key, tool_call_parser, fetch_images, lora_modules, strict_fields)
    except BaseException:
        if owns_engine:  # its thread holds the engine: a refused adapter must not leave it locked
            engine.shutdown()
        raise
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    thread = threading.Thread(target=_run, args=(server,), name="hybridkv-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            if owns_engine:
                engine.shutdown()
            raise OSError(f"the server could not start on {host}:{port} (is the port in use?); pass another port")
        time.sleep(0.01)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    return ServerHandle(f"http://{host}:{bound_port}", engine, server, thread, owns_engine)


def _run(server: uvicorn.Server) -> None:
    # uvicorn exits with SystemExit when it cannot bind; `serve` reports that from the calling thread.
    with contextlib.suppress(SystemExit):
        server.run()


def default_model_name(llm: LLMEngine) -> str:
    """The name a server answers to when none is given: the checkpoint's name or path, else "hybridkv"."""
    config = getattr(llm.model, "config", None)
    return getattr(config, "name_or_path", "") or "hybridkv"
