"""Chained block hashes: the identity of a full block of tokens together with everything before it.

hash(block i) = SHA-256(hash(block i-1) || token ids of block i as uint32 [|| 0xff || extra keys])

The chain starts from a root hash that depends on the request's `cache_salt`, its LoRA adapter and on the model key (the
model as it computed the blocks: its weights' generation and active adapters, hybridkv/execution/model_watch.py), so
requests with different salts, or admitted under different models, share no block at all. SHA-256 is stable
across processes and collision-resistant (a forged collision would poison the prefix cache); docs/design.md has
the measurement behind the choice (benchmarks/hashing.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import sha256

try:  # CPython's own SHA-256 (`_sha2` from 3.12, `_sha256` before): the same digests as OpenSSL's `hashlib.sha256`,
    # whose per-call dispatch costs more right after a forward has evicted the caches (measured: benchmarks/RESULTS.md,
    # 'Choices in the code'); a decode step hashes one block at a time. OpenSSL stays for many blocks (it is faster per
    # call when warm, and per byte).
    from _sha2 import sha256 as _one_block_sha256
except ImportError:
    try:
        from _sha256 import sha256 as _one_block_sha256
    except ImportError:  # a build without them
        _one_block_sha256 = sha256

_ROOT_SEED = b"hybridkv-block-hash-v1"
_EXTRA_KEYS_SEPARATOR = b"\xff"


def root_hash(cache_salt: str | None = None, model_key: bytes = b"", adapter_key: bytes = b"") -> bytes:
    """The parent hash of a request's first block; a different salt, model key or LoRA adapter (`adapter_key`, the
    digest of its weights: hybridkv/execution/lora_weights.py) gives a disjoint chain. The keys b"" (the model as it was
    patched, no adapter) leave the salt's root as it is."""
    seed = _ROOT_SEED if cache_salt is None else _ROOT_SEED + b"\x00salt" + cache_salt.encode()
    root = sha256(seed).digest()
    # Folded in after the salt's fixed-size digest, so that no salt can spell another model's key.
    root = sha256(root + model_key).digest() if model_key else root
    return sha256(root + b"\x00lora" + adapter_key).digest() if adapter_key else root


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; a clear error for ids outside [0, 2**32)."""
    try:
        return array("I", token_ids).tobytes()
    except OverflowError as exc:
        bad = next(t for t in token_ids if not 0 <= t < 2**32)
        raise ValueError(f"token id {bad} is outside [0, 2**32); token ids must be vocabulary indices") from exc


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent_hash: bytes,
    start_block: int = 0,
    extra_keys: bytes = b"",
) -> list[bytes]:
    """Chained hashes of the full blocks of token_ids from start_block on.

    parent_hash is the hash of block start_block - 1 (or the root hash when start_block == 0).
    extra_keys (e.g. an adapter id) join every block's hash after a separator.
    """
    num_full_blocks = len(token_ids) // block_size
    if num_full_blocks <= start_block:
        return []
    data = token_bytes(token_ids[start_block * block_size : num_full_blocks * block_size])
    step = block_size * 4
    digest = _one_block_sha256 if len(data) == step else sha256  # one block: a decode step's
    hashes = []
    if extra_keys:
        suffix = _EXTRA_KEYS_SEPARATOR + extra_keys
        for offset in range(0, len(data), step):
            parent_hash = digest(parent_hash + data[offset : offset + step] + suffix).digest()
            hashes.append(parent_hash)
    else:
        for offset in range(0, len(data), step):
            parent_hash = digest(parent_hash + data[offset : offset + step]).digest()
            hashes.append(parent_hash)
    return hashes
