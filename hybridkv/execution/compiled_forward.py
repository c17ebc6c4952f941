"""The runner's compiled forward: the program (hybridkv/execution/compilation.py) for the model as it is now.

A program is found by its key (hybridkv/execution/compile_cache.py): among those this runner built before (switching an
adapter back), then on disk (a second process), and only then traced and compiled, then saved. Each is run once
over a step of padding rows before it serves a step: a loaded entry that fails there is deleted and compiled
again. `follow` is called when the engine sees the model change (hybridkv/execution/model_watch.py): the same key
reads the model's tensors again (a replaced tensor), another one (an adapter switched) takes its own program. A model in
training mode is traced and served in eval mode (hybridkv/execution/eval_semantics.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from hybridkv.execution.compilation import CannotCompile, PiecewiseProgram, ProgramSpec, compile_piece, trace
from hybridkv.execution.compile_cache import ProgramCache, cache_dir, model_key, program_key
from hybridkv.execution.model_watch import model_adapter_state
from hybridkv.execution.progress import progress_bar

logger = logging.getLogger("hybridkv")

# A step to trace and check a program over: its inputs, run inside the runner's step context.
ExampleStep = Callable[[], tuple[Any, tuple[torch.Tensor, ...]]]


class CompiledForward:
    """The compiled forward of one runner's model on `device`; `program` serves steps once `prepare` found it."""

    def __init__(self, model: torch.nn.Module, device: torch.device, use_tqdm: bool) -> None:
        self.model = model
        self.device = device
        self.use_tqdm = use_tqdm
        self.cache = ProgramCache(cache_dir())
        self.program: PiecewiseProgram | None = None
        self.key: str | None = None
        self._programs: dict[str, PiecewiseProgram] = {}
        # How the current program was found ("traced", "disk", "memory"), and the seconds its set-up took.
        self.origin = ""
        self.trace_seconds = self.compile_seconds = self.load_seconds = 0.0
        # More keyword arguments of the traced forward: a latent attention model's step cache (set by the runner).
        self.trace_kwargs: dict[str, Any] = {}

    def prepare(self, example: ExampleStep) -> PiecewiseProgram:
        """The program for the model as it is now, checked over `example`; raises CannotCompile naming the cause."""
        key = program_key(model_key(self.model, model_adapter_state(self.model)), self.device)
        if key == self.key and self.program is not None:
            self.program.bind(self.model)
            return self.program
        program = self._programs.get(key)
        if program is not None:
            self.origin = "memory"
            program.bind(self.model)
        else:
            program = self._load(key, example) or self._trace(key, example)
            self._programs[key] = program
        self.program, self.key = program, key
        return program

    def _load(self, key: str, example: ExampleStep) -> PiecewiseProgram | None:
        start = time.perf_counter()
        loaded = self.cache.load(key)
        if loaded is None:
            return None
        spec, pieces = loaded
        try:
            program = PiecewiseProgram(ProgramSpec.from_json(spec), pieces)
            program.bind(self.model)
            _run_once(program, example)
        except Exception as exc:
            self.cache.discard(key, f"{type(exc).__name__}: {exc}")
            return None
        self.origin, self.load_seconds = "disk", time.perf_counter() - start
        logger.info(
            "hybridkv: loaded %s's compiled forward from %s in %.1f s",
            type(self.model).__name__,
            self.cache.entry(key),
            self.load_seconds,
        )
        return program

    def _trace(self, key: str, example: ExampleStep) -> PiecewiseProgram:
        name = type(self.model).__name__
        logger.info("hybridkv: tracing %s's forward (torch.compile, once)", name)
        step, inputs = example()
        traced = trace(self.model, step, inputs, self._compile_pieces, self.trace_kwargs)
        program = PiecewiseProgram(traced.spec, traced.pieces)
        program.bind(self.model)
        _run_once(program, example)
        self.origin = "traced"
        self.trace_seconds, self.compile_seconds = traced.trace_seconds, traced.compile_seconds
        num_pieces = sum(1 for call in traced.spec.calls if hasattr(call, "piece"))
        logger.info(
            "hybridkv: compiled %s's forward: traced in %.1f s, %d pieces of which %d distinct compiled in %.1f s",
            name,
            self.trace_seconds,
            num_pieces,
            len(traced.pieces),
            self.compile_seconds,
        )
        self.cache.save(key, traced.spec.to_json(), traced.pieces)
        return program

    def _compile_pieces(self, pieces: list[tuple[torch.fx.GraphModule, list[Any]]]) -> list[Any]:
        bar = progress_bar(len(pieces), self.use_tqdm, desc="hybridkv: compiling", unit="piece")
        try:
            compiled = []
            for module, fake_args in pieces:
                compiled.append(compile_piece(module, fake_args))
                bar.update(1)
            return compiled
        finally:
            bar.close()


def _run_once(program: PiecewiseProgram, example: ExampleStep) -> None:
    _, inputs = example()
    try:
        program(*inputs)
    except Exception as exc:
        raise CannotCompile(f"its compiled program failed on a first step ({type(exc).__name__}: {exc})") from exc
