"""CUDA graphs of decode steps: a decode step's forward captured once per bucket size, then replayed.

On a GPU a decode step of a small model is hundreds of small kernels launched one by one from Python
(transformers' layers: norms, projections, rotary embeddings, activations), and the host's launches,
not the GPU, set the step's time. A CUDA graph records the launches of one forward and replays them
in one call. A graph replays the same kernels over the same addresses, so what a decode step reads
lives at fixed addresses (the step buffers, hybridkv/kernels/step_buffers.py; the pages; the weights),
and a step of n sequences runs in the graph of the smallest bucket >= n, its extra rows padding:
a sequence of one token at position 0 whose block table is all null, which stores nothing (slot -1),
attends to its own key only, and whose logits are never sampled.

Buckets follow vLLM's capture sizes: 1, 2, 4, 8, then steps of 8 up to 32, 16 up to 128, 32 up to 256 and
64 beyond, up to `max_num_seqs`. Steps with prefill rows run eagerly. The graphs share one memory pool,
captured largest first; their memory is counted before the KV pool is sized (hybridkv/execution/sizing.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from hybridkv.execution.progress import progress_bar
from hybridkv.patches.attention import StepContext, running_step

logger = logging.getLogger("hybridkv")


def captures_graphs(model: torch.nn.Module) -> bool:
    """Whether graph mode captures CUDA graphs for this model: every weight on one CUDA device, no offload
    hooks, no tensor parallel (elsewhere graph mode runs the padded steps eagerly)."""
    devices = {p.device for p in model.parameters()}
    return (
        len(devices) == 1
        and next(iter(devices)).type == "cuda"
        and not any(hasattr(m, "_hf_hook") for m in model.modules())
        and (getattr(model, "_tp_size", None) or 1) == 1
    )


def graph_mode(model: torch.nn.Module, enforce_eager: bool | None) -> bool:
    """`enforce_eager` False: graph mode; True: eager; None: graph mode where CUDA graphs are captured."""
    return captures_graphs(model) if enforce_eager is None else not enforce_eager


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The decode step sizes graph mode pads to, up to `max_num_seqs` (always included)."""
    sizes = [1, 2, 4, *range(8, 33, 8), *range(48, 129, 16), *range(160, 257, 32), *range(320, max_num_seqs, 64)]
    return (*(size for size in sizes if size < max_num_seqs), max_num_seqs)


class CapturedStep:
    """One bucket's graph and the logits tensor its replay writes (`[bucket, vocab]`)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor) -> None:
        self.graph = graph
        self.logits = logits

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


class DecodeGraphs:
    """The runner's captured decode steps, one per bucket. `padded_step(bucket)` gives a step of `bucket` padding
    rows (its context, with the step's metadata set, and the forward's inputs: `ModelRunner._padded_step`), which
    `forward` runs; neither is the runner's own, so this module imports none of it."""

    def __init__(
        self,
        buckets: tuple[int, ...],
        padded_step: Callable[[int], tuple[StepContext, tuple[torch.Tensor, ...]]],
        forward: Callable[..., torch.Tensor],
        device: torch.device,
        use_tqdm: bool,
    ) -> None:
        self.buckets = buckets
        self._padded_step, self._forward, self._device, self._use_tqdm = padded_step, forward, device, use_tqdm
        self.graphs: dict[int, CapturedStep] = {}

    def get(self, bucket: int) -> CapturedStep | None:
        return self.graphs.get(bucket)

    def capture(self) -> None:
        """Capture every bucket, largest first, over a step of padding rows only (which writes nothing)."""
        forward = self._forward
        pool = None
        start = time.perf_counter()
        bar = progress_bar(len(self.buckets), self._use_tqdm, desc="hybridkv: capturing", unit="graph")
        for bucket in sorted(self.buckets, reverse=True):
            context, inputs = self._padded_step(bucket)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode(), running_step(context):
                for _ in range(2):  # compiles Triton kernels (and the model, when compiled) outside the graph
                    forward(*inputs)
                    context.store_deferred(list(context.deferred))
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # A step's forward that synchronises with the host cannot be replayed: make any such call an error.
            with (
                sync_is_an_error(),
                torch.inference_mode(),
                running_step(context),
                torch.cuda.graph(graph, pool=pool),
            ):
                logits = forward(*inputs)
                context.store_deferred(list(context.deferred))
            pool = graph.pool()
            self.graphs[bucket] = CapturedStep(graph, logits)
            bar.update(1)
        bar.close()
        torch.cuda.synchronize(self._device)
        logger.info("hybridkv: captured %d CUDA graphs in %.1f s", len(self.graphs), time.perf_counter() - start)


@contextlib.contextmanager
def sync_is_an_error() -> Iterator[None]:
    """Within: a CUDA call that synchronises with the host raises (torch.cuda.set_sync_debug_mode("error"),
    which sets a process-wide mode: restored on the way out, also on an error)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def padding_arrays(bucket: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """query lengths, sequence lengths and positions of a step of `bucket` padding rows."""
    ones = np.ones(bucket, dtype=np.int64)
    return ones, ones, np.zeros(bucket, dtype=np.int64)
