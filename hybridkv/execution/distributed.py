"""Tensor parallelism: one engine over a model that transformers sharded across ranks (`tp_plan="auto"`
under `torchrun`, torch.distributed: NCCL on GPUs, gloo on the CPU).

Every rank patches its model (the probe sees the rank's own KV heads, so each rank's pages hold only
them) and agrees on one pool size, the smallest. Rank 0, the driver, is the whole engine: it schedules,
samples and returns outputs. Every step it broadcasts the step's inputs (`StepInputs`: tokens,
positions, lengths, block tables, swap and copy-on-write pairs); every rank prepares the step, all agree
that each could (one all-reduce), and only then do they copy blocks and run the forward together, whose
collectives need every rank. A rank that cannot prepare a step fails it everywhere: no page is touched,
the driver fails the step's requests and keeps serving. The other ranks run `run_worker` until the driver
closes its engine (`hybridkv.unpatch`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybridkv.execution.model_runner import ModelRunner, StepInputs
from hybridkv.scheduling.output import SchedulerOutput

_STOP = "stop"
_STEP = "step"
_CALL = "call"


def tensor_parallel_size(model: torch.nn.Module) -> int:
    """How many ranks the model's layers are sharded across (1 when it is not tensor parallel)."""
    size = getattr(model, "_tp_size", None) or 1
    if size > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError(
            f"the model is sharded for {size} ranks but torch.distributed is not initialized; "
            "load it with tp_plan='auto' under torchrun"
        )
    return size


class TensorParallel:
    """The driver's and the workers' side of each step (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        mesh = getattr(model, "_device_mesh", None)
        self.group = mesh.get_group("tp") if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) else None
        self.rank = torch.distributed.get_rank(self.group)
        self.size = torch.distributed.get_world_size(self.group)
        self.driver = self.rank == 0
        self._source = torch.distributed.get_global_rank(self.group, 0) if self.group is not None else 0
        backend = torch.distributed.get_backend(self.group)
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.closed = False

    def smallest(self, value: int) -> int:
        """The smallest of every rank's value (the pool size every rank can hold)."""
        tensor = torch.tensor([value], dtype=torch.long, device=self._device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def _broadcast(self, message: Any) -> Any:
        box = [message]
        torch.distributed.broadcast_object_list(box, src=self._source, group=self.group, device=self._device)
        return box[0]

    def _agree(self, ok: bool) -> bool:
        return self.smallest(int(ok)) == 1

    def execute(
        self, runner: ModelRunner, plan: SchedulerOutput, extra_rows: Sequence[int] = ()
    ) -> torch.Tensor | None:
        """The driver's step: send its inputs, prepare, agree, run. A rank that could not prepare fails
        the step (RuntimeError, nothing run anywhere). `extra_rows`: `ModelRunner.execute`'s."""
        inputs = runner.step_inputs(plan, extra_rows=extra_rows)
        self._broadcast((_STEP, inputs))
        return self._run(runner, inputs)

    def _run(self, runner: ModelRunner, inputs: StepInputs) -> torch.Tensor | None:
        error: Exception | None = None
        prepared = None
        try:
            prepared = runner.prepare(inputs)
        except Exception as exc:  # reported to every rank below; the driver raises it
            error = exc
        if not self._agree(error is None):
            if error is not None:
                raise error
            raise RuntimeError("another rank of the tensor-parallel group could not prepare the step")
        return runner.forward(prepared)

    def call(self, run: Callable[[Any], Any], message: Any) -> list[Any]:
        """The driver's `collective_rpc`: send `message` (method, args, kwargs) to every rank, run it here with `run`,
        and gather each rank's result in rank order; a rank's exception (or a result pickle cannot send back) comes
        back in its place, and the driver raises the first (RuntimeError naming the rank, the exception as its cause).
        A message pickle cannot send is a TypeError before anything is sent."""
        try:
            pickle.dumps(message)
        except Exception as error:
            raise TypeError(
                f"collective_rpc sends its method and arguments to every rank of a tensor-parallel engine, and pickle "
                f"cannot send them ({error}): pass a method name or a module-level function, and picklable arguments"
            ) from None
        self._broadcast((_CALL, message))
        return self._gather(run, message)

    def _gather(self, run: Callable[[Any], Any], message: Any) -> list[Any]:
        try:
            result = run(message)
            pickle.dumps(result)
        except Exception as error:  # sent to the driver in this rank's place
            result = error
            try:
                pickle.dumps(error)
            except Exception:  # an error pickle cannot send is sent as its text
                result = RuntimeError(f"{type(error).__name__}: {error}")
        results: list[Any] | None = [None] * self.size if self.driver else None
        torch.distributed.gather_object(result, results, dst=self._source, group=self.group)
        if results is None:
            return []
        for rank, result in enumerate(results):
            if isinstance(result, Exception):
                raise RuntimeError(f"collective_rpc failed on rank {rank}: {result}") from result
        return results

    def run_worker(self, runner: ModelRunner, call: Callable[[Any], Any]) -> None:
        """A worker's loop: run every step and every call (`call`: `collective_rpc`'s message) the driver sends until
        it stops."""
        while True:
            kind, inputs = self._broadcast(None)
            if kind == _STOP:
                return
            if kind == _CALL:
                self._gather(call, inputs)
                continue
            try:
                self._run(runner, inputs)
            except Exception:  # the driver fails the step's requests; this rank waits for the next one
                continue

    def stop(self) -> None:
        """The driver ends every worker's loop (once)."""
        if self.driver and not self.closed:
            self._broadcast((_STOP, None))
        self.closed = True
