"""vLLM's `LoRARequest` (`vllm.lora.request`): which adapter a request runs with.

`lora_name` names the adapter (two requests with one name run the same adapter: equality and hashing go by name, as
in vLLM), `lora_int_id` is a positive id, unique per adapter, and `lora_path` a PEFT folder (adapter_config.json and
adapter_model.safetensors, or adapter_model.bin) read when the adapter is first used. vLLM's other fields are taken
for its code to run unchanged; `base_model_name` changes nothing, a `tensorizer_config_dict` is refused where the
adapter is read."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass(eq=False)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_local_path: str | None = field(default=None, repr=False)  # vLLM's older name for lora_path
    long_lora_max_len: int | None = None
    base_model_name: str | None = None
    tensorizer_config_dict: dict[str, Any] | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int > 0, got {self.lora_int_id!r}")
        if self.lora_local_path and not self.lora_path:
            self.lora_path = self.lora_local_path
        if isinstance(self.lora_path, os.PathLike):
            self.lora_path = os.fspath(self.lora_path)
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a folder's path, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def local_path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)


class AdapterRef(NamedTuple):
    """A request's adapter as the engine read it when the request was added: the `LoRARequest` and the digest of the
    adapter's weights then (its blocks' hashes start from it: hybridkv/memory/hashing.py)."""

    request: LoRARequest
    key: bytes


def as_lora_request(value: Any) -> LoRARequest:
    """`value` as hybridkv's LoRARequest: itself, or vLLM's (any object with `lora_name`, `lora_int_id` and
    `lora_path`); a TypeError otherwise."""
    if isinstance(value, LoRARequest):
        return value
    if all(hasattr(value, name) for name in ("lora_name", "lora_int_id", "lora_path")):
        return LoRARequest(value.lora_name, value.lora_int_id, value.lora_path)
    raise TypeError(
        f"lora_request must be a hybridkv.LoRARequest(lora_name, lora_int_id, lora_path), got {type(value).__name__}"
    )
