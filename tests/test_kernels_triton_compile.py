"""Every Triton kernel variant compiles for a real CUDA target, without a GPU.

The interpreter accepts code that a GPU compiler rejects (tl.dot shapes, loop-carried types), so every
variant is compiled for sm_90 (and some for sm_80) through Triton's whole pipeline to PTX, where those
errors and the shared memory a program needs are found. The first variant of each kind (kernel, target,
cache dtype class, split or not) is also assembled to a cubin by the ptxas in the triton wheel, 20 of the 58:
ptxas takes a third of a variant's compile, and what it checks beyond Triton's own passes (valid PTX for the
target) varies with the kind far more than with a head dim or a flag. It
runs in a subprocess because TRITON_INTERPRET, set by conftest.py, would turn the kernels into
interpreted functions in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import product

import pytest
import torch

from hybridkv.kernels.triton_attention import launch_config
from hybridkv.kernels.triton_lora import launch_constexprs

# (kernel, pointer dtype, cache pointer dtype, constexprs, compute capability, num_warps / num_stages); the
# launch shapes and pipelining come from launch_config, so this compiles exactly what a GPU launch would.
Variant = tuple[str, str, str, dict, int, dict]
# The most shared memory one program may use: sm_80 (A100) and sm_90 (H100/H200) opt-in limits.
_SHARED_MEMORY_LIMIT = {80: 166_912, 90: 232_448}
_ELEMENT_SIZE = {"fp16": 2, "bf16": 2, "fp32": 4}
_CACHE_POINTERS = {"key_cache_ptr", "value_cache_ptr", "latent_cache_ptr", "rotary_cache_ptr"}
_FORMATS = {
    "fp8e4nv": {"FP8_MAX": 448.0, "FP8_MANTISSA_BITS": 3, "FP8_MIN_EXPONENT": -6, "ROUND_TO_BF16": False},
    "fp8e5": {"FP8_MAX": 57344.0, "FP8_MANTISSA_BITS": 2, "FP8_MIN_EXPONENT": -14, "ROUND_TO_BF16": False},
}
_PLAIN = {"FP8_MAX": 0.0, "FP8_MANTISSA_BITS": 0, "FP8_MIN_EXPONENT": 0, "ROUND_TO_BF16": False}


def _format(dtype: str, cache_dtype: str) -> dict:
    return _FORMATS.get(cache_dtype, {**_PLAIN, "ROUND_TO_BF16": cache_dtype == "bf16" and dtype == "fp32"})


_INT32_POINTERS = {
    "block_table_ptr",
    "seq_lens_ptr",
    "cu_seqlens_q_ptr",
    "tile_seq_ids_ptr",
    "tile_starts_ptr",
    "order_ptr",
    "tile_slots_ptr",
    "tile_rows_ptr",
}


def _attention_variant(
    dtype: str,
    head_dim: int,
    window: bool,
    softcap: bool,
    sinks: bool,
    queries_per_kv: int = 4,
    capability: int = 90,
    value_head_dim: int | None = None,
    chunk: bool = False,
    cache_dtype: str | None = None,
    in_flight: bool = True,
    segments: int = 1,
) -> Variant:
    cache_dtype = cache_dtype or dtype
    value_head_dim = value_head_dim or head_dim
    padded = 1 << (max(head_dim, value_head_dim) - 1).bit_length()
    config = launch_config(queries_per_kv, padded, _ELEMENT_SIZE[dtype], interpreted=False)
    constexprs = {
        "QUERIES_PER_KV": queries_per_kv,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PADDED": 1 << (head_dim - 1).bit_length(),
        "HEAD_DIM_V": value_head_dim,
        "HEAD_DIM_V_PADDED": 1 << (value_head_dim - 1).bit_length(),
        "BLOCK_SIZE": 16,
        "BLOCK_Q": config.block_q,
        "BLOCK_M": config.block_m,
        "TILE_N": config.tile_n,
        "USE_WINDOW": window,
        "USE_CHUNK": chunk,
        "USE_SOFTCAP": softcap,
        "USE_SINKS": sinks,
        "IN_FLIGHT": in_flight,
        **_format(dtype, cache_dtype),
        "UPCAST": cache_dtype != dtype and not cache_dtype.startswith("fp8"),
        "NUM_SEGMENTS": segments,
    }
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return ("attention", dtype, cache_dtype, constexprs, capability, options)


def _reduce_variant(dtype: str, value_head_dim: int, segments: int, capability: int = 90) -> Variant:
    """Split-KV decode's reduce: the segments' partial softmaxes (fp32) into the output's dtype."""
    constexprs = {
        "HEAD_DIM_V": value_head_dim,
        "HEAD_DIM_V_PADDED": 1 << (value_head_dim - 1).bit_length(),
        "NUM_SEGMENTS": segments,
    }
    return ("reduce", dtype, dtype, constexprs, capability, {})


def _write_variant(
    dtype: str,
    head_dim: int,
    num_kv_heads: int = 4,
    value_head_dim: int | None = None,
    cache_dtype: str | None = None,
    capability: int = 90,
) -> Variant:
    value_head_dim = value_head_dim or head_dim
    cache_dtype = cache_dtype or dtype
    constexprs = {
        "NUM_KV_HEADS": num_kv_heads,
        "NUM_KV_HEADS_PADDED": 1 << (num_kv_heads - 1).bit_length(),
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PADDED": 1 << (head_dim - 1).bit_length(),
        "HEAD_DIM_V": value_head_dim,
        "HEAD_DIM_V_PADDED": 1 << (value_head_dim - 1).bit_length(),
        "BLOCK_SIZE": 16,
        **_format(dtype, cache_dtype),
    }
    return ("write", dtype, cache_dtype, constexprs, capability, {})


def _latent_variant(
    dtype: str, latent: int, rotary: int, cache_dtype: str | None = None, capability: int = 90
) -> Variant:
    """Latent attention's decode kernel (hybridkv/kernels/triton_latent.py), as `triton_latent_decode` launches it."""
    latent_padded = 1 << (latent - 1).bit_length()
    constexprs = {
        "LATENT": latent,
        "LATENT_PADDED": latent_padded,
        "ROTARY": rotary,
        "ROTARY_PADDED": max(16, 1 << (rotary - 1).bit_length()),
        "BLOCK_SIZE": 16,
        "BLOCK_H": 16,
        "TILE_N": 16 if latent_padded >= 256 else 32,
    }
    return ("latent", dtype, cache_dtype or dtype, constexprs, capability, {"num_warps": 4, "num_stages": 1})


def _lora_variant(kernel: str, dtype: str, rank: int, capability: int = 90) -> Variant:
    """LoRA's shrink or expand (hybridkv/kernels/triton_lora.py), as a GPU launch for that rank passes it."""
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    constexprs = launch_constexprs(kernel, rank, torch_dtype, torch_dtype, interpreted=False)
    return (kernel, dtype, dtype, constexprs, capability, {})


def _variants() -> list[Variant]:
    flags = list(product([False, True], repeat=3))
    variants = [_attention_variant("bf16", 128, *combination) for combination in flags]
    variants += [
        _attention_variant(dtype, head_dim, True, True, True)
        for dtype, head_dim in product(["fp16", "bf16", "fp32"], [64, 128, 256])
        if (dtype, head_dim) != ("bf16", 128)
    ]
    variants += [
        _attention_variant("fp16", 96, False, False, False),
        _attention_variant("fp16", 128, False, False, False, queries_per_kv=1),
        _attention_variant("fp16", 128, True, False, False, queries_per_kv=32),
        _attention_variant("bf16", 128, True, True, True, capability=80),
        _attention_variant("bf16", 192, True, False, False, value_head_dim=128),  # K and V head dims differ
        _attention_variant("bf16", 512, False, False, False, queries_per_kv=8),  # Gemma 4's full layers
        _attention_variant("bf16", 128, False, False, False, queries_per_kv=5, chunk=True),  # Llama 4
        _attention_variant("bf16", 128, True, True, True, in_flight=False),  # every key read from the cache
        # Caches of another dtype than the model: fp8 (e4m3 from sm_89, e5m2 on sm_80 too) and 16/32-bit.
        _attention_variant("bf16", 128, True, False, False, cache_dtype="fp8e4nv"),
        _attention_variant("fp16", 256, False, True, True, cache_dtype="fp8e4nv"),
        _attention_variant("bf16", 128, True, False, False, cache_dtype="fp8e5", capability=80),
        _attention_variant("fp32", 64, True, False, False, cache_dtype="bf16"),
        _attention_variant("bf16", 64, False, False, False, cache_dtype="fp32"),
        # Split-KV decode (segments per sequence), as split_segments picks them: Gemma-3-1B's heads at 64 running,
        # Llama's with sinks, fp8 pages, the largest count, an A100.
        _attention_variant("bf16", 256, True, True, False, segments=8),
        _attention_variant("bf16", 64, False, False, True, segments=4),
        _attention_variant("fp16", 128, True, False, False, cache_dtype="fp8e4nv", segments=2),
        _attention_variant("fp32", 128, False, False, False, queries_per_kv=1, segments=16),
        _attention_variant("bf16", 128, True, False, False, capability=80, segments=8),
    ]
    variants += [
        _reduce_variant(dtype, value_head_dim, segments)
        for dtype, value_head_dim, segments in [("bf16", 256, 8), ("fp16", 128, 2), ("fp32", 96, 16), ("bf16", 64, 4)]
    ]
    variants.append(_reduce_variant("bf16", 128, 8, capability=80))
    variants += [_write_variant(dtype, head_dim) for dtype, head_dim in [("fp16", 64), ("bf16", 128), ("fp32", 256)]]
    variants.append(_write_variant("bf16", 96, num_kv_heads=3))
    variants.append(_write_variant("bf16", 192, value_head_dim=128))
    # Latent attention's decode: DeepSeek V2/V3's latent 512 + rotary 64 (an H100/H200 and an A100), MiniCPM3's
    # 256 + 32 in fp16, an fp32 model on bf16 pages.
    variants += [
        _latent_variant("bf16", 512, 64),
        _latent_variant("bf16", 512, 64, capability=80),
        _latent_variant("fp16", 256, 32),
        _latent_variant("fp32", 512, 64, cache_dtype="bf16"),
    ]
    variants += [
        _write_variant("bf16", 128, cache_dtype="fp8e4nv"),
        _write_variant("fp32", 64, cache_dtype="fp8e5", capability=80),
        _write_variant("fp32", 64, cache_dtype="bf16"),
    ]
    # LoRA: ranks 8 to 128 (one rank tile, padded to 16, up to two), bf16 and fp32 (its IEEE dots), an A100's shrink
    # (fp16 compiles as bf16 does: the interpreter's tests cover its arithmetic).
    variants += [
        _lora_variant(kernel, dtype, rank)
        for kernel in ("shrink", "expand")
        for dtype, rank in [("bf16", 16), ("fp32", 8), ("bf16", 128)]
    ]
    variants += [_lora_variant("shrink", "bf16", 32, capability=80)]
    return variants


def _assembled(variants: list[Variant]) -> list[bool]:
    """Whether each variant is assembled to a cubin: the first of its kind (kernel, target, cache dtype class, split
    decode or not)."""
    seen, assembled = set(), []
    for name, dtype, cache_dtype, constexprs, capability, _ in variants:
        cache_class = cache_dtype if cache_dtype.startswith("fp8") else "plain" if cache_dtype == dtype else "other"
        kind = (name, capability, cache_class, constexprs.get("NUM_SEGMENTS", 1) > 1)
        assembled.append(kind not in seen)
        seen.add(kind)
    return assembled


def _signature(kernel, dtype: str, cache_dtype: str) -> dict[str, str]:
    signature = {}
    for name in kernel.arg_names:
        if name in _INT32_POINTERS:
            signature[name] = "*i32"
        elif name == "slot_mapping_ptr":
            signature[name] = "*i64"
        elif name in ("partial_ptr", "stats_ptr"):  # split-KV decode's fp32 scratch
            signature[name] = "*fp32"
        elif name in _CACHE_POINTERS:
            signature[name] = f"*{cache_dtype}"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        elif name in ("scale", "softcap", "k_scale", "v_scale", "scale_log2"):
            signature[name] = "fp32"
        elif name.isupper():
            signature[name] = "constexpr"
        else:
            signature[name] = "i32"
    return signature


def _compile_all(variants: list[Variant], assembled: list[bool]) -> list[str]:
    """Compile each variant, to a cubin where `assembled` says so and to PTX otherwise; return one error line per
    failure (run in the subprocess)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    from hybridkv.kernels.triton_attention import paged_attention_kernel, reduce_segments_kernel
    from hybridkv.kernels.triton_cache_write import write_kv_kernel
    from hybridkv.kernels.triton_latent import latent_decode_kernel
    from hybridkv.kernels.triton_lora import lora_expand_kernel, lora_shrink_kernel

    add_stages = CUDABackend.add_stages
    to_ptx = {"assemble": True}

    def stages(self, stages, options, language):
        add_stages(self, stages, options, language)
        if not to_ptx["assemble"]:
            stages["cubin"] = lambda ptx, metadata: b""  # no ptxas: the kernel is never launched here

    CUDABackend.add_stages = stages
    kernels = {
        "attention": paged_attention_kernel,
        "write": write_kv_kernel,
        "reduce": reduce_segments_kernel,
        "latent": latent_decode_kernel,
        "shrink": lora_shrink_kernel,
        "expand": lora_expand_kernel,
    }
    failures = []
    for (name, dtype, cache_dtype, constexprs, capability, options), assemble in zip(variants, assembled, strict=True):
        kernel = kernels[name]
        source = ASTSource(fn=kernel, signature=_signature(kernel, dtype, cache_dtype), constexprs=constexprs)
        to_ptx["assemble"] = assemble
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
            if not compiled.asm.get("ptx") or (assemble and not compiled.asm.get("cubin")):
                failures.append(f"{name} {dtype}/{cache_dtype} sm_{capability} {constexprs}: no PTX or cubin")
            elif compiled.metadata.shared > _SHARED_MEMORY_LIMIT[capability]:
                failures.append(
                    f"{name} {dtype}/{cache_dtype} sm_{capability} {constexprs} {options}: "
                    f"{compiled.metadata.shared} bytes of shared memory, over the device's limit"
                )
        except Exception as error:
            failures.append(
                f"{name} {dtype}/{cache_dtype} sm_{capability} {constexprs}: {type(error).__name__}: {error}"
            )
    return failures


def _refused_variants() -> list[Variant]:
    """Variants Triton must refuse: the reason `check_fp8_device` sends e4m3 users of older GPUs to e5m2."""
    return [_attention_variant("bf16", 128, True, False, False, cache_dtype="fp8e4nv", capability=80)]


# The variants in this many parts, one test each, so that test workers compile them side by side (one part took
# about 100 s alone, the suite's last test to finish).
PARTS = 4


@pytest.mark.slow
@pytest.mark.parametrize("part", range(PARTS))
def test_every_kernel_variant_compiles_for_cuda(tmp_path, part):
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["TRITON_DEFAULT_FP_FUSION"] = "1"
    # A fresh cache: a hit from an earlier run would skip the compile this test exists to run.
    environment["TRITON_CACHE_DIR"] = str(tmp_path)
    refused = _refused_variants() if part == 0 else []
    variants = _variants()
    assert sum(_assembled(variants)) >= 12  # every kind assembled once: both targets, each kernel, fp8, split
    part_variants = variants[part::PARTS]
    part_assembled = _assembled(variants)[part::PARTS]
    result = subprocess.run(
        [sys.executable, __file__, json.dumps([part_variants, part_assembled]), json.dumps(refused)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    failures, refusals = json.loads(result.stdout.strip().splitlines()[-1])
    assert failures == []
    assert len(refusals) == len(refused)
    assert all("fp8e4nv not supported in this architecture" in refusal for refusal in refusals), refusals


if __name__ == "__main__":
    variants, assembled = json.loads(sys.argv[1])
    compiled = _compile_all([tuple(variant) for variant in variants], assembled)
    refused_variants = [tuple(variant) for variant in json.loads(sys.argv[2])]
    refused = _compile_all(refused_variants, [True] * len(refused_variants))
    print(json.dumps([compiled, refused]))
