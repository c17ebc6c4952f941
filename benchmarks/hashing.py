"""Block-hash micro-benchmark: the chained hash per 16-token block, for the digests one could use.

hybridkv uses SHA-256 (hybridkv.memory.hashing). This prints what each alternative would cost on the same
chained workload (2,048-token prompts, block size 16), so the choice can be revisited by numbers.

A decode step hashes one block at a time, right after a forward has evicted the caches: `--cold` times one
block's hash after 40 MB of other memory traffic, for OpenSSL's SHA-256 (`hashlib`), CPython's own (what
`hash_full_blocks` takes for one block) and hybridkv's `hash_full_blocks` itself (median of 300).

    python benchmarks/hashing.py [--cold]
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
import timeit
from array import array

import numpy as np

from hybridkv.memory.hashing import _one_block_sha256, hash_full_blocks, root_hash

TOKENS = list(range(100_000, 102_048))
BLOCK_SIZE = 16
NUM_BLOCKS = len(TOKENS) // BLOCK_SIZE
VLLM_HASH_US_PER_BLOCK = 3.5  # vLLM 0.33 on this class of machine, as quoted in issue 2


def chained(digest) -> list[bytes]:
    data = array("I", TOKENS).tobytes()
    parent = bytes(16)
    out = []
    step = BLOCK_SIZE * 4
    for offset in range(0, len(data), step):
        parent = digest(parent + data[offset : offset + step])
        out.append(parent)
    return out


def candidates() -> dict[str, object]:
    found = {
        "hybridkv (sha256, 256-bit)": lambda: hash_full_blocks(TOKENS, BLOCK_SIZE, root_hash()),
        "blake2b, 128-bit": lambda: chained(lambda b: hashlib.blake2b(b, digest_size=16).digest()),
        "sha256, 256-bit": lambda: chained(lambda b: hashlib.sha256(b).digest()),
    }
    try:
        import xxhash

        found["xxh3-128 (not cryptographic)"] = lambda: chained(xxhash.xxh3_128_digest)
    except ImportError:
        pass
    return found


def cold() -> None:
    """One block's hash after the caches were evicted, per digest call (median, microseconds)."""
    traffic = np.ones(10_000_000, dtype=np.float32)
    block = array("I", TOKENS[:BLOCK_SIZE]).tobytes()
    parent = root_hash()
    calls = {
        "hashlib.sha256 (OpenSSL)": lambda: hashlib.sha256(parent + block).digest(),
        "CPython's sha256": lambda: _one_block_sha256(parent + block).digest(),
        "hash_full_blocks, one block": lambda: hash_full_blocks(TOKENS[:BLOCK_SIZE], BLOCK_SIZE, parent),
    }
    print(f"{'one block, caches evicted':<32}{'us':>8}")
    for name, call in calls.items():
        times = []
        for _ in range(300):
            traffic += 1.0
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        print(f"{name:<32}{statistics.median(times) * 1e6:>8.1f}")


def main() -> None:
    if "--cold" in sys.argv[1:]:
        cold()
        return
    print(f"{'digest':<32}{'ns/block':>10}{'vs vLLM':>9}")
    for name, fn in candidates().items():
        seconds = min(timeit.repeat(fn, number=200, repeat=5)) / 200
        ns = seconds / NUM_BLOCKS * 1e9
        print(f"{name:<32}{ns:>10.0f}{VLLM_HASH_US_PER_BLOCK * 1000 / ns:>8.1f}x")


if __name__ == "__main__":
    main()
