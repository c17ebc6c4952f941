"""`LLM`: vLLM's offline entry point (`vllm.entrypoints.llm.LLM`), so that vLLM code runs with its import line changed.

`LLM(model="path/or/hub-name", ...)` loads the checkpoint with transformers and binds an engine to it
(`EngineArgs.create_engine`, hybridkv/engine/arg_utils.py); `LLM(model=hf_model, tokenizer=tokenizer, ...)` patches a
model the caller already holds (`hybridkv.patch`). Either way every method and attribute of the engine
(`generate`, `chat`, `beam_search`, `stats`, `get_metrics`, `sleep`, ...) is the LLM's, and `llm.llm_engine` is the
engine itself, as in vLLM. A pooling model (`runner="pooling"`, or a checkpoint that is not a generative one) is served
by a `PoolingEngine` instead (hybridkv/engine/pooling.py): `embed`, `classify`, `score`, `reward`, `encode`.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridkv.engine.arg_utils import EngineArgs
from hybridkv.engine.binding import unbind_engine
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.engine.pooling import PoolingEngine
from hybridkv.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from hybridkv.patching import patch


class LLM:
    """vLLM's `LLM` (the module docstring). Arguments are vLLM's engine arguments (`EngineArgs`): a setting hybridkv
    has is used, one that changes no result is ignored, one that would change results at another value is refused at
    that value, naming the reason."""

    def __init__(
        self, model: str | torch.nn.Module, tokenizer: Any = None, *, processor: Any = None, **kwargs: Any
    ) -> None:
        if isinstance(model, torch.nn.Module):
            arguments = EngineArgs(**kwargs)
            loading = arguments.loading_given()
            if loading:
                raise TypeError(
                    f"{', '.join(loading)} name how a checkpoint loads, and this model is already loaded: load it "
                    "as you want it and pass it, or pass LLM(model=path, ...)"
                )
            arguments.seed_torch()
            if arguments.pooling_kind(model):
                self.llm_engine: LLMEngine | PoolingEngine = arguments.create_pooling_engine(model, tokenizer)
            else:
                self.llm_engine = patch(model, tokenizer, processor=processor, **arguments.settings)
        elif processor is not None:
            raise TypeError("processor= goes with a model you loaded; LLM(model=path) loads the checkpoint's own")
        else:
            arguments = EngineArgs(model=model, tokenizer=tokenizer, **kwargs)
            pools = arguments.pooling_kind()
            self.llm_engine = arguments.create_pooling_engine() if pools else arguments.create_engine()

    def __getattr__(self, name: str) -> Any:
        # Only for names the LLM itself lacks: the engine's methods and attributes.
        if name == "llm_engine":  # not set: __init__ failed before making it
            raise AttributeError(name)
        return getattr(self.llm_engine, name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self.llm_engine)))

    def __repr__(self) -> str:
        return f"LLM({type(self.llm_engine.model).__name__}, max_model_len={self.llm_engine.max_model_len})"

    def embed(self, *args: Any, **kwargs: Any) -> list[EmbeddingRequestOutput]:
        """vLLM's: one embedding a prompt (a pooling model: `PoolingEngine.embed`)."""
        return self._pooling("embed").embed(*args, **kwargs)

    def classify(self, *args: Any, **kwargs: Any) -> list[ClassificationRequestOutput]:
        """vLLM's: each prompt's class probabilities (a classifier: `PoolingEngine.classify`)."""
        return self._pooling("classify").classify(*args, **kwargs)

    def score(self, *args: Any, **kwargs: Any) -> list[ScoringRequestOutput]:
        """vLLM's: a score for each pair of texts (`PoolingEngine.score`)."""
        return self._pooling("score").score(*args, **kwargs)

    def reward(self, *args: Any, **kwargs: Any) -> list[PoolingRequestOutput]:
        """vLLM's: every token's scores (a classifier: `PoolingEngine.reward`)."""
        return self._pooling("reward").reward(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> list[PoolingRequestOutput]:
        """vLLM's: any pooling task, `pooling_task=` (`PoolingEngine.encode`)."""
        return self._pooling("encode").encode(*args, **kwargs)

    def _pooling(self, call: str) -> PoolingEngine:
        if not isinstance(self.llm_engine, PoolingEngine):
            raise ValueError(
                f"LLM.{call}() needs a pooling model, and this LLM generates: load it with LLM(model=path, "
                "runner='pooling') (a *ForSequenceClassification checkpoint classifies, any other embeds)"
            )
        return self.llm_engine

    def shutdown(self) -> None:
        """Free the engine's KV cache; a model this LLM loaded itself goes with it (its engine is closed either way:
        `hybridkv.unpatch`)."""
        unbind_engine(self.llm_engine.model)
