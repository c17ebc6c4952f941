"""Many LoRA adapters in one step, in Triton (Punica's and vLLM's `lora_shrink` / `lora_expand`): each row of a batch
times its own adapter's A, then its own adapter's B, added into the layer's output.

The adapters' slots are stacked as hybridkv/execution/lora.py holds them: `a` `[slots * rank, in]` (slot s in rows
`s * rank` to `(s + 1) * rank`) and `b` `[out, slots * rank]` (slot s in those columns), a smaller rank zero-padded,
the scaling folded into `b`. A row's slot -1 means no adapter.

Rows are grouped by slot on the host, the SGMV way: `row_tiles` sorts the rows by slot (stable) and cuts each slot's
run into tiles of at most `TILE_ROWS` rows, listing per tile its slot, its start in the sorted order and its row count;
the grid is exactly those tiles times the output's column tiles. So every program multiplies rows of one slot by one
slice of `a` or `b`, a `tl.dot` on tensor cores with that slice read once for the tile, where the other design (a
program over consecutive rows, each row gathering its own slot's slice) reads a slice per row and can only multiply
and sum element-wise. Grouping costs no device round trip: the engine knows a step's slots as a Python list and builds
the tiles once per set of rows a step's layers see (one small host-to-device copy), not per layer. Rows without a slot
are in no tile: the shrink leaves them zero and the expand leaves them untouched.

      sorted rows (order):  [ slot 0 rows | slot 2 rows ........................ | slot 3 rows ]
      tiles:                [ tile 0      | tile 1 (16 rows) | tile 2 (16) | t 3 | tile 4      ]

Accumulation is fp32; inputs fp32, fp16 or bf16 (fp32 dots in IEEE precision, not tf32, as torch's matmul by
default). The shrink's output has the inputs' dtype, as the hook's matmul gives it; bf16 results are rounded to nearest
by `round_to_bf16_grid` before they convert, so the interpreter (whose conversion truncates) computes what a GPU does.
No split-K: a decode step's shrink runs one program per slot's tile, which loops over the whole input width; whether
splitting it pays is for a GPU measurement to say (none has run these kernels yet), as are the tile sizes below.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .triton_attention import INTERPRETED
from .triton_common import round_to_bf16_grid

NO_SLOT = -1
# Rows per tile: the smallest M of a tensor-core dot. A decode step's adapters have a few rows each (lanes past them
# are masked off), and the shrink, with a rank's few output columns, splits a prefill only by its rows.
TILE_ROWS = 16
_SHRINK_BLOCK_K = 128  # the input width per step of the shrink's loop
_EXPAND_BLOCK_N = 64  # output columns per expand program
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class RowTiles(NamedTuple):
    """A batch's rows grouped by adapter slot for the kernels (module docstring); built by `row_tiles`.

    `order` int32 `[rows with a slot]`: row indices sorted by slot (stable); `tile_slots`, `tile_starts` (into
    `order`) and `tile_rows` (at most TILE_ROWS) int32 `[tiles]`, all views of one device tensor. `num_rows`: the
    batch's rows; `max_slot`: its largest slot (NO_SLOT when no row has one)."""

    order: torch.Tensor
    tile_slots: torch.Tensor
    tile_starts: torch.Tensor
    tile_rows: torch.Tensor
    num_rows: int
    max_slot: int


def row_tiles(row_slots: Sequence[int], device: torch.device | str) -> RowTiles:
    """`row_slots` (one slot per row, NO_SLOT for none) grouped into tiles of one slot each, on `device` in one copy."""
    slots = list(row_slots)
    order = sorted((row for row, slot in enumerate(slots) if slot != NO_SLOT), key=slots.__getitem__)
    tile_slots, tile_starts, tile_rows = [], [], []
    start = 0
    for slot, count in sorted(Counter(slots[row] for row in order).items()):
        for tile_start in range(start, start + count, TILE_ROWS):
            tile_slots.append(slot)
            tile_starts.append(tile_start)
            tile_rows.append(min(TILE_ROWS, start + count - tile_start))
        start += count
    packed = torch.tensor(order + tile_slots + tile_starts + tile_rows, dtype=torch.int32).to(device)
    tiles = len(tile_slots)
    order_tensor, slots_tensor, starts, rows = packed.split([len(order), tiles, tiles, tiles])
    return RowTiles(order_tensor, slots_tensor, starts, rows, len(slots), tile_slots[-1] if tiles else NO_SLOT)


@triton.jit
def _tile_rows(order_ptr, tile_slots_ptr, tile_starts_ptr, tile_rows_ptr, TILE_M: tl.constexpr):
    """This program's tile: its slot, its rows (int64, 0 where masked) and which of its TILE_M lanes hold one."""
    tile = tl.program_id(0)
    slot = tl.load(tile_slots_ptr + tile).to(tl.int64)
    lanes = tl.arange(0, TILE_M)
    row_ok = lanes < tl.load(tile_rows_ptr + tile)
    rows = tl.load(order_ptr + tl.load(tile_starts_ptr + tile) + lanes, mask=row_ok, other=0).to(tl.int64)
    return slot, rows, row_ok


@triton.jit
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    order_ptr,
    tile_slots_ptr,
    tile_starts_ptr,
    tile_rows_ptr,
    in_features,
    rank,
    stride_x_row,
    stride_a_row,
    stride_y_row,
    TILE_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUND_TO_BF16: tl.constexpr,
):
    # y[row, n] = sum_k x[row, k] * a[slot * rank + n, k], for the tile's rows and BLOCK_N of the rank's columns.
    slot, rows, row_ok = _tile_rows(order_ptr, tile_slots_ptr, tile_starts_ptr, tile_rows_ptr, TILE_M)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    column_ok = columns < rank
    a_rows = slot * rank + columns
    acc = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_ok = ks < in_features
        x = tl.load(x_ptr + rows[:, None] * stride_x_row + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(
            a_ptr + a_rows[None, :] * stride_a_row + ks[:, None], mask=k_ok[:, None] & column_ok[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_N]: the slot's rows of a, transposed
        if UPCAST:  # interpreted bf16: the interpreter's bf16 dot multiplies bit patterns
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, a, input_precision="ieee")
    if ROUND_TO_BF16:
        acc = round_to_bf16_grid(acc)
    mask = row_ok[:, None] & column_ok[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y_row + columns[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def lora_expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    order_ptr,
    tile_slots_ptr,
    tile_starts_ptr,
    tile_rows_ptr,
    out_features,
    rank,
    stride_y_row,
    stride_b_row,
    stride_out_row,
    TILE_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUND_TO_BF16: tl.constexpr,
):
    # out[row, n] += sum_k y[row, k] * b[n, slot * rank + k], for the tile's rows and BLOCK_N output columns.
    slot, rows, row_ok = _tile_rows(order_ptr, tile_slots_ptr, tile_starts_ptr, tile_rows_ptr, TILE_M)
    columns = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # times b's row stride: past 2**31
    column_ok = columns < out_features
    acc = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, rank, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_ok = ks < rank
        y = tl.load(y_ptr + rows[:, None] * stride_y_row + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(
            b_ptr + columns[None, :] * stride_b_row + (slot * rank + ks)[:, None],
            mask=k_ok[:, None] & column_ok[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: the slot's columns of b, transposed
        y = y.to(b_ptr.dtype.element_ty)
        if UPCAST:
            y = y.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(y, b, input_precision="ieee")
    mask = row_ok[:, None] & column_ok[None, :]
    targets = out_ptr + rows[:, None] * stride_out_row + columns[None, :]
    total = tl.load(targets, mask=mask, other=0.0).to(tl.float32) + acc
    if ROUND_TO_BF16:
        total = round_to_bf16_grid(total)
    tl.store(targets, total.to(out_ptr.dtype.element_ty), mask=mask)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, row_slots: torch.Tensor | RowTiles, rank: int) -> torch.Tensor:
    """`[rows, rank]`: each row of `x` (`[rows, in]`) times its own slot's rows of `a` (`[slots * rank, in]`),
    `x[r] @ a[s * rank : (s + 1) * rank].T`; zeros for rows without a slot. `row_slots`: int `[rows]` (NO_SLOT for
    none), or `row_tiles` of them (what a caller running several layers on the same rows builds once)."""
    tiles = _tiles(row_slots, x)
    _check("x", x, "a", a, tiles, rank, shrink=True)
    y = x.new_zeros(x.shape[0], rank)
    if not tiles.tile_slots.numel():
        return y
    x, a = _unit_stride(x), _unit_stride(a)
    constexprs = launch_constexprs("shrink", rank, x.dtype, y.dtype)
    grid = (tiles.tile_slots.numel(), triton.cdiv(rank, constexprs["BLOCK_N"]))
    lora_shrink_kernel[grid](
        x, a, y, tiles.order, tiles.tile_slots, tiles.tile_starts, tiles.tile_rows,
        x.shape[1], rank, x.stride(0), a.stride(0), y.stride(0), **constexprs,
    )  # fmt: skip
    return y


def lora_expand(
    y: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor | RowTiles, rank: int, out: torch.Tensor
) -> None:
    """Add to each row of `out` (`[rows, out]`, in place) its row of `y` (`[rows, rank]`) times its own slot's columns
    of `b` (`[out, slots * rank]`), `y[r] @ b[:, s * rank : (s + 1) * rank].T`, summed in fp32 with `out`'s value and
    rounded once; rows without a slot are left as they are. `row_slots` as in `lora_shrink`."""
    tiles = _tiles(row_slots, y)
    _check("y", y, "b", b, tiles, rank, shrink=False)
    if out.shape != (y.shape[0], b.shape[0]) or out.dtype not in _DTYPES or out.device != y.device:
        raise ValueError(
            f"out must be a fp32/fp16/bf16 [{y.shape[0]}, {b.shape[0]}] tensor on {y.device}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError("out is added into in place: its last dimension must be contiguous")
    if not tiles.tile_slots.numel():
        return
    y, b = _unit_stride(y), _unit_stride(b)
    constexprs = launch_constexprs("expand", rank, b.dtype, out.dtype)
    grid = (tiles.tile_slots.numel(), triton.cdiv(b.shape[0], constexprs["BLOCK_N"]))
    lora_expand_kernel[grid](
        y, b, out, tiles.order, tiles.tile_slots, tiles.tile_starts, tiles.tile_rows,
        b.shape[0], rank, y.stride(0), b.stride(0), out.stride(0), **constexprs,
    )  # fmt: skip


def launch_constexprs(
    kernel: str, rank: int, dtype: torch.dtype, out_dtype: torch.dtype, interpreted: bool = INTERPRETED
) -> dict[str, int | bool]:
    """The constexprs of a launch of the "shrink" or "expand" kernel for `rank`, inputs of `dtype` and an output of
    `out_dtype` (tests/test_kernels_triton_compile.py compiles those a GPU launch passes). The rank's columns are the
    shrink's output tile and the expand's reduction step, padded to 16 (a tensor-core dot's smallest N and K)."""
    rank_block = max(16, min(64, triton.next_power_of_2(rank)))
    shared = {
        "TILE_M": TILE_ROWS,
        "UPCAST": interpreted and dtype == torch.bfloat16,
        "ROUND_TO_BF16": out_dtype == torch.bfloat16,
    }
    if kernel == "shrink":
        return {**shared, "BLOCK_N": rank_block, "BLOCK_K": _SHRINK_BLOCK_K}
    return {**shared, "BLOCK_N": _EXPAND_BLOCK_N, "BLOCK_K": rank_block}


def _tiles(row_slots: torch.Tensor | RowTiles, rows: torch.Tensor) -> RowTiles:
    if isinstance(row_slots, RowTiles):
        return row_slots
    if row_slots.dim() != 1 or row_slots.dtype.is_floating_point:
        raise ValueError(f"row_slots must be an int [rows] tensor, got {row_slots.dtype} {tuple(row_slots.shape)}")
    return row_tiles(row_slots.tolist(), rows.device)


def _check(
    rows_name: str, rows: torch.Tensor, weight_name: str, weight: torch.Tensor, tiles: RowTiles, rank: int, shrink: bool
) -> None:
    """The shrink's `rows` `[rows, in]` and `weight` `[slots * rank, in]`, or the expand's `[rows, rank]` and `[out,
    slots * rank]`, agree with each other, with the tiles and with `rank`; a ValueError names what does not."""
    if rows.dim() != 2 or weight.dim() != 2 or rows.shape[1] != (weight.shape[1] if shrink else rank):
        raise ValueError(
            f"{rows_name} {tuple(rows.shape)} and {weight_name} {tuple(weight.shape)} do not match: see the shapes in "
            "hybridkv/kernels/triton_lora.py"
        )
    if rows.dtype not in _DTYPES or weight.dtype != rows.dtype:
        raise ValueError(
            f"{rows_name} and {weight_name} must be both fp32, fp16 or bf16, got {rows.dtype} and {weight.dtype}"
        )
    stacked = weight.shape[0] if shrink else weight.shape[1]
    if rank <= 0 or stacked % rank:
        raise ValueError(f"{weight_name}'s {stacked} stacked rows or columns are not whole slots of rank {rank}")
    if tiles.num_rows != rows.shape[0]:
        raise ValueError(f"row_slots has {tiles.num_rows} rows, {rows_name} {rows.shape[0]}")
    if tiles.max_slot >= stacked // rank:
        raise ValueError(f"a row's slot is {tiles.max_slot}, but {weight_name} holds {stacked // rank} slots")
    if weight.device != rows.device or tiles.order.device != rows.device:
        raise ValueError(f"{rows_name}, {weight_name} and the row tiles must be on one device")


def _unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
