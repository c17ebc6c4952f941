"""The CPU decode kernel (``cpu_decode.c``): built on first use with the machine's C compiler, loaded
with ctypes, and called by the torch path for a step's decode rows on CPU tensors.

The library is compiled once per source, compiler and CPU (``-O3 -march=native -fopenmp``) into
``$HYBRIDKV_CACHE_DIR`` (default ``~/.cache/hybridkv``), about a second, and reused by every later
process. It links the libgomp that torch has already loaded, so its threads are torch's threads.
Where no compiler works, or ``HYBRIDKV_CPU_KERNEL=0`` is set, ``available()`` is False and the torch
path attends to decode rows itself (same results to fp32 rounding).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .quant import is_fp8
from .torch_plan import DecodeRows

_SOURCE = Path(__file__).with_name("cpu_decode.c")
# Tried in order: a compiler without -march=native or without OpenMP (the kernel then runs on one
# thread) still builds it.
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"], ["-O3"])
_disabled = 0
_luts: dict[torch.dtype, torch.Tensor] = {}
# cpu_decode.c's TILE, and its bound on the floats one work item keeps on its stack (it returns 1 past it).
_TILE = 32
_MAX_ITEM_FLOATS = 65536

_c_int64, _c_int, _c_float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_ARGTYPES = (
    [_c_int64, _ptr, _ptr, _ptr, _ptr]  # rows and their sequences, first positions, lengths
    + [_ptr, _c_int64, _c_int64, _ptr, _c_int64, _c_int64]  # query, out
    + [_ptr, _c_int64, _c_int64, _c_int64] * 2  # key and value pages
    + [_ptr, _c_int64]  # block table
    + [_ptr, _c_int64, _c_int64] * 2  # the step's own key and value rows (in flight)
    + [_ptr, _c_int, _c_int, _c_int, _ptr]  # slots to store the rows at, before reading?, element format, size, table
    + [_c_int] * 5  # q heads, kv heads, head dim, value dim, block size
    + [_c_float, _c_float, _c_float, _ptr, _c_int, _c_int64]  # scale, v_scale, softcap, sinks, threads, work
)


def available() -> bool:
    """Whether the kernel is built and loaded (building it on the first call)."""
    return _DECODE.get() is not None


def accepts(group: int, head_dim: int, value_dim: int) -> bool:
    """Whether the kernel is available and its stack buffers hold a GQA group's rows (any real model's do)."""
    floats = group * (head_dim + value_dim + 2 + _TILE) + _TILE * (head_dim + value_dim)
    return not _disabled and floats <= _MAX_ITEM_FLOATS and available()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside, the torch path attends to decode rows itself (tests and benchmarks compare the two)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None while it is True or not yet asked)."""
    return _DECODE.failure


class _Native:
    """Native code of this folder's C sources, built and loaded on first use by the subclass's `_load`: `get()` is
    what it loads, or None where it does not build or load, or ``HYBRIDKV_CPU_KERNEL=0`` is set (`failure` then
    says why). Thread-safe: one thread builds, the others wait for it."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failure: str | None = None
        self._loaded: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        if self._loaded is not None or self.failure is not None:
            return self._loaded
        with self._lock:
            if self._loaded is None and self.failure is None:
                if os.environ.get("HYBRIDKV_CPU_KERNEL", "1") == "0":
                    self.failure = "HYBRIDKV_CPU_KERNEL=0"
                else:
                    try:
                        self._loaded = self._load()
                    except (ImportError, OSError, RuntimeError) as error:
                        self.failure = str(error)
        return self._loaded

    def _load(self) -> Any:
        raise NotImplementedError


class NativeFunction(_Native):
    """One C function of this folder's sources, built (`build_library`) and loaded with ctypes on first use:
    `get()` is the function, or None where no compiler builds it or ``HYBRIDKV_CPU_KERNEL=0`` is set
    (`failure` then says why)."""

    def __init__(self, source: Path, name: str, argtypes: list, restype: type, what: str) -> None:
        super().__init__(what)
        self.source, self.name, self.argtypes, self.restype = source, name, argtypes, restype

    def _load(self) -> ctypes._CFuncPtr:
        function = getattr(ctypes.CDLL(str(build_library(self.source, self.what))), self.name)
        function.argtypes, function.restype = self.argtypes, self.restype
        return function


_DECODE = NativeFunction(_SOURCE, "hybridkv_paged_decode", _ARGTYPES, ctypes.c_int, "the CPU decode kernel")


class NativeModule(_Native):
    """A CPython extension module built from this folder's C sources (the first defines the module `name`) against
    the running Python's headers, and imported, on first use: `get()` is the module, or None where it does not
    build (no compiler, no Python headers) or ``HYBRIDKV_CPU_KERNEL=0`` is set (`failure` then says why). Its
    functions are called as Python's own are: no ctypes conversion of each argument, which costs microseconds a
    call once a forward has evicted its code."""

    def __init__(self, sources: list[Path], name: str, what: str) -> None:
        super().__init__(what)
        self.sources, self.name = sources, name

    def _load(self) -> types.ModuleType:
        path = build_library(self.sources[0], self.what, python_api=True, extra=self.sources[1:])
        spec = importlib.util.spec_from_file_location(self.name, path)
        if spec is None or spec.loader is None:
            raise RuntimeError(f"{path} is not an extension module of this Python")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def build_library(
    source_path: Path, what: str = "the CPU decode kernel", python_api: bool = False, extra: Sequence[Path] = ()
) -> Path:
    """The shared library of a C source of this package (`what`, for errors), with the `extra` sources linked in,
    built (or found built) in the cache directory for these sources, compiler and CPU (and, with `python_api`,
    against this Python's headers, for this Python's version and build); RuntimeError where no flag set builds it."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    sources = [source_path, *extra]
    source = b"".join(path.read_bytes() for path in sources)
    cache_dir = Path(os.environ.get("HYBRIDKV_CACHE_DIR") or Path.home() / ".cache" / "hybridkv")
    errors = []
    python_flags = [f"-I{sysconfig.get_paths()['include']}"] if python_api else []
    python_build = f" {sys.version} {sysconfig.get_config_var('SOABI')}" if python_api else ""
    for flags in (python_flags + flag_set for flag_set in _FLAG_SETS):
        key = " ".join([compiler, *flags, _cpu_signature()]) + python_build
        digest = hashlib.sha256(source + key.encode()).hexdigest()[:16]
        target = cache_dir / f"{source_path.stem}-{digest}.so"
        if target.exists():
            return target
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
            built = Path(scratch) / target.name
            command = [compiler, *flags, "-fPIC", "-shared", *map(str, sources), "-o", str(built), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode == 0:
                os.replace(built, target)  # atomic: a process racing this one loads a whole file
                return target
            errors.append(f"{' '.join(command)}: {result.stderr.strip()[-500:]}")
    raise RuntimeError(f"could not build {what}: " + " | ".join(errors))


def _cpu_signature() -> str:
    """What -march=native depends on: a library built on one CPU may not run on another."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def element_format(dtype: torch.dtype) -> tuple[int, torch.Tensor | None]:
    """The kernel's element format for a cache dtype, with the lookup table of its values if it needs one."""
    if dtype == torch.float32:
        return 0, None
    if dtype == torch.bfloat16:
        return 1, None
    lut = _luts.get(dtype)
    if lut is None:
        if dtype.itemsize == 2:
            bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
        elif is_fp8(dtype):
            bits = torch.arange(1 << 8, dtype=torch.int32).to(torch.uint8)
        else:
            raise ValueError(f"no CPU decode format for {dtype}")
        lut = bits.view(dtype).float()
        _luts[dtype] = lut
    return (2 if dtype.itemsize == 2 else 3), lut


def paged_decode(
    decode: DecodeRows,
    query: torch.Tensor,
    out: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    key_rows: torch.Tensor | None,
    value_rows: torch.Tensor | None,
    scale: float,
    v_scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
    store_slots: torch.Tensor | None = None,
    store_first: bool = False,
) -> None:
    """Attend every listed decode row (for a head shape the kernel ``accepts``); with ``store_slots``
    (int64, a slot per row of the step, -1: none) also store each row's ``key_rows``/``value_rows``
    into its slot, after reading (with ``store_first``: every row before any is read).

    ``decode`` lists the rows, their sequences, first visible positions and lengths. ``query`` is fp32
    ``[rows, q_heads, dim]`` (unscaled), ``out`` fp32 ``[rows, q_heads, value_dim]``; both with a
    contiguous last dimension. ``key_rows``/``value_rows`` are the step's rows as the cache holds them
    (the last position of each row is read from them), or None when the rows are already stored.
    ``scale`` includes the K scale.
    """
    kernel = _DECODE.get()
    assert kernel is not None, "call available() first"
    seq_ids, rows, first_positions, seq_lens = decode.seq_ids, decode.rows, decode.first_positions, decode.seq_lens
    fmt, lut = element_format(key_cache.dtype)
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, value_dim = value_cache.shape
    in_flight = key_rows is not None and value_rows is not None
    threads = torch.get_num_threads()
    status = kernel(
        rows.numel(), seq_ids.data_ptr(), rows.data_ptr(), first_positions.data_ptr(), seq_lens.data_ptr(),
        query.data_ptr(), query.stride(0), query.stride(1),
        out.data_ptr(), out.stride(0), out.stride(1),
        key_cache.data_ptr(), *key_cache.stride()[:3],
        value_cache.data_ptr(), *value_cache.stride()[:3],
        block_table.data_ptr(), block_table.stride(0),
        key_rows.data_ptr() if in_flight else None, *(key_rows.stride()[:2] if in_flight else (0, 0)),
        value_rows.data_ptr() if in_flight else None, *(value_rows.stride()[:2] if in_flight else (0, 0)),
        None if store_slots is None or not in_flight else store_slots.data_ptr(), int(store_first),
        fmt, key_cache.element_size(), None if lut is None else lut.data_ptr(),
        num_q_heads, num_kv_heads, head_dim, value_dim, block_size,
        scale, v_scale, softcap or 0.0, None if sinks is None else sinks.data_ptr(), threads,
        decode.num_keys * num_q_heads * head_dim,
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(
            f"the CPU decode kernel refused {num_q_heads} q heads, {num_kv_heads} kv heads, dims {head_dim}/{value_dim}"
        )
