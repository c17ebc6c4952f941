"""Layers -> KV cache groups of uniform page size.

Each group holds layers of one kind, and every group has `group_size` layer slots, so one block id
names the same bytes in every group. KV tensor s is shared by slot s of every group: groups never
collide because they hold different block ids. A kind whose layer count is not a multiple of
`group_size` leaves padding slots in its last group, whose pages are allocated but never written.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.kv_spec import LayerSpec


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """One group: its kind and its real layers, in slot order (slot s uses KV tensor s)."""

    group_id: int
    sliding_window: int | None
    layer_indices: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    """The grouping of a model's attention layers, and the bytes one block id stands for."""

    block_size: int
    group_size: int
    groups: tuple[KVCacheGroupSpec, ...]
    layer_spec: LayerSpec
    padding_layers: int

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_indices) for g in self.groups)

    @property
    def num_kv_tensors(self) -> int:
        """K/V tensor pairs to allocate: one per slot."""
        return self.group_size

    @property
    def block_bytes(self) -> int:
        """Bytes behind one block id: one page in each of the group_size K/V tensor pairs."""
        return self.group_size * self.layer_spec.page_bytes(self.block_size)

    @property
    def padding_fraction(self) -> float:
        """Share of KV memory reserved for padding slots that no layer uses."""
        return self.padding_layers / (self.group_size * len(self.groups))

    def layer_slot(self, layer_idx: int) -> tuple[int, int]:
        """(group id, slot) of a layer."""
        for group in self.groups:
            if layer_idx in group.layer_indices:
                return group.group_id, group.layer_indices.index(layer_idx)
        raise KeyError(f"layer {layer_idx} is not an attention layer of this model")


def choose_group_size(layer_counts: list[int]) -> int:
    """The group size that wastes the fewest padding slots without more groups than needed.

    Candidates are limited to those giving at most as many groups as a group size equal to the
    smallest kind's layer count (vLLM's choice); among them the least padding wins, then the larger
    size (fewer groups, fewer block tables per step). Gemma-3-27B (52 sliding, 10 full): 13 -> 5
    groups, 3 padding slots, where the smallest-kind rule gives 7 groups and 8 padding slots.
    """

    def num_groups(size: int) -> int:
        return sum(-(-n // size) for n in layer_counts)

    max_groups = num_groups(min(layer_counts))
    best_size, best_padding = 0, None
    for size in range(1, max(layer_counts) + 1):
        if num_groups(size) > max_groups:
            continue
        padding = num_groups(size) * size - sum(layer_counts)
        if best_padding is None or padding <= best_padding:
            best_size, best_padding = size, padding
    return best_size


def group_layers(specs: list[LayerSpec], block_size: int) -> KVCacheConfig:
    """Split a model's attention layers into KV cache groups (see the module docstring)."""
    if not specs:
        raise ValueError("the model has no attention layers to cache")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    layers_by_shape: dict[tuple[int, int, int], list[int]] = {}
    for spec in specs:
        layers_by_shape.setdefault((spec.num_kv_heads, spec.head_dim, spec.dtype_bytes), []).append(spec.layer_idx)
    if len(layers_by_shape) > 1:
        found = "; ".join(
            f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}: {heads} kv heads of dim {dim}"
            for (heads, dim, _), layers in layers_by_shape.items()
        )
        raise ValueError(
            f"hybridkv needs every attention layer to store one K/V shape (KV cache groups share one page "
            f"size), but {found}; per-layer KV shapes (e.g. Gemma 4's global_head_dim) are not supported yet"
        )
    layers_by_window: dict[int | None, list[int]] = {}
    for spec in specs:
        layers_by_window.setdefault(spec.sliding_window, []).append(spec.layer_idx)
    group_size = choose_group_size([len(layers) for layers in layers_by_window.values()])
    groups = []
    for window, layers in layers_by_window.items():
        for start in range(0, len(layers), group_size):
            chunk = tuple(layers[start : start + group_size])
            groups.append(KVCacheGroupSpec(len(groups), window, chunk))
    padding = len(groups) * group_size - len(specs)
    return KVCacheConfig(block_size, group_size, tuple(groups), specs[0], padding)
