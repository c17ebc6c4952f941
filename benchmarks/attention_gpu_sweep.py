"""The Triton attention kernel's launch configuration, swept on a GPU: key-tile size x warps x pipeline
stages, kernel time from torch's profiler (launch overhead excluded), on the attention_cpu shapes (16 q
heads, 4 kv heads of 64, block size 16), bf16 and fp32. The decodes of 2,048-token sequences also print
the K/V bytes read per second as a share of a device-to-device copy's (bytes read and written). This is
how `hybridkv/kernels/triton_attention.launch_config` was chosen (docs/kernels.md); every configuration's output is
checked against the current choice's.

    python benchmarks/attention_gpu_sweep.py
"""

from __future__ import annotations

import random
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import hybridkv.kernels.triton_attention as triton_attention
from hybridkv.kernels import paged_attention

from attention_cpu import HEAD_DIM, NUM_KV_HEADS, SCALE, make_step
from attention_gpu import to_device

CONFIGS = [(32, 4, 3), (64, 2, 1), (64, 4, 2), (128, 2, 3), (128, 4, 2), (128, 4, 3), (128, 8, 1), (128, 8, 2)]


def steps() -> dict[str, tuple[list[int], list[int]]]:
    rng = random.Random(0)
    decode_lens = [100 + (1900 * i) // 31 for i in range(32)]
    rng.shuffle(decode_lens)
    mixed_lens = [100 + (1900 * i) // 27 for i in range(28)]
    rng.shuffle(mixed_lens)
    return {
        "decode 64 x 2k": ([1] * 64, [2048] * 64),
        "decode 256 x 2k": ([1] * 256, [2048] * 256),
        "decode 32 spread": ([1] * 32, decode_lens),
        "mixed": ([256] * 4 + [1] * 28, [256, 512, 768, 1280, *mixed_lens]),
        "prefill 4 x 2k": ([2048] * 4, [2048] * 4),
    }


def kernel_us(fn, name: str) -> float:
    """Mean device time of the kernels whose name contains `name`, over 20 calls."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    events = [event for event in prof.key_averages() if name in event.key]
    return sum(event.device_time_total for event in events) / max(1, sum(event.count for event in events))


class _WithOptions:
    """The kernel, launched with the sweep's num_warps / num_stages in place of the chosen ones."""

    def __init__(self, kernel) -> None:
        self.kernel, self.options = kernel, {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **{**kwargs, **self.options})


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("attention_gpu_sweep.py needs a CUDA GPU")
    device = torch.device("cuda")
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_gbs = 2 * source.numel() / kernel_us(lambda: target.copy_(source), "Memcpy") / 1e3
    print(f"{torch.cuda.get_device_name()}: device copy {copy_gbs:.0f} GB/s (read + write)")
    chosen = triton_attention.launch_config
    launch = _WithOptions(triton_attention.paged_attention_kernel)
    for dtype in (torch.bfloat16, torch.float32):
        built = {name: to_device(make_step(q, s, dtype), device) for name, (q, s) in steps().items()}
        attend = {
            name: (lambda step=step: paged_attention(
                step.query, step.key_cache, step.value_cache, step.metadata, scale=SCALE, backend="triton"
            ))
            for name, step in built.items()
        }  # fmt: skip
        expected = {name: fn() for name, fn in attend.items()}
        triton_attention.paged_attention_kernel = launch
        for tile_n, warps, stages in CONFIGS:
            triton_attention.launch_config = lambda *args, t=tile_n: chosen(*args)._replace(tile_n=t)
            launch.options = {"num_warps": warps, "num_stages": stages}
            line = f"{str(dtype).removeprefix('torch.'):<9} tile {tile_n:3d} warps {warps} stages {stages}:"
            for name, fn in attend.items():
                error = (fn().float() - expected[name].float()).abs().max().item()
                us = kernel_us(fn, "paged_attention_kernel")
                line += f"  {name} {us:7.1f} us"
                if name.endswith("x 2k"):
                    num_seqs = built[name].metadata.num_seqs
                    kv_bytes = 2 * num_seqs * 2048 * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
                    line += f" ({kv_bytes / us / 1e3 / copy_gbs:.2f})"
                if error > (2e-2 if dtype == torch.bfloat16 else 1e-5):
                    line += f" DIFFERS {error:.1e}"
            print(line, flush=True)
        triton_attention.launch_config = chosen


if __name__ == "__main__":
    main()
