"""Per-layer KV specs: what one attention layer stores per token, and under which attention rule."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One attention layer's KV cache needs.

    sliding_window is None for full attention; W for a sliding window where, as in transformers, a query
    at position i sees the keys at positions (i - W, i]. With `attention_chunk_size` C set (chunked
    local attention, Llama 4) a query at i sees [C * (i // C), i]: only its own chunk. K rows have
    `head_dim` elements and V rows `v_head_dim` (None: the same). A layer with `kv_source` set reads the
    K/V that layer wrote (Gemma 3n's and Gemma 4's KV-sharing layers) and holds no pages of its own. With
    `value_in_key`, a V row is the first `v_head_dim` elements of its K row and takes no bytes of its own: a latent
    attention layer's (hybridkv/patches/latent.py) K row is its latent then its rotary key, and the latent is also its
    V."""

    layer_idx: int
    sliding_window: int | None
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    v_head_dim: int | None = None
    kv_source: int | None = None
    attention_chunk_size: int | None = None
    value_in_key: bool = False

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"layer {self.layer_idx}: sliding_window must be >= 1, not {self.sliding_window}")
        if self.attention_chunk_size is not None and (self.attention_chunk_size < 1 or self.sliding_window):
            raise ValueError(
                f"layer {self.layer_idx}: attention_chunk_size must be >= 1 and excludes a sliding window, "
                f"got {self.attention_chunk_size} with sliding_window={self.sliding_window}"
            )
        if self.num_kv_heads < 1 or self.head_dim < 1 or self.dtype_bytes < 1 or self.value_head_dim < 1:
            raise ValueError(f"layer {self.layer_idx}: kv heads, head dims and dtype bytes must be positive")
        if self.value_in_key and self.value_head_dim > self.head_dim:
            raise ValueError(f"layer {self.layer_idx}: a V read from the K row cannot be wider than it")

    @property
    def value_head_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def is_full_attention(self) -> bool:
        return self.sliding_window is None and self.attention_chunk_size is None

    @property
    def holds_pages(self) -> bool:
        return self.kv_source is None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V for one token of this layer (what it needs if it holds pages)."""
        value_elements = 0 if self.value_in_key else self.value_head_dim
        return self.num_kv_heads * (self.head_dim + value_elements) * self.dtype_bytes

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one block of this layer (K and V)."""
        return block_size * self.kv_bytes_per_token


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One state layer's per-request state (a linear-attention, SSM or short-convolution layer: Gated DeltaNet,
    Mamba2, LFM2's conv), as the probe saw it go through transformers' cache interface: per state index, the
    shape and dtype of one request's conv state (`[channels, kernel]`) and of its recurrent state (any shape),
    and the module that computes it (whose forward the runner calls once per request segment,
    hybridkv/execution/state_layers.py). What a request keeps of it does not grow with its length."""

    layer_idx: int
    module_name: str
    conv: tuple[tuple[tuple[int, ...], object], ...]
    recurrent: tuple[tuple[tuple[int, ...], object], ...]

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state in this layer."""
        total = 0
        for shape, dtype in (*self.conv, *self.recurrent):
            count = 1
            for size in shape:
                count *= size
            total += count * dtype.itemsize
        return total
