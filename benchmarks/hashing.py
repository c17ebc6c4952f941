"""Block-hash micro-benchmark: the chained hash per 16-token block, for the digests one could use.

hybridkv uses SHA-256 (hybridkv.hashing). This prints what each alternative would cost on the same
chained workload (2,048-token prompts, block size 16), so the choice can be revisited by numbers.

    python benchmarks/hashing.py
"""

from __future__ import annotations

import hashlib
import timeit
from array import array

from hybridkv.hashing import hash_full_blocks, root_hash

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


def main() -> None:
    print(f"{'digest':<32}{'ns/block':>10}{'vs vLLM':>9}")
    for name, fn in candidates().items():
        seconds = min(timeit.repeat(fn, number=200, repeat=5)) / 200
        ns = seconds / NUM_BLOCKS * 1e9
        print(f"{name:<32}{ns:>10.0f}{VLLM_HASH_US_PER_BLOCK * 1000 / ns:>8.1f}x")


if __name__ == "__main__":
    main()
