"""The OpenAI-compatible server (the `serve` extra: FastAPI and uvicorn).

`protocol.py` the request and response bodies, `endpoints.py` the endpoints' logic over an
`AsyncLLMEngine`, `metrics.py` the Prometheus text, `app.py` the FastAPI app, `launcher.py` `serve`.
"""

from hybridkv.serving.app import build_app
from hybridkv.serving.launcher import ServerHandle, serve

__all__ = ["ServerHandle", "build_app", "serve"]
