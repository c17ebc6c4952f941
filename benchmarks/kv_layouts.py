"""KV bytes one request holds on published hybrid layouts, against the ideal, per grouping rule.

The ideal is what the layers need: every full-attention layer keeps every token, a sliding layer the
last W (a chunked layer at most a chunk of C), KV-sharing layers nothing. hybridkv holds whole blocks
per group, and padding costs its bytes in every block its group holds. Compared, on the layouts of
hybridkv/memory/layouts.py (from published config.json values; no model is built):

- group size: hybridkv's rule (padding out of full-attention groups first) against vLLM's (the
  smallest kind's layer count);
- layers of different K/V bytes per token: per-group block sizes (hybridkv's default, vLLM's way:
  a kind of half the bytes holds twice the tokens per block) against one block size with every slot
  padded to the widest layer's bytes (`uniform_block_size=True`).

    python benchmarks/kv_layouts.py
"""

from __future__ import annotations

from hybridkv.memory.coordinator import blocks_for_request
from hybridkv.memory.grouping import group_layers
from hybridkv.memory.kv_spec import LayerSpec
from hybridkv.memory.layouts import PUBLISHED

BLOCK_SIZE = 16
CONTEXTS = (4096, 32768)


def ideal_bytes(specs: list[LayerSpec], tokens: int) -> int:
    def kept(spec: LayerSpec) -> int:
        reach = spec.sliding_window or spec.attention_chunk_size
        return tokens if reach is None else min(tokens, reach)

    return sum(spec.kv_bytes_per_token * kept(spec) for spec in specs if spec.holds_pages)


def vllm_group_size(specs: list[LayerSpec]) -> int:
    counts: dict[tuple, int] = {}
    for spec in specs:
        if spec.holds_pages:
            kind = (spec.sliding_window, spec.attention_chunk_size, spec.kv_bytes_per_token)
            counts[kind] = counts.get(kind, 0) + 1
    return min(counts.values())


def main() -> None:
    for name, build in PUBLISHED.items():
        specs = build()
        print(name)
        rules = {
            "hybridkv (per-group block sizes)": dict(),
            "one block size, slots padded": dict(uniform_block_size=True),
            "vLLM group size": dict(group_size=vllm_group_size(specs)),
        }
        for rule, options in rules.items():
            config = group_layers(specs, BLOCK_SIZE, **options)
            cells = []
            for tokens in CONTEXTS:
                held = blocks_for_request(config, tokens) * config.block_bytes
                cells.append(f"{tokens // 1024}k: {held / ideal_bytes(specs, tokens):.3f}x ideal")
            sizes = sorted({g.block_size for g in config.groups})
            print(
                f"  {rule:<34} {len(config.groups)} groups of {config.group_size}, block sizes {sizes}, "
                f"padding {config.padding_fraction:5.1%} | " + " | ".join(cells)
            )
        every_layer = sum(spec.kv_bytes_per_token for spec in specs)
        print(f"  KV bytes per token: {config.kv_bytes_per_token:,} (a page for every layer: {every_layer:,})")


if __name__ == "__main__":
    main()
