"""KV tensors: sizing from a byte budget or a device-memory fraction, and allocation.

The engine allocates one page tensor per device, ``[num_blocks, page elements]``, and gives each layer
a K and a V view into its slot of every page (``kv_page_views``): the views have the layout below with
blocks a page apart. ``allocate_kv_cache`` makes standalone contiguous pairs (kernel tests, benchmarks).

Layout of every K and V tensor: ``[num_blocks, block_size, num_kv_heads, head_dim]``, so slot s is
row s of ``cache.view(-1, num_kv_heads, head_dim)``. The slot of token t of a sequence is
``block_table[t // block_size] * block_size + t % block_size``. docs/kernels.md has the measurement
against the head-major alternative ``[num_blocks, num_kv_heads, block_size, head_dim]``.
"""

from __future__ import annotations

import torch

# The pool's null block (hybridkv.memory.block_pool.NULL_BLOCK_ID, pinned equal by tests/test_kernels_backend.py):
# never allocated, it may fill table entries no query reads. Not imported from there: nothing in
# hybridkv/kernels/ imports hybridkv (see __init__.py).
NULL_BLOCK_ID = 0


def num_blocks_for_budget(kv_cache_bytes: int, bytes_per_block: int, min_num_blocks: int = 2) -> int:
    """How many blocks fit in ``kv_cache_bytes``; the count includes the null block (id 0).

    ``min_num_blocks`` is what the caller cannot run without (e.g. the null block plus the blocks of
    one request at max_model_len); a smaller budget raises a ValueError that names the shortfall.
    """
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    num_blocks = kv_cache_bytes // bytes_per_block
    if num_blocks < min_num_blocks:
        needed_bytes = min_num_blocks * bytes_per_block
        raise ValueError(
            f"a KV cache budget of {kv_cache_bytes:,} bytes holds {num_blocks} blocks of "
            f"{bytes_per_block:,} bytes, but at least {min_num_blocks} are needed ({needed_bytes:,} bytes); "
            "raise the KV cache budget (or memory utilization), or lower max_model_len or block_size"
        )
    return num_blocks


def num_blocks_for_memory_utilization(
    memory_utilization: float,
    free_bytes: int,
    total_bytes: int,
    bytes_per_block: int,
    min_num_blocks: int = 2,
) -> int:
    """Blocks that fit when the process may use ``memory_utilization`` of the device's memory.

    Like vLLM's ``gpu_memory_utilization``: call it after a profiling forward at the largest batch,
    with ``free_bytes, total_bytes = torch.cuda.mem_get_info()``. Everything already in use (weights,
    activations of the profiling forward, other processes) is subtracted from the allowed share.
    """
    if not 0.0 < memory_utilization <= 1.0:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    used_bytes = total_bytes - free_bytes
    kv_cache_bytes = int(memory_utilization * total_bytes) - used_bytes
    if kv_cache_bytes <= 0:
        raise ValueError(
            f"{used_bytes:,} of {total_bytes:,} device bytes are already in use, more than the "
            f"{memory_utilization:.0%} allowed; raise memory_utilization or free device memory"
        )
    return num_blocks_for_budget(kv_cache_bytes, bytes_per_block, min_num_blocks)


def allocate_kv_cache(
    num_tensors: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Allocate ``num_tensors`` zeroed (key_cache, value_cache) pairs of the layout above."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be at least 2 (the null block and one real block), got {num_blocks}")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_tensors)
    ]


def allocate_kv_pages(
    num_blocks: int, block_bytes: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """One zeroed ``[num_blocks, block_bytes / element size]`` tensor: page b is block id b's memory."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be at least 2 (the null block and one real block), got {num_blocks}")
    if block_bytes % element_bytes:
        raise ValueError(f"a page of {block_bytes} bytes does not hold whole {dtype} elements")
    return torch.zeros((num_blocks, block_bytes // element_bytes), dtype=dtype, device=device)


def kv_page_views(
    pages: torch.Tensor,
    offset_bytes: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    value_head_dim: int,
    dtype: torch.dtype | None = None,
    value_in_key: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K ``[num_blocks, block_size, heads, head_dim]`` and V ``[..., value_head_dim]`` views of
    its slot, which starts ``offset_bytes`` into every page: K rows, then V rows. ``dtype`` (default: the
    pages') reads the slot's bytes as that dtype, so layers of different KV dtypes share one page tensor
    (allocate it as uint8); the slot must start at a multiple of the dtype's size. With ``value_in_key`` the slot
    holds K rows only, and V is a view of each K row's first ``value_head_dim`` elements (latent attention)."""
    dtype = dtype or pages.dtype
    if dtype != pages.dtype:
        element_bytes = torch.empty((), dtype=dtype).element_size()
        if offset_bytes % element_bytes or pages.shape[1] * pages.element_size() % element_bytes:
            raise ValueError(f"a slot at byte {offset_bytes} of pages of {pages.dtype} cannot be read as {dtype}")
        pages = pages.view(torch.uint8).view(dtype)
    start = offset_bytes // pages.element_size()
    key_elements = block_size * num_kv_heads * head_dim
    value_elements = block_size * num_kv_heads * value_head_dim
    num_blocks = pages.shape[0]
    keys = pages[:, start : start + key_elements].view(num_blocks, block_size, num_kv_heads, head_dim)
    if value_in_key:
        return keys, keys[..., :value_head_dim]
    values = pages[:, start + key_elements : start + key_elements + value_elements]
    return keys, values.view(num_blocks, block_size, num_kv_heads, value_head_dim)
