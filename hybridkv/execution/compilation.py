"""The compiled forward (`compile`): traced once, split at attention, identical pieces compiled once.

dynamo traces the step's forward (`step_forward`) once, with two dynamic sizes: the step's tokens and its
logits rows. They are marked dynamic and traced size-obliviously, so that a step of one token runs the code a
step of 500 does (no 0/1 specialisation, no recompile). The graph is split at every `hybridkv::paged_attention`
op, as vLLM does: between two attentions lie a layer's norm, MLP and residuals and the next layer's
projections, the same graph for every layer of a kind over other weights. Pieces are compared by their
graph and their inputs' shapes (`piece_key`), and each distinct one is compiled once by inductor
(`torch._inductor.standalone_compile`): a 26-layer model compiles the pieces a 6-layer one does.

What runs afterwards is a `PiecewiseProgram`, not dynamo: the compiled pieces and the attention ops in order
over a table of values, the model's tensors read at the paths dynamo recorded (`InputPath`). No guard runs per
step; what the trace read of the model besides its tensors (its config, its adapters, train or eval) is in the
program's key (hybridkv/execution/compile_cache.py), which the runner checks whenever the engine follows the model.
A decode bucket's CUDA graph is captured over the program; a mixed step runs it as it is, the pieces compiled
and attention between them.
"""

from __future__ import annotations

import hashlib
import operator
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from hybridkv.patches.attention import STEP_KWARG

ATTENTION_OP = torch.ops.hybridkv.paged_attention
DYNAMIC_INPUTS = {"input_ids": 1, "position_ids": 1, "logits_to_keep": 0}  # each input's dynamic dimension


class CannotCompile(Exception):
    """The forward cannot be compiled into a program (a graph break, an input the program cannot find)."""


def step_forward(
    model: torch.nn.Module, step: Any, input_ids, position_ids, logits_to_keep, **extra: Any
) -> torch.Tensor:
    """The model's forward over a step's buffers (what is traced, and what `ModelRunner._forward` runs): logits
    `[rows of logits_to_keep, vocab]`; `extra`: more keyword arguments (a state layer model's cache)."""
    output = model(
        input_ids=input_ids,
        position_ids=position_ids,
        logits_to_keep=logits_to_keep,
        use_cache=False,
        **extra,
        **{STEP_KWARG: step},
    )
    return output.logits[0]


# ---- where a graph input comes from ------------------------------------------------------------------------


@dataclass(frozen=True)
class InputPath:
    """How to find one graph input from the traced function's arguments: the argument's name, then attribute
    (`("attr", name)`) and item (`("item", key)`) steps; `size` reads a dimension of the tensor found."""

    root: str
    steps: tuple[tuple[str, Any], ...] = ()
    size: int | None = None

    def find(self, roots: dict[str, Any]) -> Any:
        value = roots[self.root]
        for kind, key in self.steps:
            value = getattr(value, key) if kind == "attr" else value[key]
        return value if self.size is None else value.shape[self.size]

    def to_json(self) -> list[Any]:
        return [self.root, [list(step) for step in self.steps], self.size]

    @classmethod
    def from_json(cls, data: list[Any]) -> InputPath:
        root, steps, size = data
        return cls(root, tuple((kind, key) for kind, key in steps), size)


def input_path(source: Any) -> InputPath:
    """The path of a dynamo source (a chain of sources from a local); CannotCompile for a kind of source the program
    cannot follow."""
    steps: list[tuple[str, Any]] = []
    size = None
    while True:
        kind = type(source).__name__
        if kind == "LocalSource":
            return InputPath(source.local_name, tuple(reversed(steps)), size)
        if kind == "TensorPropertySource" and source.prop.name == "SIZE" and not steps and size is None:
            size = source.idx
        elif kind in ("AttrSource", "UnspecializedParamBufferSource", "ParamBufferSource"):
            steps.append(("attr", source.member))
        elif kind in ("DictGetItemSource", "GetItemSource") and isinstance(source.index, (str, int)):
            steps.append(("item", source.index))
        elif not kind.endswith("NNModuleSource"):
            raise CannotCompile(f"the graph reads {source.name}, which a compiled program cannot find")
        source = source.base


# ---- the program -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PieceCall:
    """Run distinct piece `piece` over the values in `args`; its outputs go to `outputs` (`single`: it returns
    one value, not a tuple)."""

    piece: int
    args: tuple[int, ...]
    outputs: tuple[int, ...]
    single: bool


@dataclass(frozen=True)
class AttentionCall:
    """One layer's `paged_attention` op: its arguments (a value's index, or a constant), its output's index."""

    args: tuple[tuple[str, Any], ...]  # ("value", index) or ("constant", value)
    output: int


@dataclass
class ProgramSpec:
    """A program without its compiled pieces: what is saved to disk beside them (`to_json`)."""

    inputs: list[InputPath]
    calls: list[PieceCall | AttentionCall]
    output: int
    num_values: int
    piece_keys: list[str]

    def to_json(self) -> dict[str, Any]:
        calls = []
        for call in self.calls:
            if isinstance(call, PieceCall):
                calls.append(["piece", call.piece, list(call.args), list(call.outputs), call.single])
            else:
                calls.append(["attention", [list(arg) for arg in call.args], call.output])
        return {
            "inputs": [path.to_json() for path in self.inputs],
            "calls": calls,
            "output": self.output,
            "num_values": self.num_values,
            "piece_keys": self.piece_keys,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProgramSpec:
        calls: list[PieceCall | AttentionCall] = []
        for call in data["calls"]:
            if call[0] == "piece":
                calls.append(PieceCall(call[1], tuple(call[2]), tuple(call[3]), call[4]))
            else:
                calls.append(AttentionCall(tuple((kind, value) for kind, value in call[1]), call[2]))
        inputs = [InputPath.from_json(path) for path in data["inputs"]]
        return cls(inputs, calls, data["output"], data["num_values"], list(data["piece_keys"]))


class PiecewiseProgram:
    """A compiled forward: `spec` run over `pieces` (one callable per distinct piece). `bind` finds the model's
    tensors at their paths (again after the model's tensors were replaced); a call takes the step's inputs."""

    def __init__(self, spec: ProgramSpec, pieces: Sequence[Callable[..., Any]]) -> None:
        self.spec = spec
        self.pieces = list(pieces)
        self._template: list[Any] = []
        self._dynamic: list[tuple[int, InputPath]] = []
        # Per call, the values no later call reads (dropped as the program runs, as an FX interpreter does).
        last_use: dict[int, int] = {}
        for index, call in enumerate(spec.calls):
            for value in _read_values(call):
                last_use[value] = index
        drops: list[list[int]] = [[] for _ in spec.calls]
        for value, index in last_use.items():
            if value != spec.output:
                drops[index].append(value)
        op = ATTENTION_OP.default
        self._steps: list[tuple[Any, ...]] = []
        for call, dropped in zip(spec.calls, drops, strict=True):
            if isinstance(call, PieceCall):
                self._steps.append((self.pieces[call.piece], call.args, call.outputs, call.single, tuple(dropped)))
            else:
                self._steps.append((op, call.args, (call.output,), None, tuple(dropped)))

    def bind(self, model: torch.nn.Module) -> None:
        """Read the model's tensors at their paths; raises CannotCompile when one is missing or no longer matches
        what was traced (its shape or dtype)."""
        template: list[Any] = [None] * self.spec.num_values
        dynamic = []
        for index, path in enumerate(self.spec.inputs):
            if path.root == "model":
                try:
                    template[index] = path.find({"model": model})
                except (AttributeError, KeyError, IndexError, TypeError) as exc:
                    raise CannotCompile(f"the model has no tensor at {path} any more ({exc})") from exc
            elif path.root in DYNAMIC_INPUTS:
                dynamic.append((index, path))
            else:
                raise CannotCompile(f"the graph reads {path.root}, which is no input of a step")
        self._template, self._dynamic = template, dynamic

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor):
        roots = {"input_ids": input_ids, "position_ids": position_ids, "logits_to_keep": logits_to_keep}
        values = self._template.copy()
        for index, path in self._dynamic:
            values[index] = path.find(roots)
        for fn, args, outputs, single, dropped in self._steps:
            if single is None:  # an attention op: its arguments are values and constants
                values[outputs[0]] = fn(*[values[arg] if kind == "value" else arg for kind, arg in args])
            else:
                result = fn(*[values[arg] for arg in args])
                if single:  # a piece just compiled returns its one output, one loaded from disk a list of it
                    values[outputs[0]] = result[0] if isinstance(result, (list, tuple)) else result
                else:
                    for index, value in zip(outputs, result, strict=True):
                        values[index] = value
            for index in dropped:
                values[index] = None
        return values[self.spec.output]


def _read_values(call: PieceCall | AttentionCall) -> list[int]:
    if isinstance(call, PieceCall):
        return list(call.args)
    return [arg for kind, arg in call.args if kind == "value"]


# ---- tracing and splitting ------------------------------------------------------------------------------


@dataclass
class TracedProgram:
    """What one trace gives: the program's spec and its distinct pieces compiled (by `compile_pieces`), and the
    seconds spent tracing and compiling."""

    spec: ProgramSpec
    pieces: list[Any]
    trace_seconds: float
    compile_seconds: float


PieceCompiler = Callable[[list[tuple[torch.fx.GraphModule, list[Any]]]], list[Any]]


def trace(
    model: torch.nn.Module,
    step: Any,
    inputs: Sequence[torch.Tensor],
    compile_pieces: PieceCompiler,
    extra: dict[str, Any] | None = None,
) -> TracedProgram:
    """Trace `step_forward` over one step's inputs (their dynamic sizes marked), split the graph and compile its
    distinct pieces with `compile_pieces` (each piece's graph and fake inputs; inside the trace, whose shape
    environment they need). The caller runs it under `running_step`. Raises CannotCompile naming the cause when
    the forward has a graph break or the graph reads what a program cannot find. `extra`: more keyword arguments of
    the traced forward (a latent attention model's cache, whose updates trace into `store_latent` ops: the program
    does not read it)."""
    import torch.fx.experimental._config as fx_config

    captured: list[TracedProgram] = []
    start = time.perf_counter()

    def backend(graph: torch.fx.GraphModule, _example_inputs: list[Any]) -> Callable[..., Any]:
        spec, pieces = _split(graph)
        traced = time.perf_counter()
        compiled = compile_pieces(pieces)
        captured.append(TracedProgram(spec, compiled, traced - start, time.perf_counter() - traced))
        return graph.forward  # this one call runs the traced graph as it is

    # A function of its own per trace: dynamo keeps what it compiled on the code object, which must not be shared
    # between engines (nothing calls it through dynamo after this trace).
    function = types.FunctionType(step_forward.__code__.replace(), step_forward.__globals__, "step_forward")
    compiled = torch.compile(function, backend=backend, fullgraph=True, dynamic=False)
    for name, tensor in zip(DYNAMIC_INPUTS, inputs, strict=True):
        torch._dynamo.mark_dynamic(tensor, DYNAMIC_INPUTS[name])
    try:
        with fx_config.patch(backed_size_oblivious=True):
            compiled(model, step, *inputs, **(extra or {}))
    except CannotCompile:
        raise
    except Exception as exc:
        cause = exc.inner_exception if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed) else exc
        if isinstance(cause, CannotCompile):
            raise cause from exc
        first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        message = f"torch.compile(fullgraph=True) cannot trace it ({type(cause).__name__}: {first_line})"
        raise CannotCompile(message) from exc
    if len(captured) != 1:
        raise CannotCompile(f"dynamo compiled {len(captured)} graphs of the forward; one was expected")
    return captured[0]


def _is_attention(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in (ATTENTION_OP, ATTENTION_OP.default)


def _split(graph: torch.fx.GraphModule) -> tuple[ProgramSpec, list[tuple[torch.fx.GraphModule, list[Any]]]]:
    placeholders = [node for node in graph.graph.nodes if node.op == "placeholder"]
    inputs = [input_path(node.meta["grapharg"].source) for node in placeholders]
    output_node = next(node for node in graph.graph.nodes if node.op == "output")
    returned = output_node.args[0]
    if not (isinstance(returned, (tuple, list)) and len(returned) == 1 and isinstance(returned[0], torch.fx.Node)):
        raise CannotCompile("the traced graph does not return the logits alone")
    partition, partitions = 0, {}
    for node in graph.graph.nodes:
        if _is_attention(node):
            partitions[node] = partition + 1
            partition += 2
        elif node.op not in ("placeholder", "output"):
            partitions[node] = partition
    split = split_module(graph, None, lambda node: partitions[node], keep_original_order=True)

    # Each piece's fake inputs: the example values dynamo recorded on the nodes, copied to its placeholders.
    piece_args = {
        name: [node.meta["example_value"] for node in module.graph.nodes if node.op == "placeholder"]
        for name, module in split.named_children()
    }

    slots = {node: index for index, node in enumerate(node for node in split.graph.nodes if node.op == "placeholder")}
    num_values = len(slots)
    calls: list[PieceCall | AttentionCall] = []
    keys: dict[str, int] = {}
    pieces: list[tuple[torch.fx.GraphModule, list[Any]]] = []
    tuple_outputs: dict[torch.fx.Node, tuple[int, ...]] = {}
    for node in split.graph.nodes:
        if node.op == "call_module":
            module = getattr(split, node.target)
            args = tuple(slots[arg] for arg in node.args)
            attention = [inner for inner in module.graph.nodes if _is_attention(inner)]
            returns = next(inner for inner in module.graph.nodes if inner.op == "output").args[0]
            if attention:
                inner_slots = dict(zip((n for n in module.graph.nodes if n.op == "placeholder"), args, strict=True))
                call_args = tuple(
                    ("value", inner_slots[arg]) if isinstance(arg, torch.fx.Node) else ("constant", arg)
                    for arg in attention[0].args
                )
                slots[node] = num_values
                calls.append(AttentionCall(call_args, num_values))
                num_values += 1
                continue
            key = piece_key(module, piece_args[node.target])
            if key not in keys:
                keys[key] = len(pieces)
                pieces.append((module, piece_args[node.target]))
            single = not isinstance(returns, (tuple, list))
            count = 1 if single else len(returns)
            outputs = tuple(range(num_values, num_values + count))
            num_values += count
            if single:
                slots[node] = outputs[0]
            else:
                tuple_outputs[node] = outputs
            calls.append(PieceCall(keys[key], args, outputs, single))
        elif node.op == "call_function" and node.target is operator.getitem:
            slots[node] = tuple_outputs[node.args[0]][node.args[1]]
        elif node.op == "output":
            output = slots[node.args[0][0]]
    return ProgramSpec(inputs, calls, output, num_values, list(keys)), pieces


def piece_key(module: torch.fx.GraphModule, args: Sequence[Any]) -> str:
    """What makes two pieces the same code: their graphs with nodes named by position, constants' contents, and
    their inputs' shapes (symbolic sizes by name), strides, dtypes and devices."""
    names = {node: f"n{index}" for index, node in enumerate(module.graph.nodes)}
    digest = hashlib.sha256()
    for node in module.graph.nodes:
        target = "" if node.op in ("placeholder", "output") else str(node.target)
        args_text = repr(torch.fx.node.map_arg((node.args, node.kwargs), lambda n: names[n]))
        digest.update(f"{node.op}|{target}|{args_text}\n".encode())
        if node.op == "get_attr":
            constant = operator.attrgetter(node.target)(module)
            if isinstance(constant, torch.Tensor):
                digest.update(repr((constant.shape, constant.dtype)).encode())
                digest.update(constant.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    for arg in args:
        if isinstance(arg, torch.Tensor):
            digest.update(repr((tuple(arg.shape), arg.stride(), arg.dtype, arg.device.type)).encode())
        else:
            digest.update(repr((type(arg).__name__, str(arg))).encode())
    return digest.hexdigest()[:32]


def compile_piece(module: torch.fx.GraphModule, fake_args: list[Any]) -> Any:
    """One distinct piece compiled by inductor (inside `trace`'s backend): a callable artifact that can be saved
    (`.save(path=..., format="binary")`) and loaded (`torch._inductor.CompiledArtifact.load`)."""
    return torch._inductor.standalone_compile(module, fake_args, dynamic_shapes="from_tracing_context", aot=True)
