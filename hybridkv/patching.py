"""`hybridkv.patch(model)` and `hybridkv.unpatch(model)`."""

from __future__ import annotations

from typing import Any

import torch

from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.execution.config import EngineConfig
from hybridkv.execution.eval_semantics import evaluating
from hybridkv.patches import attention

# The engine lives in the model's __dict__ while patched: a plain reference cycle, collected with the
# model, and removed by unpatch (a global registry would keep every patched model alive).
_ENGINE_ATTR = "_hybridkv_engine"


def patch(model: torch.nn.Module, tokenizer: Any = None, *, processor: Any = None, **config: Any) -> LLMEngine:
    """Serve `model` through hybridkv: returns an engine bound to it.

    `tokenizer` makes text prompts and outputs; `processor` (the model's `AutoProcessor`, which may also be
    passed as `tokenizer`: its own tokenizer is then used) makes prompts with images (hybridkv/execution/multimodal.py).

    The model stays an ordinary transformers model: called directly it behaves exactly as before.
    Patching an already patched model returns its engine when the settings are the same and the engine
    still fits the model (`LLMEngine.outdated`: its attention implementation, attention-shaping config and
    vocabulary as they were), and rebuilds it (freeing the old KV cache) otherwise, which an engine with
    unfinished requests refuses. A model in training mode is served with eval semantics (dropout off) and left
    in its mode (hybridkv/execution/eval_semantics.py). Settings: see `EngineConfig`.
    """
    engine_config = EngineConfig.from_kwargs(**config)
    if processor is None and getattr(tokenizer, "image_processor", None) is not None:
        processor, tokenizer = tokenizer, tokenizer.tokenizer
    elif tokenizer is None and processor is not None:
        tokenizer = getattr(processor, "tokenizer", None)
    engine = model.__dict__.get(_ENGINE_ATTR)
    if engine is not None:
        same = engine.config == engine_config and engine.tokenizer is tokenizer and engine.processor is processor
        outdated = engine.outdated()
        if same and outdated is None:
            return engine
        if engine.has_unfinished_requests():
            why = "other settings" if outdated is None else f"the model as it is now ({outdated})"
            raise RuntimeError(
                f"the model's engine has {len(engine.outputs.states)} unfinished requests, which patching for "
                f"{why} would drop; finish them (engine.generate / engine.step) or abort them (engine.abort_all()) "
                "first"
            )
        unpatch(model)
    with evaluating(model):  # a model in training mode is probed and checked without dropout, and left in its mode
        engine = LLMEngine(model, tokenizer, engine_config, processor)
    attention.install(model)
    model.__dict__[_ENGINE_ATTR] = engine
    return engine


def unpatch(model: torch.nn.Module) -> None:
    """Restore the model's own attention implementation and drop the engine and its KV cache."""
    engine = model.__dict__.pop(_ENGINE_ATTR, None)
    if engine is not None:
        attention.uninstall(model)
        engine.close()


def is_patched(model: torch.nn.Module) -> bool:
    return _ENGINE_ATTR in model.__dict__
