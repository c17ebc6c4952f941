"""Block arithmetic shared by the block pool and the kernels, free of torch.

The pool must import without torch and the kernels must not import the pool, so the one definition
of the null block id and of ceiling division lives here, below both.
"""

from __future__ import annotations

# Never allocated, never freed: stands in a block table for blocks a query cannot see.
NULL_BLOCK_ID = 0


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division of integers: ``cdiv(40, 16) == 3`` blocks of 16 hold 40 tokens."""
    return -(-numerator // denominator)
