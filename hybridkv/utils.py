"""Block arithmetic for hybridkv's modules and the benchmarks, free of torch (the pool imports it).

`hybridkv.kernels` cannot import it (nothing in kernels/ imports hybridkv; its __init__ says why), so
kernels/cache.py states the null block id again and tests/test_kernels_backend.py pins the two equal.
"""

from __future__ import annotations

# Never allocated, never freed: stands in a block table for blocks a query cannot see.
NULL_BLOCK_ID = 0


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division of integers: ``cdiv(40, 16) == 3`` blocks of 16 hold 40 tokens."""
    return -(-numerator // denominator)
