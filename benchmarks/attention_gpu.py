"""GPU attention: hybridkv's Triton kernels against torch SDPA over a padded dense cache, on CUDA.

The same steps as benchmarks/attention_cpu.py (decode of 32 sequences over 100..2,000 tokens, a
long-tail decode, 4 prefill chunks of 256 + 28 decodes), in bf16 by default, timed with CUDA events;
also the cache write, and split-KV decode at 64 x 2,048 tokens (kernel time against a device copy). Exits
with a message when no CUDA GPU is present. ``--smoke`` runs tiny
shapes once, and works on CPU under TRITON_INTERPRET=1 (to check this script without a GPU).

    .venv/bin/python benchmarks/attention_gpu.py [--dtype float16] [--repeats 50]
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
from collections.abc import Callable

import torch

from hybridkv.kernels import paged_attention, write_kv

from attention_cpu import HEAD_DIM, NUM_KV_HEADS, SCALE, dense_inputs, dense_rows, hf_dense_sdpa, make_step


def time_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def to_device(step, device: torch.device):
    for name in ("query", "key_cache", "value_cache", "dense_keys", "dense_values"):
        setattr(step, name, getattr(step, name).to(device))
    metadata = step.metadata
    step.metadata = type(metadata).build(
        metadata.query_lens_list,
        metadata.seq_lens_list,
        metadata.block_table_rows,
        metadata.block_size,
        device,
    )
    return step


def run_step(name: str, step, query_rows: int, repeats: int, device: torch.device) -> float:
    """Print the step's timings; return the paged kernel's milliseconds."""
    paged = lambda: paged_attention(  # noqa: E731
        step.query, step.key_cache, step.value_cache, step.metadata, scale=SCALE, backend="triton"
    )
    dense_query, dense_mask = (tensor.to(device) for tensor in dense_inputs(step, query_rows))
    dense = lambda: hf_dense_sdpa(step, dense_query, dense_mask)  # noqa: E731
    error = (paged().float() - dense_rows(step, dense()).float()).abs().max().item()
    paged_ms = time_ms(paged, repeats, device)
    dense_ms = time_ms(dense, repeats, device)
    print(f"\n{name}: {step.metadata.num_seqs} sequences, {step.metadata.num_query_tokens} query rows")
    print(f"  hybridkv Triton                 {paged_ms:8.3f} ms")
    print(f"  torch sdpa, padded dense        {dense_ms:8.3f} ms   (max |diff| {error:.1e})")
    print(f"  ratio dense / paged             {dense_ms / paged_ms:8.2f}x")

    slots = step.metadata.slot_mapping
    new_keys = torch.randn(slots.numel(), *step.key_cache.shape[2:], device=device)  # [tokens, kv heads, dim]
    new_keys = new_keys.to(step.key_cache.dtype)
    write = lambda: write_kv(new_keys, new_keys, step.key_cache, step.value_cache, slots, backend="triton")  # noqa: E731
    print(f"  cache write of {slots.numel()} tokens      {time_ms(write, repeats, device):8.3f} ms")
    return paged_ms


def bandwidth(dtype: torch.dtype, repeats: int, device: torch.device) -> None:
    """Decode of 64 sequences of 2,048 tokens: the K/V bytes the kernel reads per millisecond, against a
    device-to-device copy's bytes read and written (the device's measured memory bandwidth)."""
    step = to_device(make_step([1] * 64, [2048] * 64, dtype), device)
    paged_ms = run_step("decode, batch 64 x 2,048 tokens", step, 1, repeats, device)
    kv_bytes = 2 * 64 * 2048 * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_ms = time_ms(lambda: target.copy_(source), repeats, device)
    copy_gbs = 2 * source.numel() / copy_ms / 1e6
    kernel_gbs = kv_bytes / paged_ms / 1e6
    print(f"  K/V read                        {kernel_gbs:8.0f} GB/s")
    print(f"  device copy (read + write)      {copy_gbs:8.0f} GB/s")
    print(f"  kernel / copy bandwidth         {kernel_gbs / copy_gbs:8.2f}")


def split_decode(dtype: torch.dtype, repeats: int, device: torch.device) -> None:
    """Decode of 64 sequences of 2,048 tokens in the Gemma-3-1B and Llama-3.2-1B heads' shapes (4 q / 1 KV head of
    256; 32 q / 8 KV heads of 64): kernel time from the profiler (the attention kernel and the split's reduce, not
    the launch-bound wall) unsplit and split as `split_segments` chooses, as a share of a device copy's bandwidth
    (issue 47: at least 0.6)."""
    from torch.profiler import ProfilerActivity, profile

    from hybridkv.kernels import PagedAttentionMetadata
    from hybridkv.kernels.triton_attention import _num_sms, split_segments, triton_paged_attention

    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_gbs = 2 * source.numel() / time_ms(lambda: target.copy_(source), repeats, device) / 1e6
    num_seqs, seq_len, block_size = 64, 2048, 16
    for name, q_heads, kv_heads, head_dim in (("Gemma-3-1B heads", 4, 1, 256), ("Llama-3.2-1B heads", 32, 8, 64)):
        blocks_per_seq = seq_len // block_size
        num_blocks = num_seqs * blocks_per_seq + 1
        ids = torch.randperm(num_blocks - 1).add(1).view(num_seqs, blocks_per_seq).tolist()
        key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device).to(dtype)
        value_cache = torch.randn_like(key_cache)
        query = torch.randn(num_seqs, q_heads, head_dim, device=device).to(dtype)
        metadata = PagedAttentionMetadata.build([1] * num_seqs, [seq_len] * num_seqs, ids, block_size, device)
        kv_bytes = 2 * num_seqs * seq_len * kv_heads * head_dim * dtype.itemsize
        chosen = split_segments(num_seqs, num_seqs, kv_heads, _num_sms(device.index or 0))
        print(f"\n{name}: decode 64 x 2,048 tokens, {kv_bytes / 1e6:.0f} MB of K/V; device copy {copy_gbs:.0f} GB/s")
        for segments in sorted({1, chosen}):
            call = functools.partial(
                triton_paged_attention, query, key_cache, value_cache, metadata, head_dim**-0.5, None, None, None,
                num_segments=segments,
            )  # fmt: skip
            wall = time_ms(call, repeats, device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(repeats):
                    call()
                torch.cuda.synchronize()
            kernel_us = sum(
                e.self_device_time_total
                for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA
                and ("paged_attention_kernel" in e.name or "reduce_segments_kernel" in e.name)
            )
            kernel_ms = kernel_us / 1e3 / repeats
            share = kv_bytes / kernel_ms / 1e6 / copy_gbs
            print(
                f"  {segments:2d} segment(s): kernels {kernel_ms * 1e3:7.1f} us (wall {wall * 1e3:7.1f} us), "
                f"{kv_bytes / kernel_ms / 1e6:6.0f} GB/s = {share:.2f} of the copy's"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one call each (CPU: TRITON_INTERPRET=1)")
    args = parser.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.smoke and os.environ.get("TRITON_INTERPRET") == "1":
        device = torch.device("cpu")
    else:
        sys.exit(
            "attention_gpu.py needs a CUDA GPU and none is present; run benchmarks/attention_cpu.py for the "
            "CPU path (or --smoke with TRITON_INTERPRET=1 to check this script)"
        )
    dtype = getattr(torch, args.dtype)
    repeats = 1 if args.smoke else args.repeats
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (interpreter)'}, {args.dtype}")

    rng = random.Random(0)
    if args.smoke:
        steps = [("smoke decode", [1, 1, 1], [20, 70, 33], 1), ("smoke mixed", [1, 24, 1], [40, 50, 9], 24)]
    else:
        decode_lens = [100 + (1900 * i) // 31 for i in range(32)]
        rng.shuffle(decode_lens)
        mixed_decode_lens = [100 + (1900 * i) // 27 for i in range(28)]
        rng.shuffle(mixed_decode_lens)
        steps = [
            ("decode", [1] * 32, decode_lens, 1),
            ("decode, long tail (31 x 200 + 1 x 4,000)", [1] * 32, [200] * 31 + [4000], 1),
            ("mixed", [256] * 4 + [1] * 28, [256, 512, 768, 1280, *mixed_decode_lens], 256),
        ]
    for name, query_lens, seq_lens, query_rows in steps:
        step = to_device(make_step(query_lens, seq_lens, dtype), device)
        run_step(name, step, query_rows, repeats, device)
    if not args.smoke:
        bandwidth(dtype, repeats, device)
        split_decode(dtype, repeats, device)


if __name__ == "__main__":
    main()
