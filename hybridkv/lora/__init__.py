"""Per-request LoRA adapters, vLLM's way: `LoRARequest` (hybridkv.lora.request, vLLM's path) names an adapter by a
PEFT folder; the engine (`hybridkv.patch(model, enable_lora=True)`) applies it to that request's rows only
(hybridkv/execution/lora.py)."""

from hybridkv.lora.request import LoRARequest

__all__ = ["LoRARequest"]
