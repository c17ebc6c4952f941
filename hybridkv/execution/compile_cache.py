"""Compiled programs on disk (hybridkv/execution/compilation.py): where they live, their key, and rebuilding a bad
entry.

The cache lives under `$HYBRIDKV_CACHE_DIR`, else `$XDG_CACHE_HOME/hybridkv`, else `~/.cache/hybridkv`; each
program is a folder `compiled/<key>/` holding `program.json` (the program's spec) and one file per distinct
piece (inductor's saved artifact). The key covers everything the compiled code depends on:

- the model as traced: its modules' classes and code (source files, methods, forwards set on an instance, hooks)
  and plain attributes, its config, every tensor's name, shape and dtype, its adapters' state and whether it
  is in training mode (`model_key`);
- where it runs: the device (a GPU's name and capability, a CPU's instruction sets), and the versions of Python,
  torch, triton, transformers and peft, and hybridkv's own source;

so a different config, dtype, device or version never loads another's code. An entry that cannot be read (a
truncated file, another format) is deleted and compiled again, with a warning, never an error. Entries are
written to a temporary folder and renamed into place, so that a process reading beside one writing sees a whole
entry or none.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import types
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

FORMAT = 1  # program.json's layout; an entry of another is compiled again


def cache_dir() -> Path:
    """Where hybridkv keeps what it builds once and reuses (compiled programs)."""
    explicit = os.environ.get("HYBRIDKV_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "hybridkv"


def model_key(model: torch.nn.Module, adapters: Any) -> str:
    """What a trace read of the model besides its tensors' values: its modules' code (`_code_digest`) and plain
    attributes, its config, its tensors' names, shapes and dtypes, its adapters' state
    (`model_watch.model_adapter_state`) and train/eval."""
    digest = hashlib.sha256()
    digest.update(_code_digest(model))
    config = getattr(model, "config", None)
    if config is not None:
        fields = json.loads(config.to_json_string(use_diff=False))
        fields.pop("_name_or_path", None)
        digest.update(json.dumps(fields, sort_keys=True, default=str).encode())
    for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|{tensor.device}\n".encode())
    digest.update(repr((adapters, model.training)).encode())
    return digest.hexdigest()


def program_key(model_digest: str, device: torch.device) -> str:
    """The cache key of a program: the model's key (`model_key`) where it runs (device and versions)."""
    parts = [
        f"format={FORMAT}",
        model_digest,
        _device_description(device),
        f"python={sys.version_info[:3]}",
        *(f"{name}={_version(name)}" for name in ("torch", "triton", "transformers", "peft")),
        f"hybridkv={_hybridkv_digest()}",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:40]


class ProgramCache:
    """The compiled programs under one cache directory."""

    def __init__(self, root: Path) -> None:
        self.root = root / "compiled"

    def entry(self, key: str) -> Path:
        return self.root / key

    def load(self, key: str) -> tuple[dict[str, Any], list[Any]] | None:
        """The entry's spec (as saved) and its pieces, loaded; None when there is none, or (with a warning, after
        deleting it) when it cannot be read."""
        entry = self.entry(key)
        if not entry.is_dir():
            return None
        try:
            data = json.loads((entry / "program.json").read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, not {FORMAT}")
            pieces = [
                torch._inductor.CompiledArtifact.load(path=str(entry / f"{piece}.bin"), format="binary")
                for piece in data["spec"]["piece_keys"]
            ]
        except Exception as exc:
            self.discard(key, f"{type(exc).__name__}: {exc}")
            return None
        return data["spec"], pieces

    def save(self, key: str, spec: dict[str, Any], pieces: list[Any]) -> None:
        """Write an entry (a warning, not an error, when the disk refuses)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".writing-", dir=self.root))
            for piece_key, piece in zip(spec["piece_keys"], pieces, strict=True):
                piece.save(path=str(staging / f"{piece_key}.bin"), format="binary")
            (staging / "program.json").write_text(json.dumps({"format": FORMAT, "spec": spec}))
            try:
                staging.rename(self.entry(key))
            except OSError:  # another process wrote it first
                shutil.rmtree(staging, ignore_errors=True)
        except Exception as exc:
            warnings.warn(
                f"hybridkv could not save the compiled program under {self.root} ({type(exc).__name__}: {exc}); "
                "the next process compiles it again",
                stacklevel=2,
            )

    def discard(self, key: str, why: str) -> None:
        """Delete an entry that cannot be used, with a warning saying it is compiled again."""
        warnings.warn(
            f"hybridkv's compile cache entry {self.entry(key)} cannot be used ({why}); it is compiled again",
            stacklevel=3,
        )
        shutil.rmtree(self.entry(key), ignore_errors=True)


_PLAIN = (bool, int, float, str, type(None))


def _code_digest(model: torch.nn.Module) -> bytes:
    """Per module: its class (the source file it comes from, and the code of the methods it defines, for a class
    without a file, one defined in a notebook), a forward set on the instance, its hooks' code, and its plain
    attributes (numbers, strings, tuples of them: `scaling`, `is_causal`, ...), which the trace baked in."""
    digest = hashlib.sha256()
    classes: dict[type, None] = {}
    for name, module in model.named_modules():
        cls = type(module)
        classes.setdefault(cls)
        digest.update(f"{name}:{cls.__module__}.{cls.__qualname__}\n".encode())
        state = vars(module)
        plain = sorted(
            (key, value)
            for key, value in state.items()
            if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value))
        )
        digest.update(repr(plain).encode())
        for key in ("forward", "_forward_hooks", "_forward_pre_hooks"):
            value = state.get(key)
            functions = value.values() if isinstance(value, dict) else () if value is None else (value,)
            for function in functions:
                digest.update(key.encode() + _function_digest(function))
    for cls in classes:
        digest.update(_file_digest(getattr(sys.modules.get(cls.__module__), "__file__", None)))
        for value in vars(cls).values():
            if callable(value) and hasattr(value, "__code__"):
                digest.update(_function_digest(value))
    return digest.digest()


def _function_digest(function: Any) -> bytes:
    """A function's code (a bound method's, a partial's), or its type's name for a callable without code."""
    function = getattr(function, "func", function)
    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    if code is None:
        return type(function).__qualname__.encode()
    return hashlib.sha256(_code_bytes(code)).digest()


def _code_bytes(code: types.CodeType) -> bytes:
    """A code object's bytecode, names and constants, nested functions' code included: the same in every process
    (marshal's output is not: it marks objects by reference count)."""
    return code.co_code + repr(code.co_names).encode() + b"".join(map(_const_bytes, code.co_consts))


def _const_bytes(const: Any) -> bytes:
    if isinstance(const, types.CodeType):
        return _code_bytes(const)
    if isinstance(const, frozenset):  # `x in {...}`: its order follows string hashes, salted per process
        return repr(sorted(map(repr, const))).encode()
    return repr(const).encode()


def _device_description(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{device}|{props.name}|{props.major}.{props.minor}|cuda {torch.version.cuda}"
    return f"{device}|{platform.machine()}|{_cpu_flags()}"


def _cpu_flags() -> str:
    """The CPU's instruction sets (inductor's C++ is built for the CPU that compiles it)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return hashlib.sha256(line.split(":", 1)[1].strip().encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor()


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "none"


def _file_digest(path: str | None) -> bytes:
    if path is None:
        return b""
    try:
        return hashlib.sha256(Path(path).read_bytes()).digest()
    except OSError:
        return b""


_HYBRIDKV_DIGEST: str | None = None


def _hybridkv_digest() -> str:
    """A digest of hybridkv's own source (the code a trace runs through)."""
    global _HYBRIDKV_DIGEST
    if _HYBRIDKV_DIGEST is None:
        digest = hashlib.sha256()
        # The package's folders found by name, not imported (this module is part of the package).
        for package in ("hybridkv", "hybridkv.kernels", "hybridkv.patches"):
            folder = Path(importlib.util.find_spec(package).origin).parent
            for path in sorted(folder.rglob("*.py")):
                digest.update(path.relative_to(folder).as_posix().encode() + path.read_bytes())
        _HYBRIDKV_DIGEST = digest.hexdigest()
    return _HYBRIDKV_DIGEST
