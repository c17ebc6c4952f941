"""vLLM's KV cache events, as the memory manager records them: what a router's index needs to know where each prefix
lives (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`; the engine publishes them: hybridkv/engine/kv_events.py).

The events are vLLM's (`vllm.distributed.kv_events`), field for field, so that an index built for vLLM (vllm-router's
`kv_aware` policy, llm-d's, Dynamo's) reads hybridkv's unchanged:
- a block's hash is vLLM's integer form of it (`external_hash`: the digest's last 8 bytes, big-endian, as vLLM sends
  by default); `parent_block_hash` is the previous block's, None for a request's first block; `token_ids` are the
  block's tokens, so an index can hash them its own way (vllm-router does);
- `medium` is where the copy lives: "GPU" for the pool (on every device: vLLM's word for the engine's own memory),
  "CPU" for the host tier, "DISK" for the disk tier (hybridkv/memory/tiers.py);
- `lora_id` and `lora_name` are the request's adapter (`LoRARequest`), None for the model alone.

Hybrid models, as vLLM marks them and beyond (docs/design.md, "KV events"):
- every KV cache group publishes its own blocks, with `group_idx` and, on `BlockStored`, `kv_cache_spec_kind`
  ("full_attention", "sliding_window", "chunked_local_attention") and `kv_cache_spec_sliding_window`; the groups are
  numbered prefix-closed (full attention) first, so that group 0 is the one an index that reads a single group
  (vllm-router's) needs: where it holds a prefix, the prefix is cached;
- a sliding group's blocks stay announced while the pool keeps them (a window's blocks a request has moved past are
  cached until evicted), so that an index can tell whether the blocks before a hit's end are still there;
- a model with state layers publishes its state checkpoints as one more group, of kind "mamba" (vLLM's word for a
  recurrent state): one `BlockStored` per checkpoint, whose one hash names the block the checkpoint follows, so the
  prefix a state can be restored at is the one ending there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GPU, CPU, DISK = "GPU", "CPU", "DISK"

# vLLM's `kv_cache_spec_kind` of each manager kind (hybridkv/memory/managers.py, window_managers.py).
SPEC_KINDS = {
    "full attention": "full_attention",
    "sliding window": "sliding_window",
    "chunked local attention": "chunked_local_attention",
}
STATE_KIND = "mamba"


@dataclass(frozen=True)
class BlockStored:
    """Full blocks, one chain (each block's parent is the one before it), now held in `medium`."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks no longer held in `medium`."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of every medium is gone (a reset of the prefix cache, or the pool put to sleep)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def external_hash(block_hash: bytes) -> int:
    """A block hash as vLLM publishes it by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): an unsigned 64-bit
    integer, the digest's last 8 bytes read big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True)
class GroupShape:
    """What the events say of one published group: its block size, kind and window."""

    block_size: int
    kind: str
    sliding_window: int | None = None


@dataclass(frozen=True)
class BlockChain:
    """Blocks of one request to announce: the group's hashes of them (in order), the hash before the first (None at
    the prompt's start), their tokens, and the request's adapter."""

    hashes: Sequence[bytes]
    parent: bytes | None
    token_ids: Sequence[int]
    lora: tuple[int, str] | None = None


class KVEventRecorder:
    """The events since the last `take`, recorded where the memory manager stores and drops blocks.

    `shapes[g]` describes hybridkv's group g, published as group `order[g]`; `state_group` is the published number of
    the state checkpoints' group (None without state layers), which the memory manager calls `checkpoint_key` (its
    tiers' key: hybridkv/memory/state_slots.py's STATE_GROUP). What a lower tier stores, the recorder announces with
    the parent and tokens it announced for the pool's copy (`_known`, kept while some medium holds the block).
    """

    def __init__(
        self,
        shapes: Sequence[GroupShape],
        order: Sequence[int],
        state_group: int | None = None,
        checkpoint_key: int = -1,
    ) -> None:
        self.shapes = list(shapes)
        self.order = list(order)
        self.state_group = state_group
        self.checkpoint_key = checkpoint_key
        self.events: list[KVCacheEvent] = []
        # (hybridkv group id or checkpoint_key, hash) -> (parent, tokens, lora, media holding it).
        self._known: dict[tuple[int, bytes], tuple[bytes | None, tuple[int, ...], tuple[int, str] | None, set]] = {}
        self._planned: dict[bytes, BlockChain] = {}  # checkpoints a step writes, announced once it ran

    @property
    def block_size(self) -> int:
        """The tokens per block of published group 0 (what a single-group index chunks prompts by)."""
        return self.shapes[self.order.index(0)].block_size

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def stored(self, group_id: int, chain: BlockChain, medium: str = GPU) -> None:
        """The group's blocks of `chain` are held in `medium` now (its pool: "GPU")."""
        shape = self.shapes[group_id]
        size = shape.block_size
        parent = chain.parent
        for index, block_hash in enumerate(chain.hashes):
            tokens = tuple(chain.token_ids[index * size : (index + 1) * size])
            self._hold((group_id, block_hash), parent, tokens, chain.lora, medium)
            parent = block_hash
        self.events.append(
            BlockStored(
                block_hashes=[external_hash(h) for h in chain.hashes],
                parent_block_hash=None if chain.parent is None else external_hash(chain.parent),
                token_ids=list(chain.token_ids),
                block_size=size,
                lora_id=None if chain.lora is None else chain.lora[0],
                medium=medium,
                lora_name=None if chain.lora is None else chain.lora[1],
                group_idx=self.order[group_id],
                kv_cache_spec_kind=shape.kind,
                kv_cache_spec_sliding_window=shape.sliding_window,
            )
        )

    def removed(self, group_id: int, block_hash: bytes, medium: str = GPU) -> None:
        """The group's block `block_hash` is no longer held in `medium`."""
        key = (group_id, block_hash)
        known = self._known.get(key)
        if known is None or medium not in known[3]:
            return
        known[3].discard(medium)
        if not known[3]:
            del self._known[key]
        group_idx = self.state_group if group_id == self.checkpoint_key else self.order[group_id]
        self.events.append(BlockRemoved([external_hash(block_hash)], medium, group_idx))

    def copied(self, group_id: int, block_hash: bytes, medium: str) -> None:
        """A lower tier (`medium`) holds a copy of a block announced before: announced with the same parent and
        tokens; nothing for a block never announced (one a tier read from a file of another process)."""
        known = self._known.get((group_id, block_hash))
        if known is None or medium in known[3]:
            return
        parent, tokens, lora, _ = known
        if group_id == self.checkpoint_key:
            self.checkpoint_stored(block_hash, parent, tokens, lora, medium)
        else:
            self.stored(group_id, BlockChain([block_hash], parent, tokens, lora), medium)

    def checkpoint_stored(
        self,
        block_hash: bytes,
        parent: bytes | None,
        token_ids: Sequence[int],
        lora: tuple[int, str] | None,
        medium: str = GPU,
    ) -> None:
        """A state checkpoint after the block `block_hash` (whose tokens are `token_ids`) is held in `medium`."""
        self._hold((self.checkpoint_key, block_hash), parent, tuple(token_ids), lora, medium)
        self.events.append(
            BlockStored(
                block_hashes=[external_hash(block_hash)],
                parent_block_hash=None if parent is None else external_hash(parent),
                token_ids=list(token_ids),
                block_size=len(token_ids),
                lora_id=None if lora is None else lora[0],
                medium=medium,
                lora_name=None if lora is None else lora[1],
                group_idx=self.state_group,
                kv_cache_spec_kind=STATE_KIND,
            )
        )

    def checkpoint_planned(self, block_hash: bytes, chain: BlockChain) -> None:
        """A step will write a state checkpoint after the block `block_hash` (`chain`: that one block); announced
        once the step ran (`checkpoints_written`)."""
        self._planned[block_hash] = chain

    def checkpoints_written(self, block_hashes: Sequence[bytes]) -> None:
        """The step ran: its planned checkpoints hold their states."""
        for block_hash in block_hashes:
            chain = self._planned.pop(block_hash, None)
            if chain is not None:
                self.checkpoint_stored(block_hash, chain.parent, chain.token_ids, chain.lora)
        self._planned.clear()

    def checkpoints_discarded(self) -> None:
        """The step failed: none of its planned checkpoints is announced."""
        self._planned.clear()

    def cleared(self) -> None:
        """Every medium dropped every block (`reset_prefix_cache`, `sleep`)."""
        self._known.clear()
        self.events.append(AllBlocksCleared())

    def holds(self, group_id: int, block_hash: bytes, medium: str = GPU) -> bool:
        known = self._known.get((group_id, block_hash))
        return known is not None and medium in known[3]

    def _hold(
        self,
        key: tuple[int, bytes],
        parent: bytes | None,
        tokens: tuple[int, ...],
        lora: tuple[int, str] | None,
        medium: str,
    ) -> None:
        known = self._known.get(key)
        if known is None:
            self._known[key] = (parent, tokens, lora, {medium})
        else:
            known[3].add(medium)
