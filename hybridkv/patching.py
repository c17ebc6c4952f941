"""`hybridkv.patch(model)` and `hybridkv.unpatch(model)`."""

from __future__ import annotations

from typing import Any

import torch

from hybridkv.engine.binding import bind_engine, bound_engine, unbind_engine
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.execution.config import EngineConfig


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
    engine = bound_engine(model)
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
    return bind_engine(model, tokenizer, engine_config, processor)


def unpatch(model: torch.nn.Module) -> None:
    """Restore the model's own attention implementation and drop the engine and its KV cache."""
    unbind_engine(model)


def is_patched(model: torch.nn.Module) -> bool:
    return bound_engine(model) is not None
