"""Backend choice: the Triton kernels for CUDA tensors, the torch path for everything else."""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["torch", "triton"]


def resolve_backend(backend: str | None, device: torch.device) -> Backend:
    """``backend`` if given, else "triton" for CUDA tensors and "torch" for everything else.

    Triton on a non-CUDA device needs the interpreter (``TRITON_INTERPRET=1`` set before
    ``hybridkv.kernels`` runs its first Triton call); anything else raises a ValueError naming the fix.
    """
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return "torch"
    if backend != "triton":
        raise ValueError(f"backend must be 'torch', 'triton' or None, got {backend!r}")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' on a {device.type} tensor needs the Triton interpreter: "
            "set TRITON_INTERPRET=1 before importing hybridkv.kernels, or use backend='torch'"
        )
    return "triton"
