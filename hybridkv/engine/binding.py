"""An engine bound to its model: made, its attention installed and kept in the model's `__dict__`.

`hybridkv.patch(model)` binds an engine to a model the user holds; `LLMEngine.from_engine_args` (vLLM's
`LLM(model=path)`, hybridkv/engine/arg_utils.py) to one it loaded itself. `hybridkv.unpatch(model)` unbinds either.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.execution.config import EngineConfig
from hybridkv.execution.eval_semantics import evaluating
from hybridkv.patches import attention

# The engine lives in the model's __dict__ while patched: a plain reference cycle, collected with the
# model, and removed by unpatch (a global registry would keep every patched model alive).
ENGINE_ATTR = "_hybridkv_engine"


def bound_engine(model: torch.nn.Module) -> LLMEngine | None:
    """The engine bound to `model`, or None."""
    return model.__dict__.get(ENGINE_ATTR)


def bind_engine(model: torch.nn.Module, tokenizer: Any, config: EngineConfig, processor: Any = None) -> LLMEngine:
    """Make an engine for `model` (probed and checked with eval semantics, its training mode left as it was), install
    hybridkv's attention and bind the engine to the model. The model must hold no engine (`unbind_engine` first)."""
    with evaluating(model):
        engine = LLMEngine(model, tokenizer, config, processor)
    attention.install(model)
    model.__dict__[ENGINE_ATTR] = engine
    return engine


def unbind_engine(model: torch.nn.Module) -> None:
    """Restore the model's own attention implementation and close the engine bound to it (its KV cache freed)."""
    engine = model.__dict__.pop(ENGINE_ATTR, None)
    if engine is not None:
        attention.uninstall(model)
        engine.close()
