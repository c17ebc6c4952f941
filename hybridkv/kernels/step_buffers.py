"""Step buffers: the tensors a step's inputs and metadata live in, allocated once and rewritten in place.

An engine's steps differ in their sizes, not in where their tensors are: `StepBuffers` holds, for one
device, every tensor a step's forward reads besides the weights and the pages, sized for the engine's
largest step (`max_num_seqs` sequences, `max_num_tokens` rows), and each step writes its values into the
leading part of each. Their addresses never change, which is what lets a CUDA graph captured over one
step replay another (hybridkv/execution/graphs.py), and no step allocates or frees a tensor of its own::

    input_ids, positions       [max_num_tokens]                 int64   the flattened rows
    logits_rows, picked_rows   [max of both]                    int64   rows whose logits are kept, sampled
    cu_seqlens_q               [max_num_seqs + 1]               int32   sequence s: rows cu[s]:cu[s+1]
    seq_lens                   [max_num_seqs]                   int32   tokens each sequence holds
    tables[block_size]         [groups, max_num_seqs, width]    int32   block ids, in batch order
    slots[block_size]          [groups, max_num_tokens]         int64   where each row is stored (-1: not)
    tiles[block_q]             2 x [max_num_tokens // block_q + max_num_seqs]   Triton query tiles

On the CPU the host's numpy arrays are these tensors (shared memory: filling one is writing the other).
On CUDA the host fills pinned copies and `step` sends the used part of each to the device, asynchronously.
A group's table is a `[num_seqs, width]` view with the full row stride: entries past a sequence's blocks
hold whatever an earlier step left there, and no kernel reads them (a kernel reads a sequence's entries
up to its length). Where the step's rows come from, and which requests they are, is the caller's (the
model runner's persistent batch, hybridkv/execution/input_batch.py); what they mean is metadata.py's.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from .backend import Backend
from .cpu_decode import NativeFunction, NativeModule
from .metadata import PagedAttentionMetadata, StepMetadata, TritonQueryTiles

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_FILL = NativeFunction(
    Path(__file__).with_name("step_fill.c"),
    "hybridkv_step_fill",
    [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64],
    ctypes.c_int,
    "the step fill",
)
# The same fill and a decode step's inputs as an extension module's functions, where Python's headers build it.
_NATIVE = NativeModule(
    [Path(__file__).with_name("step_native.c"), Path(__file__).with_name("step_fill.c")],
    "hybridkv_step_native",
    "the step buffers' native functions",
)

# The `array` type codes of the integer buffers' dtypes (`_Buffer.flat`).
_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


def _int64(values: np.ndarray) -> np.ndarray:
    """`values` as a contiguous int64 array (itself when it is one already, as the runner's are)."""
    if values.dtype == np.int64 and values.flags.c_contiguous:
        return values
    return np.ascontiguousarray(values, dtype=np.int64)


class _Buffer:
    """One step tensor on the device and the numpy array the host fills (the same memory on the CPU)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_cpu = device.type == "cpu"
        with torch.inference_mode(False):  # updated in place outside inference mode too
            self.host_tensor = torch.zeros(shape, dtype=dtype, pin_memory=not on_cpu and torch.cuda.is_available())
            self.device = self.host_tensor if on_cpu else torch.zeros(shape, dtype=dtype, device=device)
        self.host = self.host_tensor.numpy()
        self.address = self.host.ctypes.data  # where the C fill writes it
        # The host's values as one flat memoryview of `array` items, which decode_step assigns to (no call into
        # numpy or ctypes: each costs microseconds after a forward has evicted its code).
        self.flat = memoryview(self.host.reshape(-1)).cast("B").cast(_ARRAY_CODES.get(dtype, "B"))
        self.on_cpu = on_cpu
        self._staging: tuple[torch.Tensor, torch.Tensor] | None = None

    def send(self, *region: slice) -> None:
        """Copy the host's values of `region` (leading slices) to the device, asynchronously (nothing to do on
        the CPU). A region that is not one contiguous run (a [groups, sequences, width] corner) goes through a
        contiguous pinned copy, one transfer, then a copy on the device: a strided copy from the host would go
        through pageable memory, which makes the host wait for the device."""
        if self.on_cpu:
            return
        source, target = self.host_tensor[region], self.device[region]
        if source.is_contiguous():
            target.copy_(source, non_blocking=True)
            return
        if self._staging is None:
            with torch.inference_mode(False):
                host = self.host_tensor
                self._staging = (
                    torch.empty(host.shape, dtype=host.dtype, pin_memory=True),
                    torch.empty_like(self.device),
                )
        staged_host, staged_device = (t.view(-1)[: source.numel()].view(source.shape) for t in self._staging)
        staged_host.copy_(source)
        staged_device.copy_(staged_host, non_blocking=True)
        target.copy_(staged_device)


class StepBuffers:
    """Every step tensor of one device (see the module docstring). `table_shapes` gives, per block size,
    the number of KV cache groups of that size and the most blocks a sequence holds in them."""

    def __init__(
        self,
        device: torch.device,
        backend: Backend,
        max_num_seqs: int,
        max_num_tokens: int,
        table_shapes: Mapping[int, tuple[int, int]],
    ) -> None:
        self.device = device
        self.backend = backend
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.input_ids = _Buffer((max_num_tokens,), torch.int64, device)
        self.positions = _Buffer((max_num_tokens,), torch.int64, device)
        # A sample's row (at most max_num_seqs of them) or any row of the step (a caller asking for all of them).
        self.logits_rows = _Buffer((max(max_num_seqs, max_num_tokens),), torch.int64, device)
        # Graph mode: the rows of a padded step's logits that are sampled (picked after the forward).
        self.picked_rows = _Buffer((max(max_num_seqs, max_num_tokens),), torch.int64, device)
        self.cu_seqlens_q = _Buffer((max_num_seqs + 1,), torch.int32, device)
        self.seq_lens = _Buffer((max_num_seqs,), torch.int32, device)
        self.tables = {
            block_size: _Buffer((num_groups, max_num_seqs, width), torch.int32, device)
            for block_size, (num_groups, width) in table_shapes.items()
        }
        self.slots = {
            block_size: _Buffer((num_groups, max_num_tokens), torch.int64, device)
            for block_size, (num_groups, _) in table_shapes.items()
        }
        self.tiles: dict[int, tuple[_Buffer, _Buffer]] = {}
        self._rows = np.arange(max(max_num_seqs, max_num_tokens) + 1, dtype=np.int64)
        self._cu_arange = 0  # cu_seqlens_q holds 0..n for every n up to this
        self._views: dict[tuple[object, int], object] = {}
        # Per block size, what the C fill needs of the persistent batch's tables array (`_fill_table_facts`).
        self._fill_tables: dict[int, tuple[np.ndarray, int, tuple[int, ...] | None]] = {}
        # The slot mapping and table rows in one C call (step_fill.c), and a decode step's inputs read from its lists
        # in another (step_native.c): the extension module's functions where Python's headers build it, else the
        # fill through ctypes and the inputs by `array`s, else numpy. Tests switch each off to compare the paths.
        native = _NATIVE.get()
        self.fill = native.step_fill if native is not None else _FILL.get()
        self.decode_inputs = native.decode_inputs if native is not None else None
        # A decode step's query lengths, and its sequences' rows of the persistent batch's tables (decode_step).
        self._ones = np.ones(max(max_num_seqs, max_num_tokens), dtype=np.int64)
        self._ones_address = self._ones.ctypes.data
        self._decode_rows = _Buffer((max_num_seqs,), torch.int64, torch.device("cpu"))

    def fill_inputs(self, input_ids: np.ndarray | list[int], positions: np.ndarray, logits_rows: np.ndarray) -> None:
        """The step's flattened token ids and positions, and the rows whose logits it keeps."""
        num_tokens, num_rows = len(positions), len(logits_rows)
        self.input_ids.host[:num_tokens] = input_ids
        self.positions.host[:num_tokens] = positions
        self.logits_rows.host[:num_rows] = logits_rows
        self.input_ids.send(slice(0, num_tokens))
        self.positions.send(slice(0, num_tokens))
        self.logits_rows.send(slice(0, num_rows))

    def pick(self, rows: list[int] | np.ndarray) -> torch.Tensor:
        """`rows` (of a forward's logits) in the picked-rows buffer, on the device."""
        self.picked_rows.host[: len(rows)] = rows
        self.picked_rows.send(slice(0, len(rows)))
        return self.picked_rows.device[: len(rows)]

    def model_inputs(self, num_tokens: int, num_logits_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`input_ids` and `position_ids` (`[1, num_tokens]`) and `logits_to_keep` views for the forward."""
        return self._view("ids", num_tokens), self._view("positions", num_tokens), self._view("wanted", num_logits_rows)

    def step(
        self,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        positions: np.ndarray,
        tables: Mapping[int, np.ndarray],
        rows: np.ndarray,
        unstored: np.ndarray | None = None,
    ) -> dict[int, list[PagedAttentionMetadata]]:
        """Write one step's metadata and return it, per block size one `PagedAttentionMetadata` per group (in
        the order of `tables[block_size]`'s first axis), all sharing one `StepMetadata`. Rows in `unstored` (int64
        row indices: speculative proposals, whose keys are only read in flight) get slot -1.

        `query_lens` and `seq_lens` (int, `[num_seqs]`, checked by the caller: 1 <= query <= seq), the rows'
        `positions` (`[num_tokens]`, sequence by sequence, each sequence's last rows), and per block size the
        groups' block tables (int32 `[groups, any rows, width]`: the persistent batch's) of which sequence s
        reads row `rows[s]`, its entries covering the sequence's length. A negative entry -b is block b read
        at that position this step and stored into at another, so rows there, and at the null block, get slot
        -1 (see `StepMetadata.for_group`).
        """
        num_seqs, num_tokens = len(seq_lens), len(positions)
        decode_only = num_tokens == num_seqs
        cu_seqlens = self.cu_seqlens_q
        if decode_only:
            self._write_decode_cu_seqlens(num_seqs)
        else:
            cu_seqlens.host[0] = 0
            np.cumsum(query_lens, out=cu_seqlens.host[1 : num_seqs + 1])
            cu_seqlens.send(slice(0, num_seqs + 1))
            self._cu_arange = 0
        self.seq_lens.host[:num_seqs] = seq_lens
        self.seq_lens.send(slice(0, num_seqs))
        step = self._step_metadata(
            [1] * num_seqs if decode_only else query_lens.tolist(), seq_lens.tolist(), num_tokens
        )
        rows, query_lens, positions = _int64(rows), _int64(query_lens), _int64(positions)
        addresses = (rows.ctypes.data, query_lens.ctypes.data, positions.ctypes.data) if self.fill is not None else None
        return self._write_tables(step, tables, addresses, lambda: (rows, query_lens, positions), unstored=unstored)

    def decode_step(
        self,
        input_ids: list[int],
        seq_lens: list[int],
        request_ids: list[str],
        row_of: dict[str, int],
        logits_rows: list[int],
        tables: Mapping[int, np.ndarray],
    ) -> dict[int, list[PagedAttentionMetadata]] | None:
        """`fill_inputs` and `step` of a decode-only step (each sequence one new token, at position
        `seq_lens[s] - 1`, reading table row `row_of[request_ids[s]]`) from its Python lists, without a numpy call
        (each costs tens of microseconds after a forward has evicted its code): one C call (step_native.c)
        writes the inputs and the rows, or, where it is not built, each list goes into an `array` assigned to its
        buffer's flat view; then the C fill writes the slots and tables. None, writing nothing, where the C fill
        is not built or the step is larger than the buffers: the caller then calls `fill_inputs` and `step`
        (which raise for a step too large)."""
        num_seqs, num_wanted = len(seq_lens), len(logits_rows)
        if self.fill is None or num_seqs > self.max_num_seqs or num_wanted > self.max_num_seqs:
            return None
        if self.decode_inputs is not None:
            longest = self.decode_inputs(
                input_ids, seq_lens, request_ids, row_of, logits_rows, self.input_ids.address,
                self.positions.address, self.seq_lens.address, self._decode_rows.address, self.logits_rows.address,
                self.max_num_seqs,
            )  # fmt: skip
        else:
            longs = [
                array("q", values)
                for values in (input_ids, [n - 1 for n in seq_lens], logits_rows, map(row_of.__getitem__, request_ids))
            ]
            if len(longs[0]) != num_seqs or len(longs[3]) != num_seqs:
                raise ValueError(f"a decode step of {num_seqs} sequences has one token id and one row for each")
            for buffer, values in zip(
                (self.input_ids, self.positions, self.logits_rows, self._decode_rows), longs, strict=True
            ):
                buffer.flat[: len(values)] = values
            self.seq_lens.flat[:num_seqs] = array("i", seq_lens)
            longest = max(seq_lens)
        for buffer, length in (
            (self.input_ids, num_seqs), (self.positions, num_seqs), (self.logits_rows, num_wanted),
            (self.seq_lens, num_seqs),
        ):  # fmt: skip
            buffer.send(slice(0, length))
        self._write_decode_cu_seqlens(num_seqs)
        step = self._step_metadata([1] * num_seqs, list(seq_lens), num_seqs)
        addresses = (self._decode_rows.address, self._ones_address, self.positions.address)

        # Made only where the C fill cannot write a block size's tables (numpy calls are what this path avoids).
        def numpy_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return self._decode_rows.host[:num_seqs], self._ones[:num_seqs], self.positions.host[:num_seqs]

        return self._write_tables(step, tables, addresses, numpy_inputs, longest)

    def _write_decode_cu_seqlens(self, num_seqs: int) -> None:
        """A decode step's cu_seqlens, 0, 1, ..., num_seqs: written once for the largest step so far."""
        if self._cu_arange < num_seqs:
            self.cu_seqlens_q.host[: num_seqs + 1] = self._rows[: num_seqs + 1]
            self.cu_seqlens_q.send(slice(0, num_seqs + 1))
            self._cu_arange = num_seqs

    def _step_metadata(self, query_lens: list[int], seq_lens: list[int], num_tokens: int) -> StepMetadata:
        """The step's lengths over views of the cu_seqlens and seq_lens buffers (written by the caller)."""
        num_seqs = len(seq_lens)
        step = StepMetadata(
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            cu_seqlens_q=self._view("cu", num_seqs + 1),
            seq_lens=self._view("seq_lens", num_seqs),
            num_query_tokens=num_tokens,
            backend=self.backend,
        )
        step.buffers = self
        return step

    def _write_tables(
        self,
        step: StepMetadata,
        tables: Mapping[int, np.ndarray],
        addresses: tuple[int, int, int] | None,
        numpy_inputs: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray]],
        longest: int | None = None,
        unstored: np.ndarray | None = None,
    ) -> dict[int, list[PagedAttentionMetadata]]:
        """The step's slot mapping and table rows per block size: by the C fill from the `addresses` of its rows,
        query lengths and positions (int64), or by numpy from the same, as arrays `numpy_inputs()` returns, where
        it cannot. `longest`: the longest sequence, where the caller knows it."""
        num_seqs, num_tokens = step.num_seqs, step.num_query_tokens
        if longest is None:
            longest = max(step.seq_lens_list)
        fill = self.fill if addresses is not None else None
        metadata: dict[int, list[PagedAttentionMetadata]] = {}
        for block_size, groups in tables.items():
            num_groups = groups.shape[0]
            block_width = -(-longest // block_size)
            slots = self.slots[block_size]
            table = self.tables[block_size]
            known = self._fill_tables.get(block_size)
            if known is None or known[0] is not groups:
                known = self._fill_tables[block_size] = self._fill_table_facts(block_size, groups)
            _, max_width, fill_arguments = known
            # The C loop checks the tables' rows and positions; a step larger than the buffers goes to numpy,
            # which raises.
            if (
                fill is not None
                and fill_arguments is not None
                and block_width <= max_width
                and num_tokens <= self.max_num_tokens
                and num_seqs <= self.max_num_seqs
            ):
                address, num_rows, row_stride, slots_address, slots_stride, table_address, group_stride, width = (
                    fill_arguments
                )
                rows_at, query_lens_at, positions_at = addresses
                if fill(
                    address, num_groups, num_rows, row_stride, rows_at, query_lens_at, num_seqs, positions_at,
                    block_size, block_width, slots_address, slots_stride, table_address, group_stride, width,
                ):  # fmt: skip
                    raise IndexError("a step's table row or position lies outside the persistent batch's tables")
            else:
                rows, query_lens, positions = numpy_inputs()
                token_rows = rows if num_tokens == num_seqs else np.repeat(rows, query_lens)
                entries = groups[:, token_rows, positions // block_size]
                written = slots.host[:num_groups, :num_tokens]
                np.multiply(entries, block_size, out=written, dtype=np.int64)
                written += positions % block_size
                written[entries <= 0] = -1
                np.abs(groups[:, rows, :block_width], out=table.host[:num_groups, :num_seqs, :block_width])
            if unstored is not None:
                slots.host[:num_groups, unstored] = -1
            table.send(slice(0, num_groups), slice(0, num_seqs), slice(0, block_width))
            slots.send(slice(0, num_groups), slice(0, num_tokens))
            tables_by_group = self._view(("tables", block_size), num_seqs)
            slots_by_group = self._view(("slots", block_size), num_tokens)
            metadata[block_size] = [
                PagedAttentionMetadata(step, group_table, group_slots, block_size, None)
                for group_table, group_slots in zip(tables_by_group, slots_by_group, strict=True)
            ]
        return metadata

    def _fill_table_facts(self, block_size: int, groups: np.ndarray) -> tuple[np.ndarray, int, tuple[int, ...] | None]:
        """What `_write_tables` reads of a block size's persistent tables `groups` and its own buffers, worked out
        once per tables array (an array's address, type and shape never change; each numpy attribute costs
        microseconds after a forward has evicted numpy's code): `groups` itself (what the facts are of), the
        widest table row both hold, and the C fill's fixed arguments (None where it cannot read `groups`)."""
        slots_host, table_host = self.slots[block_size].host, self.tables[block_size].host
        max_width = min(groups.shape[2], table_host.shape[2])
        if groups.dtype != np.int32 or not groups.flags.c_contiguous or groups.shape[0] > table_host.shape[0]:
            return groups, max_width, None
        fill_arguments = (
            groups.ctypes.data, groups.shape[1], groups.shape[2], self.slots[block_size].address, slots_host.shape[1],
            self.tables[block_size].address, table_host.shape[1] * table_host.shape[2], table_host.shape[2],
        )  # fmt: skip
        return groups, max_width, fill_arguments

    def _view(self, name: str | tuple[str, int], length: int):
        """The leading `length` of a buffer on the device (per group, for tables and slots; `[1, length]` for the
        input ids and positions), made once per length: slicing a tensor costs microseconds, and the views of a
        length never change. Made outside inference mode, as their buffers were (the forward's are asked for in it)."""
        key = (name, length)
        view = self._views.get(key)
        if view is None:
            with torch.inference_mode(False):
                view = self._views[key] = self._new_view(name, length)
        return view

    def _new_view(self, name: str | tuple[str, int], length: int):
        if name == "cu":
            return self.cu_seqlens_q.device[:length]
        if name == "seq_lens":
            return self.seq_lens.device[:length]
        if name == "ids":
            return self.input_ids.device[:length].view(1, length)
        if name == "positions":
            return self.positions.device[:length].view(1, length)
        if name == "wanted":
            return self.logits_rows.device[:length]
        kind, block_size = name
        buffer = (self.tables if kind == "tables" else self.slots)[block_size].device
        return [buffer[group, :length] for group in range(buffer.shape[0])]

    def triton_tiles(self, step: StepMetadata, block_q: int) -> TritonQueryTiles:
        """The step's Triton query tiles of `block_q` rows, written into this height's buffers."""
        buffers = self.tiles.get(block_q)
        if buffers is None:
            size = self.max_num_tokens // block_q + self.max_num_seqs
            buffers = self.tiles[block_q] = (
                _Buffer((size,), torch.int32, self.device),
                _Buffer((size,), torch.int32, self.device),
            )
        seq_ids, starts = buffers
        query_lens = np.asarray(step.query_lens_list, dtype=np.int64)
        tiles_per_seq = -(-query_lens // block_q)
        num_tiles = int(tiles_per_seq.sum())
        seq_ids.host[:num_tiles] = np.repeat(self._rows[: len(query_lens)], tiles_per_seq)
        first_tile = np.cumsum(tiles_per_seq) - tiles_per_seq
        starts.host[:num_tiles] = (self._rows[:num_tiles] - np.repeat(first_tile, tiles_per_seq)) * block_q
        seq_ids.send(slice(0, num_tiles))
        starts.send(slice(0, num_tiles))
        return TritonQueryTiles(seq_ids.device[:num_tiles], starts.device[:num_tiles])

    def write_all_tiles(self, step: StepMetadata) -> None:
        """The step's tiles at every height a kernel has asked for: before a graph replays kernels that read
        them, since an eager step in between may have written others."""
        for block_q in self.tiles:
            step.triton_tiles_by_height.pop(block_q, None)
            step.triton_tiles(block_q)
