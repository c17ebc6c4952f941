"""LoRA's shrink and expand kernels (hybridkv/kernels/triton_lora.py; the interpreter on the CPU) against the torch math
of hybridkv/execution/lora.py's hook for rows on several slots, `((x @ a[:used * rank].T) * mask) @ b[:, :used *
rank].T` with `mask` keeping each row's own slot's columns, computed in fp64.

Tolerances, on the error relative to max(1, |value|) of outputs of magnitude ~1 to 6: fp32 1e-5, fp16 2e-3, bf16 1.2e-2
(the shrink's output is rounded to the inputs' dtype, as the hook's matmul rounds it, and the sum with the layer's
output once more; the hook's own torch math in these dtypes is off by up to 1.3e-3 and 1.2e-2 on these cases)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.kernels.triton_lora import NO_SLOT, TILE_ROWS, lora_expand, lora_shrink, row_tiles

from tiny_models import DEVICE

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected) / expected.abs().clamp(min=1)).abs().max().item()


def stacked(ranks: list[int], rank: int, in_features: int, out_features: int, dtype: torch.dtype, seed: int = 0):
    """`a` `[slots * rank, in]` and `b` `[out, slots * rank]` as hybridkv/execution/lora.py stacks them: slot s holds
    an adapter of rank `ranks[s]`, zero-padded to `rank`; deltas of magnitude ~1 for inputs of magnitude ~1."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.zeros(len(ranks) * rank, in_features)
    b = torch.zeros(out_features, len(ranks) * rank)
    for slot, real in enumerate(ranks):
        a[slot * rank : slot * rank + real] = torch.randn(real, in_features, generator=generator) / in_features**0.5
        b[:, slot * rank : slot * rank + real] = torch.randn(out_features, real, generator=generator) / real**0.5
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


def hook_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int], rank: int) -> torch.Tensor:
    """The hook's masked math for rows on several slots (hybridkv/execution/lora.py), in fp64."""
    used = max(slots) + 1
    row_slots = torch.tensor(slots, device=x.device)
    mask = (row_slots[:, None] == torch.arange(used, device=x.device)[None]).double().repeat_interleave(rank, dim=1)
    width = used * rank
    return ((x.double() @ a[:width].double().t()) * mask) @ b[:, :width].double().t()


def random_slots(count: int, slots: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(NO_SLOT, slots, (count,), generator=generator).tolist()


# (rows' slots, each slot's real rank, rank, in, out)
CASES = {
    "one slot for every row": ([1] * 5, [4, 8, 16], 16, 48, 40),
    "random slots and rows without, ranks padded": (random_slots(37, 4, seed=1), [4, 8, 16, 2], 16, 48, 40),
    # Two shrink column tiles and two of its K steps; two expand K steps and column tiles; 16 + 3 rows of one slot.
    "rank 72, wide layer": ([2] * 19 + [0, NO_SLOT, 0], [72, 5, 64], 72, 150, 80),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_shrink_then_expand_add_each_rows_own_adapters_delta(case, dtype):
    slots, ranks, rank, in_features, out_features = CASES[case]
    a, b = stacked(ranks, rank, in_features, out_features, dtype)
    x = torch.randn(len(slots), in_features, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    before = torch.randn(len(slots), out_features, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    row_slots = torch.tensor(slots, device=DEVICE)
    out = before.clone()
    lora_expand(lora_shrink(x, a, row_slots, rank), b, row_slots, rank, out)
    expected = before.double() + hook_delta(x, a, b, slots, rank)
    assert relative_error(out, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shrink_gives_each_rows_own_slots_product_and_zeros_without(dtype):
    slots = random_slots(37, 3, seed=4)
    a, _ = stacked([8, 3, 16], 16, 48, 8, dtype)
    x = torch.randn(37, 48, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    shrunk = lora_shrink(x, a, torch.tensor(slots, device=DEVICE), 16)
    assert shrunk.shape == (37, 16) and shrunk.dtype == dtype
    for row, slot in enumerate(slots):
        if slot == NO_SLOT:
            assert shrunk[row].eq(0).all()
        else:
            expected = x[row].double() @ a[slot * 16 : (slot + 1) * 16].double().t()
            assert relative_error(shrunk[row], expected) <= TOLERANCE[dtype]


def test_expand_leaves_rows_without_a_delta_bit_for_bit():
    """Rows without a slot, and rows whose adapter does not target the layer (its slot's columns zero)."""
    slots = [0, NO_SLOT, 1, NO_SLOT, 0, 1]
    _, b = stacked([8, 0], 8, 4, 24, torch.bfloat16)
    before = torch.randn(6, 24).to(DEVICE, torch.bfloat16)
    out = before.clone()
    lora_expand(torch.ones(6, 8, device=DEVICE, dtype=torch.bfloat16), b, torch.tensor(slots, device=DEVICE), 8, out)
    assert torch.equal(out[[1, 2, 3, 5]], before[[1, 2, 3, 5]])
    assert not torch.equal(out[[0, 4]], before[[0, 4]])


def test_no_row_with_a_slot_gives_zeros_and_adds_nothing():
    a, b = stacked([4], 4, 8, 8, torch.float32)
    row_slots = torch.full((3,), NO_SLOT, device=DEVICE)
    shrunk = lora_shrink(torch.randn(3, 8, device=DEVICE), a, row_slots, 4)
    out = torch.randn(3, 8, device=DEVICE)
    before = out.clone()
    lora_expand(torch.randn(3, 4, device=DEVICE), b, row_slots, 4, out)
    assert shrunk.eq(0).all() and torch.equal(out, before)


def test_strided_rows_and_prebuilt_tiles_give_what_contiguous_rows_and_slots_give():
    """The hook's rows may be a view with a longer row stride; its tiles are built once per set of rows."""
    slots = [1, 0, 1, NO_SLOT, 0]
    a, b = stacked([4, 8], 8, 24, 16, torch.float32)
    wide = torch.randn(5, 40, device=DEVICE)
    x = wide[:, 8:32]
    tiles = row_tiles(slots, DEVICE)
    out = torch.zeros(5, 16, device=DEVICE)
    lora_expand(lora_shrink(x, a, tiles, 8), b, tiles, 8, out)
    expected = torch.zeros(5, 16, device=DEVICE)
    row_slots = torch.tensor(slots, device=DEVICE)
    lora_expand(lora_shrink(x.contiguous(), a, row_slots, 8), b, row_slots, 8, expected)
    assert torch.equal(out, expected)


def test_row_tiles_sort_rows_by_slot_in_tiles_of_one_slot():
    slots = [2, NO_SLOT, 0] + [2] * 18 + [NO_SLOT, 0]
    tiles = row_tiles(slots, "cpu")
    assert tiles.order.tolist() == [2, 22, 0, *range(3, 21)]
    assert tiles.tile_slots.tolist() == [0, 2, 2]
    assert tiles.tile_starts.tolist() == [0, 2, 2 + TILE_ROWS]
    assert tiles.tile_rows.tolist() == [2, TILE_ROWS, 19 - TILE_ROWS]
    assert (tiles.num_rows, tiles.max_slot) == (23, 2)
    assert row_tiles([NO_SLOT, NO_SLOT], "cpu").tile_slots.numel() == 0


def test_inputs_that_do_not_fit_are_clear_errors():
    a, b = stacked([4, 4], 4, 8, 6, torch.float32)
    x = torch.randn(3, 8, device=DEVICE)
    slots = torch.tensor([0, 1, NO_SLOT], device=DEVICE)
    with pytest.raises(ValueError, match=r"x \(3, 9\) and a \(8, 8\) do not match"):
        lora_shrink(torch.randn(3, 9, device=DEVICE), a, slots, 4)
    with pytest.raises(ValueError, match=r"x \(8,\) and a \(8, 8\) do not match"):
        lora_shrink(torch.randn(8, device=DEVICE), a, slots, 4)
    with pytest.raises(ValueError, match="holds 2 slots"):
        lora_shrink(x, a, torch.tensor([0, 2, 0], device=DEVICE), 4)
    with pytest.raises(ValueError, match="row_slots has 2 rows, x 3"):
        lora_shrink(x, a, slots[:2], 4)
    with pytest.raises(ValueError, match="not whole slots of rank 3"):
        lora_shrink(x, a, slots, 3)
    with pytest.raises(ValueError, match="both fp32, fp16 or bf16"):
        lora_shrink(x.half(), a, slots, 4)
    with pytest.raises(ValueError, match=r"out must be a fp32/fp16/bf16 \[3, 6\]"):
        lora_expand(torch.randn(3, 4, device=DEVICE), b, slots, 4, torch.zeros(3, 5, device=DEVICE))


def test_no_slot_is_the_hooks_no_adapter():
    """The kernels cannot import hybridkv.execution (the layers): the two constants are pinned equal here."""
    from hybridkv.execution.lora import NO_ADAPTER

    assert NO_SLOT == NO_ADAPTER
