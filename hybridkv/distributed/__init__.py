"""vLLM's `vllm.distributed` path: `cleanup_dist_env_and_memory`, which vLLM's scripts call between engines."""

from __future__ import annotations

import gc

import torch


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's: end this process's torch.distributed group if one was started, collect garbage (an engine dropped or
    unpatched frees its KV cache then) and give the GPU's cached memory back. `shutdown_ray` changes nothing: hybridkv
    uses no Ray."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


__all__ = ["cleanup_dist_env_and_memory"]
