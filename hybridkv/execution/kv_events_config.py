"""`KVEventsConfig`: vLLM's `--kv-events-config`, where the engine publishes its KV cache events
(hybridkv/memory/kv_events.py; the publisher: hybridkv/engine/kv_events.py).

The fields, names and defaults are vLLM's (`vllm.config.KVEventsConfig`): `enable_kv_cache_events`, `publisher`
("zmq", the default once enabled, or "null"), `endpoint` (a ZMQ address: bound where its host is `*`, `::`, or for
ipc:// and inproc://, else connected to; hybridkv binds a loopback tcp:// address too unless a subscriber has bound
it), `replay_endpoint` (a ZMQ ROUTER socket, bound, that answers a subscriber asking for the batches from a sequence
number on), `buffer_steps` (batches kept for replay), `hwm` (the socket's high-water mark), `max_queue_size` (batches
waiting for the publisher thread) and `topic` (the first frame of every message).

One field is hybridkv's: `hybrid_groups` (default true) publishes every KV cache group of a hybrid model and its state
checkpoints (hybridkv/memory/kv_events.py); false publishes group 0 alone, the full-attention blocks, which is what an
index that admits only full-attention events takes (vllm-router's discovery through `/kv_event_sources` refuses a whole
batch that holds a sliding window's or a state's event).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    hybrid_groups: bool = True

    def __post_init__(self) -> None:
        for name in ("enable_kv_cache_events", "hybrid_groups"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"kv_events_config {name} must be true or false, got {getattr(self, name)!r}")
        if self.publisher is None:  # vLLM's default: zmq once enabled
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config publisher must be one of {PUBLISHERS}, got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"kv_events_config {name} must be a string, got {getattr(self, name)!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise TypeError(f"kv_events_config replay_endpoint must be a string, got {self.replay_endpoint!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config {name} must be a positive integer, got {value!r}")

    @property
    def publishes(self) -> bool:
        """Whether events are recorded and sent (enabled, and a publisher other than "null")."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def of(cls, value: Any) -> KVEventsConfig | None:
        """A `kv_events_config` setting: a KVEventsConfig, vLLM's dict, or None (no events)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(
                "kv_events_config must be a dict such as {'enable_kv_cache_events': True, 'endpoint': 'tcp://*:5557'} "
                f"(vLLM's), got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config has unknown field(s) {unknown}; it takes {sorted(known)}")
        return cls(**value)
