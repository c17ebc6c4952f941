"""Serving: the command line and the OpenAI-compatible server (the `serve` extra: FastAPI and uvicorn).

`cli.py` the `hybridkv` command, `tool_calls.py` tool-call parsers, `protocol.py` the request and response bodies,
`request_ids.py` requests' ids (the client's X-Request-Id; unique engine ids), `served_models.py` the model names
served (the model's and its LoRA adapters'), `endpoints.py` the endpoints' logic over an `AsyncLLMEngine`,
`images.py` image inputs, `metrics.py` the Prometheus text, `app.py` the FastAPI app, `launcher.py` `serve`.

Imports: every layer below it. FastAPI is imported with `app.py` and `launcher.py` only, so the command line
runs without the extra.
"""

from typing import Any

__all__ = ["ServerHandle", "build_app", "serve"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from hybridkv.serving.app import build_app

        return build_app
    if name in ("ServerHandle", "serve"):
        from hybridkv.serving import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'hybridkv.serving' has no attribute {name!r}")
