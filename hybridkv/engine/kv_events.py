"""The KV event publisher: each step's KV cache events (hybridkv/memory/kv_events.py) sent over ZMQ as vLLM sends them,
so that a subscriber written for vLLM (vllm-router's kv_aware policy, llm-d, Dynamo) reads hybridkv unchanged.

The wire format is vLLM's (`vllm.distributed.kv_events.ZmqEventPublisher`):
- a PUB socket at `endpoint` (bound or connected to by vLLM's rule, `binds`; a loopback tcp:// address is bound unless
  a subscriber holds it, hybridkv's addition: `ZmqEventPublisher._bind_or_connect`) sends one message per step that had
  events: three frames, the topic, the sequence number
  (8 bytes, big-endian, from 0) and the batch;
- the batch is msgpack, as msgspec encodes vLLM's structs: `[ts, [event, ...], data_parallel_rank]`, each event a map
  whose first key is "type" ("BlockStored", "BlockRemoved", "AllBlocksCleared") followed by its fields in vLLM's
  order, the optional ones (`group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`) left out when None;
- with `replay_endpoint`, a ROUTER socket answers a request `[b"", start sequence number (8 bytes)]` with every kept
  batch from there on, `[b"", topic, seq, batch]` each, then the end marker `[b"", b"", -1 (8 bytes, signed), b""]`;
  the last `buffer_steps` batches are kept.
A thread owns the sockets; the engine's step only queues its events (`publish`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from hybridkv.execution.kv_events_config import KVEventsConfig
from hybridkv.memory.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

logger = logging.getLogger("hybridkv")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# A single engine is data-parallel rank 0, as vLLM numbers it (a subscriber checks the batch's rank).
DATA_PARALLEL_RANK = 0
POLL_SECONDS = 0.1
SHUTDOWN_SECONDS = 5.0
LINGER_MS = 500


def event_fields(event: KVCacheEvent) -> dict[str, Any]:
    """One event as msgspec writes vLLM's tagged struct: "type", then the fields in order, optional ones only when
    set."""
    if isinstance(event, BlockStored):
        fields: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        optional = ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
    elif isinstance(event, BlockRemoved):
        fields = {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
        optional = ("group_idx",)
    elif isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    else:
        raise TypeError(f"not a KV cache event: {event!r}")
    for name in optional:
        value = getattr(event, name)
        if value is not None:
            fields[name] = value
    return fields


def encode_batch(
    ts: float,
    events: Sequence[KVCacheEvent],
    data_parallel_rank: int | None = DATA_PARALLEL_RANK,
) -> bytes:
    """vLLM's `KVEventBatch` as msgpack bytes."""
    import msgpack

    return msgpack.packb([float(ts), [event_fields(event) for event in events], data_parallel_rank])


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host (`*`, `::`) or an ipc:// or inproc:// address is bound; any other is connected
    to (a subscriber that binds, as llm-d's does)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def is_loopback(endpoint: str) -> bool:
    """A tcp:// address on this machine's loopback (`tcp://127.0.0.1:5557`)."""
    return endpoint.startswith("tcp://") and endpoint[len("tcp://") :].rsplit(":", 1)[0] in LOOPBACK_HOSTS


class ZmqEventPublisher:
    """Sends queued event batches from a thread of its own (see the module docstring); `shutdown` sends what is
    queued, then closes the sockets."""

    def __init__(self, config: KVEventsConfig) -> None:
        try:
            import msgpack  # noqa: F401
            import zmq
        except ImportError as error:
            raise ImportError(
                f"kv_events_config needs pyzmq and msgpack ({error}); pip install pyzmq msgpack (or hybridkv[serve])"
            ) from None
        self.config = config
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            elif is_loopback(config.endpoint):
                self._bind_or_connect(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as error:
            self._close_sockets()
            raise OSError(
                f"kv_events_config: cannot open {config.endpoint!r} / {config.replay_endpoint!r}: {error}; "
                "give a free address (e.g. 'tcp://*:5557' or 'ipc:///tmp/hybridkv-events')"
            ) from None
        self.num_batches = 0
        self._thread = threading.Thread(target=self._run, name="hybridkv-kv-events", daemon=True)
        self._thread.start()

    def _bind_or_connect(self, endpoint: str) -> None:
        """A loopback address: bound, so that replicas on one machine publish to a router there (vllm-router's
        subscribers connect, to tcp:// addresses only) without opening a port to the network; connected to where a
        subscriber has bound it already (vLLM's rule, which connects to every address but a wildcard's)."""
        import zmq

        try:
            self._pub.bind(endpoint)
        except zmq.ZMQError as error:
            if error.errno != zmq.EADDRINUSE:
                raise
            self._pub.connect(endpoint)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue a step's events (waits while `max_queue_size` batches are queued, as vLLM's publisher does)."""
        if events:
            self._queue.put((time.time(), events))

    def shutdown(self) -> None:
        """Send the queued batches (for at most a few seconds), then close."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(SHUTDOWN_SECONDS)
        if self._thread.is_alive():
            logger.warning("hybridkv: the KV event publisher did not finish within %s s", SHUTDOWN_SECONDS)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._answer_replay()
                try:
                    item = self._queue.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    continue
                if item is None:
                    break
                ts, events = item
                payload = encode_batch(ts, events)
                seq = self.num_batches
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.num_batches += 1
        except Exception:  # the engine keeps serving; subscribers see the stream stop
            logger.exception("hybridkv: the KV event publisher failed; no more events are sent")
        finally:
            self._close_sockets()

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("hybridkv: a KV event replay request of %d frames ignored (3 expected)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        """Close the sockets, the last batches given a moment to leave."""
        for socket in (self._pub, self._replay):
            if socket is not None:
                with contextlib.suppress(Exception):
                    socket.close(linger=LINGER_MS)
        self._context.term()
