"""Layer layouts of published hybrid models, from their config.json values: KV memory planning
without weights (benchmarks/kv_layouts.py, notebook 02, the exact-number tests in tests/test_grouping.py).

Each function returns one `LayerSpec` per decoder layer, bf16, as hybridkv's probe would measure them
on the loaded model (K/V heads and head dims per layer, windows in transformers' convention: a query
sees the last W keys itself included, KV-sharing layers pointing at the layer whose K/V they read).
"""

from __future__ import annotations

from hybridkv.memory.kv_spec import LayerSpec

BF16 = 2


def _sharing_sources(kinds: list[str], num_shared: int) -> list[int | None]:
    """Gemma 3n / Gemma 4: the last `num_shared` layers reuse the K/V of the last earlier layer of
    their kind (transformers' `kv_sharing_modes`)."""
    first_shared = len(kinds) - num_shared
    return [
        None if i < first_shared else max(j for j in range(first_shared) if kinds[j] == kind)
        for i, kind in enumerate(kinds)
    ]


def gemma3(num_layers: int, kv_heads: int, head_dim: int, window: int = 1024) -> list[LayerSpec]:
    """Gemma 3: 5 sliding : 1 full. 1B: (26, 1, 256, window 512); 12B: (48, 8, 256); 27B: (62, 16, 128)."""
    return [LayerSpec(i, None if (i + 1) % 6 == 0 else window, kv_heads, head_dim, BF16) for i in range(num_layers)]


def gemma3n_e4b(num_shared: int = 15) -> list[LayerSpec]:
    """Gemma 3n E4B (text): 35 layers, 4 sliding (512) : 1 full, 2 kv heads of 256; the last 15 layers
    reuse the K/V of layers 18 (sliding) and 19 (full)."""
    kinds = ["full" if (i + 1) % 5 == 0 else "sliding" for i in range(35)]
    sources = _sharing_sources(kinds, num_shared)
    return [
        LayerSpec(i, None if kind == "full" else 512, 2, 256, BF16, kv_source=source)
        for i, (kind, source) in enumerate(zip(kinds, sources, strict=True))
    ]


def gemma4(
    num_layers: int, full_every: int, window: int, kv_heads: int, global_kv_heads: int, num_shared: int = 0
) -> list[LayerSpec]:
    """Gemma 4: sliding layers of `kv_heads` heads of 256, full layers of `global_kv_heads` heads of 512
    (global_head_dim; with attention_k_eq_v V comes from the K projection but is still stored)."""
    kinds = ["full" if (i + 1) % full_every == 0 else "sliding" for i in range(num_layers)]
    sources = _sharing_sources(kinds, num_shared)
    return [
        LayerSpec(i, None, global_kv_heads, 512, BF16, kv_source=source)
        if kind == "full"
        else LayerSpec(i, window, kv_heads, 256, BF16, kv_source=source)
        for i, (kind, source) in enumerate(zip(kinds, sources, strict=True))
    ]


def gemma4_31b() -> list[LayerSpec]:
    """60 layers, 5 sliding (1024) : 1 full; 16 kv heads of 256, full layers 4 of 512 (k_eq_v)."""
    return gemma4(60, 6, 1024, 16, 4)


def gemma4_26b_a4b() -> list[LayerSpec]:
    """30 layers, 5 sliding (1024) : 1 full; 8 kv heads of 256, full layers 2 of 512 (k_eq_v)."""
    return gemma4(30, 6, 1024, 8, 2)


def gemma4_e4b() -> list[LayerSpec]:
    """42 layers, 5 sliding (512) : 1 full; 2 kv heads (256 sliding, 512 full); the last 18 share."""
    return gemma4(42, 6, 512, 2, 2, num_shared=18)


def gemma4_e2b() -> list[LayerSpec]:
    """35 layers, 4 sliding (512) : 1 full; 1 kv head (256 sliding, 512 full); the last 20 share."""
    return gemma4(35, 5, 512, 1, 1, num_shared=20)


def mimo_v2_flash() -> list[LayerSpec]:
    """48 layers, full at 0 and every 6th (9 full, 39 sliding of window 129: sliding_window_size 128
    + 1); K head dim 192, V 128; sliding layers 8 kv heads, full ones 4."""
    return [
        LayerSpec(i, None, 4, 192, BF16, v_head_dim=128)
        if i == 0 or (i + 1) % 6 == 0
        else LayerSpec(i, 129, 8, 192, BF16, v_head_dim=128)
        for i in range(48)
    ]


def llama4_scout() -> list[LayerSpec]:
    """Llama 4 Scout (text): 48 layers, 3 chunked (8192) : 1 full (no RoPE); 8 kv heads of 128."""
    return [
        LayerSpec(i, None, 8, 128, BF16, attention_chunk_size=None if (i + 1) % 4 == 0 else 8192) for i in range(48)
    ]


PUBLISHED = {
    "Gemma-3-1B": lambda: gemma3(26, 1, 256, window=512),
    "Gemma-3-12B": lambda: gemma3(48, 8, 256),
    "Gemma-3-27B": lambda: gemma3(62, 16, 128),
    "Gemma-3n-E4B": gemma3n_e4b,
    "Gemma-4-31B": gemma4_31b,
    "Gemma-4-26B-A4B": gemma4_26b_a4b,
    "Gemma-4-E4B": gemma4_e4b,
    "Gemma-4-E2B": gemma4_e2b,
    "MiMo-V2-Flash": mimo_v2_flash,
    "Llama-4-Scout": llama4_scout,
}
