"""vLLM's KV cache events (hybridkv/memory/kv_events.py, hybridkv/engine/kv_events.py): a subscriber that reads them
over ZMQ rebuilds exactly what each tier holds (every stored block announced, every evicted one removed, nothing
announced that was never stored), on a plain model, a sliding-window hybrid and a state-layer hybrid, through the host
tier and state checkpoints; the bytes are msgspec's for vLLM's own structs; replay gives every kept batch."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
import torch
import zmq
from lora_adapters import make_adapters

import hybridkv
from hybridkv import SamplingParams
from hybridkv.engine.kv_events import END_SEQ, encode_batch
from hybridkv.execution.kv_events_config import KVEventsConfig
from hybridkv.memory.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, external_hash
from hybridkv.memory.state_slots import STATE_GROUP
from hybridkv.tiny import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=10)
TIMEOUT_MS = 5000


# vLLM's structs (vllm/distributed/kv_events.py), as msgspec encodes them: the bytes hybridkv must send.
class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


def test_a_batch_is_the_bytes_msgspec_writes_for_vllms_structs():
    ours = [
        BlockStored([2**64 - 1, 7], None, [1, 2, 3, 4], 2, None, "GPU", None, 0, "full_attention"),
        BlockStored([9], 7, [5, 6], 2, 3, "CPU", "sql", 2, "sliding_window", 16),
        BlockRemoved([5], "GPU", 0),
        BlockRemoved([6], "DISK"),
        AllBlocksCleared(),
    ]
    vllm = [
        VllmBlockStored([2**64 - 1, 7], None, [1, 2, 3, 4], 2, None, "GPU", None, group_idx=0,
                        kv_cache_spec_kind="full_attention"),
        VllmBlockStored([9], 7, [5, 6], 2, 3, "CPU", "sql", group_idx=2, kv_cache_spec_kind="sliding_window",
                        kv_cache_spec_sliding_window=16),
        VllmBlockRemoved([5], "GPU", 0),
        VllmBlockRemoved([6], "DISK"),
        VllmAllBlocksCleared(),
    ]  # fmt: skip
    expected = msgspec.msgpack.encode(VllmEventBatch(1.5, vllm, 0))
    assert encode_batch(1.5, ours, 0) == expected
    decoded = msgspec.msgpack.decode(encode_batch(1.5, ours), type=VllmEventBatch)
    assert decoded.data_parallel_rank == 0 and len(decoded.events) == 5


def test_a_hash_is_vllms_unsigned_64_bit_integer():
    digest = bytes(range(32))
    assert external_hash(digest) == int.from_bytes(digest[-8:], "big") < 2**64


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher must be one of"),
        ({"enable_kv_cache_events": True, "buffer_step": 10}, r"unknown field\(s\) \['buffer_step'\]"),
        ({"enable_kv_cache_events": "yes"}, "must be true or false"),
        ({"enable_kv_cache_events": True, "hybrid_groups": 0}, "hybrid_groups must be true or false"),
        ({"enable_kv_cache_events": True, "hwm": 0}, "hwm must be a positive integer"),
        ("tcp://*:5557", "must be a dict"),
    ],
)
def test_a_bad_kv_events_config_names_the_fix(value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        KVEventsConfig.of(value)


def test_events_need_prefix_caching():
    with pytest.raises(ValueError, match="turn prefix caching on"):
        config = {"enable_kv_cache_events": True}
        hybridkv.patch(tiny_model("llama"), enable_prefix_caching=False, kv_events_config=config)


def replay(endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    """Every kept batch from `start` on, as vllm-router asks for them (a DEALER socket): (seq, payload) pairs."""
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.connect(endpoint)
    socket.send_multipart([b"", start.to_bytes(8, "big")])
    batches = []
    try:
        while True:
            assert socket.poll(TIMEOUT_MS), "no answer to the replay request"
            empty, topic, seq, payload = socket.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return batches
            assert topic == b"kv"
            batches.append((int.from_bytes(seq, "big"), payload))
    finally:
        socket.close(linger=0)


class Index:
    """What a subscriber rebuilds: (published group, medium, hash) of every block held, failing on a block stored
    twice or removed without being stored."""

    def __init__(self) -> None:
        self.held: set[tuple[int, str, int]] = set()
        self.stored: list[dict] = []

    def apply(self, payload: bytes) -> None:
        ts, events, rank = msgpack.unpackb(payload)
        assert rank == 0 and ts > 0
        for event in events:
            if event["type"] == "AllBlocksCleared":
                self.held.clear()
                continue
            for block_hash in event["block_hashes"]:
                key = (event["group_idx"], event["medium"], block_hash)
                if event["type"] == "BlockStored":
                    assert key not in self.held, f"stored twice: {key}"
                    self.held.add(key)
                else:
                    assert key in self.held, f"removed, never stored: {key}"
                    self.held.remove(key)
            if event["type"] == "BlockStored":
                self.stored.append(event)
                assert len(event["token_ids"]) == len(event["block_hashes"]) * event["block_size"]


def held_now(llm) -> set[tuple[int, str, int]]:
    """What the engine's pool, state checkpoints and host tier hold, as the events name it."""
    coordinator = llm.core.coordinator
    recorder = coordinator.events
    held = set()
    for group_id, cached in enumerate(coordinator.pool.cached):
        held.update((recorder.order[group_id], "GPU", external_hash(h)) for h in cached)
    checkpoints = coordinator.state_checkpoints
    if checkpoints is not None:
        held.update((recorder.state_group, "GPU", external_hash(h)) for h in checkpoints._kept)
    tiers = [coordinator.tiers, checkpoints.tiers if checkpoints is not None else None]
    for tier in tiers:
        for group_id, block_hash in tier._host if tier is not None else ():
            group = recorder.state_group if group_id == STATE_GROUP else recorder.order[group_id]
            held.add((group, "CPU", external_hash(block_hash)))
    return held


def sessions(llm, count: int, turns: int, seed: int = 0, lora_requests=None) -> None:
    """`count` multi-turn sessions over the engine: each turn's prompt is the last turn's plus its answer and more."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 200, (40,), generator=generator).tolist() for _ in range(count)]
    for _ in range(turns):
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora_requests
        )
        prompts = [
            p + list(o.outputs[0].token_ids) + torch.randint(3, 200, (12,), generator=generator).tolist()
            for p, o in zip(prompts, outputs, strict=True)
        ]


def events_config(tmp_path) -> dict:
    return {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{tmp_path}/events",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
        "topic": "kv",
    }


@pytest.mark.fast_if(lambda family, hybrid_groups, **_: hybrid_groups or family == "gemma3")
@pytest.mark.parametrize(
    ("family", "settings", "hybrid_groups"),
    [
        ("llama", {"num_blocks": 40}, True),
        ("gemma3", {"num_blocks": 60}, True),
        ("gemma3", {"num_blocks": 60, "kv_offloading_size": 0.0002}, True),
        ("qwen3_5", {"num_blocks": 60, "kv_offloading_size": 0.002}, True),
        ("gemma3", {"num_blocks": 60, "kv_offloading_size": 0.0002}, False),
        ("qwen3_5", {"num_blocks": 60, "kv_offloading_size": 0.002}, False),
    ],
    ids=[
        "llama", "gemma3-sliding", "gemma3-host-tier", "qwen3_5-checkpoints-host-tier", "gemma3-group-0-only",
        "qwen3_5-group-0-only",
    ],
)  # fmt: skip
def test_a_subscriber_rebuilds_what_every_tier_holds(tmp_path, family, settings, hybrid_groups):
    """With hybrid_groups False only group 0 (full attention) is published: exactly its blocks, in every tier."""
    model = tiny_model(family)
    config = {**events_config(tmp_path), "hybrid_groups": hybrid_groups}
    llm = hybridkv.patch(model, block_size=8, max_model_len=128, kv_events_config=config, **settings)
    try:
        sessions(llm, count=4, turns=3)
        assert llm.core.coordinator.pool.num_evictions > 0  # the pool was too small: blocks were removed too
        batches = replay(f"ipc://{tmp_path}/replay")
        assert [seq for seq, _ in batches] == list(range(len(batches))) and batches
        index = Index()
        for _, payload in batches:
            index.apply(payload)
        held = held_now(llm)
        assert index.held == (held if hybrid_groups else {key for key in held if key[0] == 0})
        media = {event["medium"] for event in index.stored}
        assert media == ({"GPU", "CPU"} if "kv_offloading_size" in settings else {"GPU"})
        groups = {event["group_idx"]: (event["kv_cache_spec_kind"], event.get("kv_cache_spec_sliding_window"))
                  for event in index.stored}  # fmt: skip
        assert groups[0] == ("full_attention", None)  # group 0 is the one a single-group index reads
        if not hybrid_groups:
            assert set(groups) == {0}
        elif family == "gemma3":
            assert ("sliding_window", model.config.sliding_window) in groups.values()
        elif family == "qwen3_5":
            assert ("mamba", None) in groups.values()
        llm.reset_prefix_cache()
        final = replay(f"ipc://{tmp_path}/replay", start=len(batches))
        assert msgpack.unpackb(final[-1][1])[1][-1] == {"type": "AllBlocksCleared"}
    finally:
        hybridkv.unpatch(model)


def test_a_block_names_its_tokens_parent_and_adapter(tmp_path):
    """What an index hashes its own way (vllm-router hashes the token ids): each stored chain's tokens are the prompt's,
    its parent the previous block's hash (None at the start), and a request's LoRA adapter its lora_id and lora_name."""
    model = tiny_model("llama")
    (adapter,) = make_adapters(model, tmp_path, 1)
    llm = hybridkv.patch(
        model, block_size=8, max_model_len=128, enable_lora=True, kv_events_config=events_config(tmp_path)
    )
    try:
        prompt = list(range(3, 3 + 35))
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        llm.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), lora_request=adapter,
            use_tqdm=False,
        )  # fmt: skip
        index = Index()
        for _, payload in replay(f"ipc://{tmp_path}/replay"):
            index.apply(payload)
        base, tuned = index.stored
        for event, lora in ((base, (None, None)), (tuned, (1, "a0"))):
            assert event["token_ids"] == prompt[:32] and event["parent_block_hash"] is None
            assert (event["lora_id"], event["lora_name"]) == lora and len(event["block_hashes"]) == 4
        assert not set(base["block_hashes"]) & set(tuned["block_hashes"])  # another adapter: other blocks
    finally:
        hybridkv.unpatch(model)


def test_a_live_subscriber_sees_each_steps_batch_in_order(tmp_path):
    model = tiny_model("llama")
    config = events_config(tmp_path)
    llm = hybridkv.patch(model, block_size=8, max_model_len=128, kv_events_config=config)
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"kv")
    socket.connect(config["endpoint"])
    try:
        # A SUB socket misses what is sent before it joins: send until one batch arrives, then check the stream.
        seen = []
        for attempt in range(50):
            llm.generate([{"prompt_token_ids": list(range(3 + attempt, 40 + attempt))}], GREEDY, use_tqdm=False)
            if socket.poll(100):
                break
        assert socket.poll(TIMEOUT_MS), "no batch reached the subscriber"
        sessions(llm, count=2, turns=2)
        while socket.poll(500):
            topic, seq, _ = socket.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            seen.append(int.from_bytes(seq, "big"))
        assert seen == list(range(seen[0], seen[0] + len(seen))) and len(seen) > 3
    finally:
        socket.close(linger=0)
        hybridkv.unpatch(model)
