"""KV bytes one request holds on published hybrid layouts, against the ideal, per group-size rule.

The ideal is what the layers need: every full-attention layer keeps every token, every sliding layer
the last W - 1 (plus the one being decoded), and KV-sharing layers nothing. hybridkv holds whole
blocks per group, and padding slots cost their bytes in every block their group holds. The rule in
hybridkv/grouping.py (padding out of full-attention groups first) is compared with the previous rule
(least padding slots overall) and vLLM's (group size = the smallest kind's layer count). Layouts come
from published configs (transformers' documented defaults for Gemma 3n E4B). No model is built.

    python benchmarks/kv_layouts.py
"""

from __future__ import annotations

from hybridkv.coordinator import blocks_for_request
from hybridkv.grouping import group_layers
from hybridkv.kv_spec import LayerSpec

BLOCK_SIZE = 16
CONTEXTS = (4096, 32768)


def gemma3(num_layers: int, kv_heads: int, head_dim: int, window: int = 1024) -> list[LayerSpec]:
    """Gemma 3: 5 sliding : 1 full, bf16."""
    return [LayerSpec(i, None if (i + 1) % 6 == 0 else window, kv_heads, head_dim, 2) for i in range(num_layers)]


def gemma3n_e4b() -> list[LayerSpec]:
    """35 layers, 4 sliding (512) : 1 full, 2 kv heads x 256, bf16; layers 20-34 reuse layer 18 / 19."""
    windows = [None if (i + 1) % 5 == 0 else 512 for i in range(35)]
    return [
        LayerSpec(i, w, 2, 256, 2, kv_source=None if i < 20 else (19 if w is None else 18))
        for i, w in enumerate(windows)
    ]


LAYOUTS = {
    "Gemma-3-1B (26 layers, 1 kv head x 256, W=512)": gemma3(26, 1, 256, window=512),
    "Gemma-3-12B (48 layers, 8 kv heads x 256)": gemma3(48, 8, 256),
    "Gemma-3-27B (62 layers, 16 kv heads x 128)": gemma3(62, 16, 128),
    "Gemma 3n E4B (35 layers, 15 share K/V)": gemma3n_e4b(),
}


def previous_rule(counts: list[int]) -> int:
    """The rule before this change: least padding slots overall, then the larger group."""

    def groups(size: int) -> int:
        return sum(-(-n // size) for n in counts)

    limit = groups(min(counts))
    best = None
    for size in range(1, max(counts) + 1):
        padding = groups(size) * size - sum(counts)
        if groups(size) <= limit and (best is None or padding <= best[1]):
            best = (size, padding)
    return best[0]


def ideal_bytes(specs: list[LayerSpec], tokens: int) -> int:
    return sum(
        spec.kv_bytes_per_token * (tokens if spec.sliding_window is None else min(tokens, spec.sliding_window))
        for spec in specs
        if spec.holds_pages
    )


def main() -> None:
    for name, specs in LAYOUTS.items():
        print(name)
        paged = [spec for spec in specs if spec.holds_pages]
        counts = [
            sum(spec.sliding_window is None for spec in paged),
            sum(spec.sliding_window is not None for spec in paged),
        ]
        rules = {
            "hybridkv (padding out of full groups)": None,
            "previous (least padding slots)": previous_rule([c for c in counts if c]),
            "vLLM (smallest kind's count)": min(c for c in counts if c),
        }
        for rule, size in rules.items():
            config = group_layers(specs, BLOCK_SIZE, group_size=size)
            full_padding = sum(g.padding_slots for g in config.groups if g.sliding_window is None)
            cells = []
            for tokens in CONTEXTS:
                held = blocks_for_request(config, tokens, max_chunk_tokens=1) * config.block_bytes
                cells.append(f"{tokens // 1024}k: {held / ideal_bytes(specs, tokens):.3f}x ideal")
            print(
                f"  {rule:<38} {len(config.groups)} groups of {config.group_size}, padding slots "
                f"{config.padding_layers} ({full_padding} in full groups) | " + " | ".join(cells)
            )
        total = sum(spec.kv_bytes_per_token for spec in specs)
        print(f"  KV bytes per token: {config.kv_bytes_per_token:,} (a page for every layer: {total:,})")


if __name__ == "__main__":
    main()
