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


@dataclass(slots=True)
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


@dataclass(slots=True)
class BlockRemoved:
    """Blocks no longer held in `medium`."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


@dataclass(slots=True)
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
    the parent and tokens it announced for the pool's copy (`_known`: per block size and hash, those and the (group,
    medium) pairs that hold the block, kept while one does). Groups of one block size that cache the same blocks (most
    of a hybrid model's) share one chain's work: one `stored` call, an event each. With `hybrid_groups` False only
    published group 0 is recorded (no other group, no checkpoint): what an index that admits full-attention events
    only takes.
    """

    def __init__(
        self,
        shapes: Sequence[GroupShape],
        order: Sequence[int],
        state_group: int | None = None,
        checkpoint_key: int = -1,
        hybrid_groups: bool = True,
    ) -> None:
        self.shapes = list(shapes)
        self.order = list(order)
        self.checkpoint_key = checkpoint_key
        self.hybrid_groups = hybrid_groups
        # The published state checkpoints' group: None without state layers, or with group 0 alone.
        self.state_group = state_group if hybrid_groups else None
        self._first_group = self.order.index(0)
        # A checkpoint names the block (of the smallest group block size) it follows.
        self._checkpoint_size = min(shape.block_size for shape in self.shapes)
        self.events: list[KVCacheEvent] = []
        # (block size, hash) -> [parent, tokens, lora, {(hybridkv group id or checkpoint_key, medium), ...}].
        self._known: dict[tuple[int, bytes], list] = {}
        self._planned: dict[bytes, BlockChain] = {}  # checkpoints a step writes, announced once it ran

    @property
    def block_size(self) -> int:
        """The tokens per block of published group 0 (what a single-group index chunks prompts by)."""
        return self.shapes[self._first_group].block_size

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def stored(self, group_ids: Sequence[int], chain: BlockChain, medium: str = GPU) -> None:
        """The blocks of `chain` are held in `medium` now (the pool: "GPU") in each of the groups (all of one block
        size)."""
        if not self.hybrid_groups:
            if self._first_group not in group_ids:
                return
            group_ids = (self._first_group,)
        size = self.shapes[group_ids[0]].block_size
        self._hold(group_ids, size, chain, medium)
        hashes = [external_hash(h) for h in chain.hashes]
        parent = None if chain.parent is None else external_hash(chain.parent)
        tokens = list(chain.token_ids)
        lora_id, lora_name = chain.lora or (None, None)
        for group_id in group_ids:
            shape = self.shapes[group_id]
            self.events.append(
                BlockStored(
                    hashes, parent, tokens, size, lora_id, medium, lora_name, self.order[group_id], shape.kind,
                    shape.sliding_window,
                )
            )  # fmt: skip

    def checkpoint_stored(self, block_hash: bytes, chain: BlockChain, medium: str = GPU) -> None:
        """A state checkpoint after the block `block_hash` (`chain`: that one block) is held in `medium`."""
        if self.state_group is None:
            return
        size = len(chain.token_ids)
        self._hold((self.checkpoint_key,), size, chain, medium)
        lora_id, lora_name = chain.lora or (None, None)
        parent = None if chain.parent is None else external_hash(chain.parent)
        self.events.append(
            BlockStored(
                [external_hash(block_hash)], parent, list(chain.token_ids), size, lora_id, medium, lora_name,
                self.state_group, STATE_KIND,
            )
        )  # fmt: skip

    def removed(self, group_id: int, block_hash: bytes, medium: str = GPU) -> None:
        """The group's block `block_hash` is no longer held in `medium` (nothing for one never announced)."""
        checkpoint = group_id == self.checkpoint_key
        size = self._checkpoint_size if checkpoint else self.shapes[group_id].block_size
        key = (size, block_hash)
        known = self._known.get(key)
        if known is None or (group_id, medium) not in known[3]:
            return
        known[3].discard((group_id, medium))
        if not known[3]:
            del self._known[key]
        group_idx = self.state_group if checkpoint else self.order[group_id]
        self.events.append(BlockRemoved([external_hash(block_hash)], medium, group_idx))

    def copied(self, group_id: int, block_hash: bytes, medium: str) -> None:
        """A lower tier (`medium`) holds a copy of a block announced before: announced with the same parent and
        tokens; nothing for a block never announced (one a tier read from a file of another process)."""
        checkpoint = group_id == self.checkpoint_key
        size = self._checkpoint_size if checkpoint else self.shapes[group_id].block_size
        known = self._known.get((size, block_hash))
        if known is None or (group_id, medium) in known[3]:
            return
        parent, tokens, lora, _ = known
        chain = BlockChain([block_hash], parent, tokens, lora)
        if checkpoint:
            self.checkpoint_stored(block_hash, chain, medium)
        else:
            self.stored([group_id], chain, medium)

    def checkpoint_planned(self, block_hash: bytes, chain: BlockChain) -> None:
        """A step will write a state checkpoint after the block `block_hash` (`chain`: that one block); announced
        once the step ran (`checkpoints_written`)."""
        if self.state_group is not None:
            self._planned[block_hash] = chain

    def checkpoints_written(self, block_hashes: Sequence[bytes]) -> None:
        """The step ran: its planned checkpoints hold their states."""
        for block_hash in block_hashes:
            chain = self._planned.pop(block_hash, None)
            if chain is not None:
                self.checkpoint_stored(block_hash, chain)
        self._planned.clear()

    def checkpoints_discarded(self) -> None:
        """The step failed: none of its planned checkpoints is announced."""
        self._planned.clear()

    def cleared(self) -> None:
        """Every medium dropped every block (`reset_prefix_cache`, `sleep`)."""
        self._known.clear()
        self.events.append(AllBlocksCleared())

    def _hold(self, group_ids: Sequence[int], size: int, chain: BlockChain, medium: str) -> None:
        """Remember each block of `chain` (its parent, tokens and adapter) as held by the groups in `medium`."""
        known, parent, tokens = self._known, chain.parent, chain.token_ids
        holders = [(group_id, medium) for group_id in group_ids]
        for index, block_hash in enumerate(chain.hashes):
            entry = known.get((size, block_hash))
            if entry is None:
                block_tokens = tuple(tokens[index * size : (index + 1) * size])
                known[size, block_hash] = [parent, block_tokens, chain.lora, set(holders)]
            else:
                entry[3].update(holders)
            parent = block_hash
