"""`ServedModels`: the names a server answers to (vLLM's `OpenAIServingModels`): its model's, and one per LoRA adapter
served with it, named at start (`--lora-modules`, `serve(lora_modules=...)`) or loaded at run time
(`POST /v1/load_lora_adapter`, undone by `POST /v1/unload_lora_adapter`).

A request's `model` picks its adapter by name; the model's own name (or none) runs the model alone. The adapters served
are kept here, apart from the engine's host cache of adapters read (at most max_cpu_loras, the least recently used
evicted): an adapter evicted from it is read from its folder again by its next request. Each adapter takes a
`lora_int_id` none took before (one above the largest so far), so an adapter unloaded and loaded again under its name is
a new adapter to the engine. Loads and unloads run one at a time, on the event loop; the engine thread drops an
unloaded adapter from its cache between two steps, and a request submitted with it before runs with it to its end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hybridkv.lora import LoRARequest
from hybridkv.serving.protocol import APIError, now

if TYPE_CHECKING:
    from hybridkv.async_engine import AsyncLLMEngine


class ServedModels:
    """The model's name and the LoRA adapters served with it, over one engine (see the module docstring)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, lora_modules: Sequence[LoRARequest] = ()) -> None:
        """Serve `lora_modules` too, each read now: a ValueError names the fix for an adapter the engine cannot serve,
        an engine patched without enable_lora, two adapters of one name or one lora_int_id, or an adapter named as the
        model."""
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.llm.max_model_len
        self.adapters: dict[str, LoRARequest] = {}
        self._largest_id = 0
        self._changing = asyncio.Lock()
        if lora_modules and not engine.llm.config.enable_lora:
            raise ValueError(
                "LoRA adapters need an engine patched with enable_lora=True: serve with --enable-lora (and "
                "--max-loras, --max-lora-rank to fit them), or hybridkv.patch(model, enable_lora=True, ...)"
            )
        for adapter in lora_modules:
            self._check_name(adapter.lora_name)
            taken = next((a.lora_name for a in self.adapters.values() if a.lora_int_id == adapter.lora_int_id), None)
            if taken is not None:
                raise ValueError(
                    f"adapters {taken!r} and {adapter.lora_name!r} have one lora_int_id ({adapter.lora_int_id}); "
                    "give each adapter its own"
                )
            engine.llm.core.adapter(adapter)
            self._serve(adapter)

    def cards(self) -> list[dict[str, Any]]:
        """`GET /v1/models`' entries: the model, then each adapter with its folder (`root`) and its base (`parent`), as
        vLLM lists them."""
        card = {"object": "model", "created": now(), "owned_by": "hybridkv", "max_model_len": self.max_model_len}
        cards = [{"id": self.model_name, **card, "parent": None}]
        for adapter in self.adapters.values():
            parent = adapter.base_model_name or self.model_name
            cards.append({"id": adapter.lora_name, **card, "root": adapter.lora_path, "parent": parent})
        return cards

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the model itself (or no name). Any other name is a 404."""
        if model is None or model == self.model_name:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            served = repr(self.model_name)
            if self.adapters:
                served += " and its LoRA adapters " + ", ".join(map(repr, self.adapters))
            raise APIError(404, f"model {model!r} does not exist; this server serves {served}", param="model")
        return adapter

    async def load(self, lora_name: str, lora_path: str) -> str:
        """`POST /v1/load_lora_adapter`: read the adapter in `lora_path` (in a worker thread) and serve it as
        `lora_name`; vLLM's success text. A 400 for a name already served, a server without LoRA, or an adapter the
        engine cannot serve (the engine's message)."""
        if not self.engine.llm.config.enable_lora:
            raise APIError(400, "this server runs without LoRA adapters; restart it with --enable-lora", "lora_name")
        async with self._changing:
            try:
                self._check_name(lora_name)
                adapter = LoRARequest(lora_name, self._largest_id + 1, lora_path)
            except ValueError as error:
                raise APIError(400, str(error), param="lora_name") from error
            try:
                await self.engine.add_lora(adapter)
            except ValueError as error:
                raise APIError(400, str(error), param="lora_path") from error
            self._serve(adapter)
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload(self, lora_name: str | None, lora_int_id: int | None) -> str:
        """`POST /v1/unload_lora_adapter`: stop serving the adapter named `lora_name` (or, with no name, the one of
        `lora_int_id`); vLLM's success text. Requests naming it are then 404s, as any unknown model; one submitted
        before runs with it to its end. A 404 for an adapter not served."""
        async with self._changing:
            if lora_name is not None:
                adapter = self.adapters.get(lora_name)
            elif lora_int_id is not None:
                adapter = next((a for a in self.adapters.values() if a.lora_int_id == lora_int_id), None)
            else:
                raise APIError(400, "name the adapter to unload: give lora_name", param="lora_name")
            if adapter is None:
                which = f"named {lora_name!r}" if lora_name is not None else f"of lora_int_id {lora_int_id}"
                served = ", ".join(map(repr, self.adapters)) or "none"
                raise APIError(404, f"no LoRA adapter {which} is served (served: {served})", param="lora_name")
            del self.adapters[adapter.lora_name]
            await self.engine.remove_lora(adapter.lora_int_id)
        return f"Success: LoRA adapter '{adapter.lora_name}' removed successfully."

    def _check_name(self, lora_name: str) -> None:
        if lora_name == self.model_name:
            raise ValueError(f"{lora_name!r} is the served model's name; give the adapter a name of its own")
        if lora_name in self.adapters:
            raise ValueError(
                f"a LoRA adapter named {lora_name!r} is already served; give this one another name, or unload that one "
                "first (POST /v1/unload_lora_adapter)"
            )

    def _serve(self, adapter: LoRARequest) -> None:
        self.adapters[adapter.lora_name] = adapter
        self._largest_id = max(self._largest_id, adapter.lora_int_id)
