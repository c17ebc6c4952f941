"""Layers -> KV cache groups of uniform page bytes.

One block id names one page of `block_bytes` bytes, the same in every group, so every group draws on
one pool. A group holds `num_slots` layers of one kind (one attention rule: full, a sliding window or
chunked local attention; one K/V size per token);
its page is cut into per-layer slots, each layer's K then V:

    one block id = one page of block_bytes
    | layer a: K [block_size, heads, dk] | V [block_size, heads, dv] | layer b: K | V | ... | padding |

Layers whose K/V cost different bytes per token (Gemma 4's 512-dim full layers beside 256-dim sliding
ones, MiMo-V2's sliding layers with more kv heads) get groups with different block sizes, as in vLLM:
the kind with the most bytes per token keeps the engine's `block_size`, and a kind needing 1/k of those
bytes holds k times as many tokens per block, so every page has the same bytes and nothing is padded
(when k is not a whole number, the page's tail is). Prefix-cache hashes are kept per `block_size`
tokens; a group of k times that block size names its block by the hash of the block's last
`block_size` tokens, and a hit must end where every group's blocks end (a multiple of every block
size). The alternative, one block size with every slot padded to the widest layer's bytes
(`uniform_block_size=True`), wastes up to half of Gemma 4's KV bytes: benchmarks/kv_layouts.py and
docs/design.md have the measurement.

A kind whose layer count does not fill its last group leaves padding slots there: bytes allocated but
never written, reported. Padding costs in proportion to the blocks its group holds, and a
full-attention group holds a block per block_size tokens of context while a windowed (or chunked)
group holds a window's (chunk's) worth, so the group size keeps full-attention groups free of padding first
(`choose_group_size`). KV-sharing layers hold no pages and belong to no group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridkv.memory.block_pool import cdiv
from hybridkv.memory.kv_spec import LayerSpec


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """One group: its kind, its real layers in slot order, the slots its page has room for, the
    bytes between slots (slot s starts at byte s * slot_bytes of the group's page), the tokens one of
    its blocks holds and the K/V bytes one token costs in each of its layers."""

    group_id: int
    sliding_window: int | None
    layer_indices: tuple[int, ...]
    num_slots: int
    slot_bytes: int
    block_size: int
    token_bytes: int
    attention_chunk_size: int | None = None

    @property
    def is_full_attention(self) -> bool:
        return self.sliding_window is None and self.attention_chunk_size is None

    @property
    def attention_type(self) -> str:
        """Its attention rule: "full", "sliding_window" or "chunked_local" (the coordinator's `MANAGER_CLASSES`)."""
        if self.attention_chunk_size is not None:
            return "chunked_local"
        return "full" if self.sliding_window is None else "sliding_window"

    @property
    def kind(self) -> str:
        if self.attention_chunk_size is not None:
            return f"chunks of {self.attention_chunk_size}"
        return "full" if self.sliding_window is None else f"window {self.sliding_window}"

    @property
    def padding_slots(self) -> int:
        return self.num_slots - len(self.layer_indices)

    @property
    def used_bytes(self) -> int:
        """Bytes of one page its layers write."""
        return len(self.layer_indices) * self.block_size * self.token_bytes


@dataclass(frozen=True)
class KVCacheConfig:
    """The grouping of a model's attention layers, and the bytes one block id stands for.

    `block_size` is the tokens per block of the groups with the most bytes per token, and the
    granularity of prefix-cache hashes; every group's block size is a multiple of it.
    """

    block_size: int
    groups: tuple[KVCacheGroupSpec, ...]
    layer_specs: tuple[LayerSpec, ...]
    block_bytes: int

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_indices) for g in self.groups)

    @property
    def group_size(self) -> int:
        """Layer slots per group (every group has the same number)."""
        return max(g.num_slots for g in self.groups)

    @property
    def padding_layers(self) -> int:
        return sum(g.padding_slots for g in self.groups)

    @property
    def padding_fraction(self) -> float:
        """Share of the groups' page bytes that no layer writes (padding slots, padded slots and tails)."""
        return 1 - sum(g.used_bytes for g in self.groups) / (len(self.groups) * self.block_bytes)

    @property
    def hit_alignment(self) -> int:
        """Tokens a prefix-cache hit is a multiple of: the least common multiple of the block sizes
        (where every group's blocks end; the largest block size when each divides the next)."""
        return math.lcm(*(g.block_size for g in self.groups))

    @property
    def shared_layers(self) -> dict[int, int]:
        """KV-sharing layer -> the layer whose pages it reads."""
        return {spec.layer_idx: spec.kv_source for spec in self.layer_specs if spec.kv_source is not None}

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token costs across the layers that hold pages: what the model needs."""
        return sum(spec.kv_bytes_per_token for spec in self.layer_specs if spec.holds_pages)


def choose_group_size(full_counts: list[int], sliding_counts: list[int]) -> int:
    """Layers per group for kinds of these layer counts (full-attention kinds, windowed or chunked kinds).

    At most as many groups as a group size equal to the smallest kind's layer count (vLLM's rule).
    Among those: no padding slot in a full-attention group if possible (each wastes a page-slot for
    every block_size tokens of context), then the fewest groups (fewer block tables per step), then
    the least padding in windowed groups (each wastes a window's worth at most). Gemma-3-27B (52
    sliding, 10 full) -> 10: one full group, six sliding ones with 8 padding slots, 2% above the
    ideal KV bytes at 32k tokens, where 13 a group (3 padding slots in the full group) is 26% above.
    """
    counts = full_counts + sliding_counts

    def num_groups(size: int) -> int:
        return sum(cdiv(n, size) for n in counts)

    def padding(size: int, kinds: list[int]) -> int:
        return sum(cdiv(n, size) * size - n for n in kinds)

    max_groups = num_groups(min(counts))
    candidates = [size for size in range(1, max(counts) + 1) if num_groups(size) <= max_groups]
    return min(
        candidates, key=lambda size: (padding(size, full_counts), num_groups(size), padding(size, sliding_counts))
    )


def group_layers(
    specs: list[LayerSpec], block_size: int, group_size: int | None = None, uniform_block_size: bool = False
) -> KVCacheConfig:
    """Split a model's attention layers into KV cache groups (see the module docstring).

    `group_size` overrides `choose_group_size`; `uniform_block_size` pads every slot to the widest
    layer's bytes instead of giving narrower kinds larger blocks (benchmarks/kv_layouts.py compares both).
    """
    if not specs:
        raise ValueError("the model has no attention layers to cache")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    _check_kv_sources(specs)
    # A kind: (window, chunk size, bytes per token); None, None is full attention.
    kinds: dict[tuple[int | None, int | None, int], list[int]] = {}
    example: dict[int, LayerSpec] = {}  # a layer of each bytes per token
    for spec in specs:
        if spec.holds_pages:
            kind = (spec.sliding_window, spec.attention_chunk_size, spec.kv_bytes_per_token)
            kinds.setdefault(kind, []).append(spec.layer_idx)
            example.setdefault(spec.kv_bytes_per_token, spec)
    if group_size is None:
        bounded = {kind: kind[:2] != (None, None) for kind in kinds}
        group_size = choose_group_size(
            [len(layers) for kind, layers in kinds.items() if not bounded[kind]],
            [len(layers) for kind, layers in kinds.items() if bounded[kind]],
        )
    widest = max(example)
    widest_slot = example[widest].page_bytes(block_size)
    groups = []
    for (window, chunk_size, token_bytes), layers in kinds.items():
        group_block_size = block_size if uniform_block_size else block_size * (widest // token_bytes)
        slot_bytes = widest_slot if uniform_block_size else example[token_bytes].page_bytes(group_block_size)
        for start in range(0, len(layers), group_size):
            members = tuple(layers[start : start + group_size])
            groups.append(
                KVCacheGroupSpec(
                    len(groups), window, members, group_size, slot_bytes, group_block_size, token_bytes, chunk_size
                )
            )
    return KVCacheConfig(block_size, tuple(groups), tuple(specs), group_size * widest_slot)


def _check_kv_sources(specs: list[LayerSpec]) -> None:
    by_layer = {spec.layer_idx: spec for spec in specs}
    for spec in specs:
        if spec.kv_source is None:
            continue
        source = by_layer.get(spec.kv_source)
        if source is None or not source.holds_pages:
            raise ValueError(f"layer {spec.layer_idx} reads the K/V of layer {spec.kv_source}, which holds no pages")
        if source.attention_chunk_size is not None and spec.attention_chunk_size != source.attention_chunk_size:
            raise ValueError(
                f"layer {spec.layer_idx} reads the K/V of layer {spec.kv_source}, which keeps only its current "
                f"chunk of {source.attention_chunk_size}; only a layer of the same chunks can share it"
            )
        if source.sliding_window is not None and (
            spec.sliding_window is None or spec.sliding_window > source.sliding_window
        ):
            raise ValueError(
                f"layer {spec.layer_idx} attends further back ({spec.sliding_window or 'full attention'}) than "
                f"layer {spec.kv_source}, whose K/V it reads, keeps (window {source.sliding_window})"
            )
