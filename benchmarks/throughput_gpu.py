"""GPU end-to-end throughput: hybridkv vs transformers' generate_batch and generate (padded; static cache and
torch.compile), on CUDA.

Models shaped as published (random bf16 weights, no download): Gemma-3-1B (26 layers, 5 sliding-window
512 : 1 full, 1 KV head of 256, vocab 262,144) and Llama-3.2-1B (16 layers, 8 KV heads of 64, vocab
128,256). Workloads: "mixed", 256 requests of 64..1,024 prompt tokens (seeded), 128 new tokens each;
"shared", 256 requests sharing a 2,048-token system prompt plus 16..64 unique tokens, 64 new tokens.
Greedy, no EOS. Every system first runs 8 of the requests untimed (Triton and torch.compile compile, cuBLAS
warms up, hybridkv patches: its checks, the profiling forward, the pool and its CUDA graphs), then the whole
workload timed: what a server that is up does. generate_batch builds its manager (and graphs) in every call, so
its set-up is inside the timed region; the warm-up's seconds are printed for every system.
The systems (`--systems`):
  generate             padded batches of 64, DynamicCache
  generate_static      padded batches of 64, every batch padded to the longest prompt, static cache and
                       transformers' compile_config (inductor, mode reduce-overhead: its own CUDA graphs);
                       warmed up on a whole batch of that shape, so nothing recompiles when timed
  generate_batch       transformers' continuous batching with its defaults
  generate_batch_l1/2  ... with ContinuousBatchingConfig(use_cuda_graph=True, default_compile_level=1 or 2)
  hybridkv             defaults (on one GPU: the compiled forward, hybridkv/execution/compilation.py, and
                       decode steps as CUDA graphs over it), max_num_seqs 128; its warm-up compiles unless
                       the disk cache has the program (`HYBRIDKV_CACHE_DIR`)
  hybridkv_nocompile   compile=False: eager kernels, decode steps as CUDA graphs
  hybridkv_sync        async_scheduling=False: the host waits for each step's tokens before planning the next
  hybridkv_eager       enforce_eager=True, compile=False: every step launched from Python
  hybridkv_compiled    compile=True (what the defaults do on one GPU)
bf16 greedy tokens can differ between systems after a near tie; for every pair of systems the share of
requests whose tokens are equal, and the mean first differing position, are printed.

    python benchmarks/throughput_gpu.py [--models gemma3,llama] [--workloads mixed,shared] [--requests 256]
                                        [--systems generate,generate_batch,hybridkv]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import random
import sys
import time

import torch
import transformers
from transformers import CompileConfig, ContinuousBatchingConfig, GenerationConfig

import hybridkv
from hybridkv import SamplingParams

from throughput import agreement


def gemma3_1b() -> transformers.PreTrainedModel:
    config = transformers.Gemma3TextConfig(
        vocab_size=262_144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=32_768,
        query_pre_attn_scalar=256, layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                                for i in range(26)],
    )  # fmt: skip
    return _build(transformers.Gemma3ForCausalLM, config)


def llama_1b() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131_072, tie_word_embeddings=True,
    )  # fmt: skip
    return _build(transformers.LlamaForCausalLM, config)


def _build(model_cls, config) -> transformers.PreTrainedModel:
    for field in ("pad_token_id", "bos_token_id", "eos_token_id"):
        object.__setattr__(config, field, None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_cls(config).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


MODELS = {"gemma3": gemma3_1b, "llama": llama_1b}


def workload(name: str, count: int, vocab: int) -> tuple[list[list[int]], int]:
    rng = random.Random(0)
    if name == "mixed":
        return [[rng.randrange(1, vocab) for _ in range(rng.randint(64, 1024))] for _ in range(count)], 128
    system = [rng.randrange(1, vocab) for _ in range(2048)]
    return [system + [rng.randrange(1, vocab) for _ in range(rng.randint(16, 64))] for _ in range(count)], 64


def run_generate(model, prompts, max_new, static=False, width=None):
    """transformers' generate on left-padded batches of 64 (one batch of 256 x 1,152 positions' logits and
    activations is what a user would split); `static`: a static cache and transformers' compile_config, every
    batch padded to `width` (the longest prompt of the workload) so that one compiled shape serves them all."""
    tokens = []
    extra = {}
    if static:
        extra = dict(cache_implementation="static", compile_config=CompileConfig())
    torch.cuda.synchronize()
    start = time.perf_counter()
    for first in range(0, len(prompts), 64):
        batch = prompts[first : first + 64]
        pad_to = width or max(len(p) for p in batch)
        ids = torch.tensor([[0] * (pad_to - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor([[0] * (pad_to - len(p)) + [1] * len(p) for p in batch], device="cuda")
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                **extra,
            )
        tokens += [row[pad_to:].tolist() for row in out]
    torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def run_generate_batch(model, prompts, max_new, level=None):
    config = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, eos_token_id=None)
    batching = None
    if level is not None:
        batching = ContinuousBatchingConfig(use_cuda_graph=True, default_compile_level=level)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=config, continuous_batching_config=batching)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ordered = sorted(outputs.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
    return seconds, [o.generated_tokens for o in ordered]


def run_hybridkv(model, prompts, max_new, **settings):
    """The warm-up's call patches (the checks, the profiling forward, the pool, the CUDA graphs: its time is the
    warm-up's), as a server patches once and then serves; the timed call finds the model patched with the same
    settings, and patch returns its engine at once. main unpatches after the timed call."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm = hybridkv.patch(model, max_model_len=4096, max_num_seqs=128, **settings)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new), use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return seconds, [o.outputs[0].token_ids for o in outputs], llm.stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gemma3,llama")
    parser.add_argument("--workloads", default="mixed,shared")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--systems", default="generate,generate_batch,hybridkv")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("throughput_gpu.py needs a CUDA GPU; benchmarks/throughput.py is the CPU comparison")
    systems = args.systems.split(",")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
    for model_name in args.models.split(","):
        model = MODELS[model_name]()
        for workload_name in args.workloads.split(","):
            prompts, max_new = workload(workload_name, args.requests, model.config.vocab_size)
            generated = len(prompts) * max_new
            width = max(len(p) for p in prompts)
            runners = {
                "generate": run_generate,
                "generate_static": functools.partial(run_generate, static=True, width=width),
                "generate_batch": run_generate_batch,
                "generate_batch_l1": functools.partial(run_generate_batch, level=1),
                "generate_batch_l2": functools.partial(run_generate_batch, level=2),
                "hybridkv": run_hybridkv,
                "hybridkv_nocompile": functools.partial(run_hybridkv, compile=False),
                "hybridkv_sync": functools.partial(run_hybridkv, async_scheduling=False),
                "hybridkv_eager": functools.partial(run_hybridkv, enforce_eager=True, compile=False),
                "hybridkv_compiled": functools.partial(run_hybridkv, compile=True),
            }
            results = {}
            for name in systems:
                start = time.perf_counter()
                # Warm-up, untimed; the static cache's compiled shape is a whole batch's. Reversed prompts: the
                # same lengths, and nothing the timed run could find in hybridkv's prefix cache.
                warm = [p[::-1] for p in (prompts[:64] if name == "generate_static" else prompts[:8])]
                runners[name](model, warm, max_new if name == "generate_static" else 8)
                warm_seconds = time.perf_counter() - start
                result = runners[name](model, prompts, max_new)
                if name.startswith("hybridkv"):
                    hybridkv.unpatch(model)  # frees the pool: the next system sizes its own from a free device
                results[name] = result
                line = (
                    f"{model_name} {workload_name} {name:<18} {result[0]:8.2f} s {generated / result[0]:10.0f} tok/s"
                    f"  (warm-up {warm_seconds:.1f} s)"
                )
                if name.startswith("hybridkv"):
                    stats = result[2]
                    # Host time outside the forward call, less the wait for sampled tokens (async scheduling).
                    host_ms = (stats["overhead_seconds"] - stats["token_wait_seconds"]) / stats["num_steps"] * 1e3
                    line += (
                        f"  (steps {stats['num_steps']}, at most {stats['max_num_running']} running, prefix hits "
                        f"{stats['prefix_cache_hit_rate']:.0%}, host {host_ms:.2f} ms/step, "
                        f"{stats['num_overlapped_steps']} planned ahead, graphs "
                        f"{stats['cuda_graphs']}, step check {stats['step_check']})"
                    )
                print(line, flush=True)
            ours = [name for name in systems if name.startswith("hybridkv")]
            baselines = [name for name in systems if not name.startswith("hybridkv")]
            for mine in ours:
                for name in systems:
                    if name != mine:
                        same = agreement(results[mine][1], results[name][1])
                        print(f"  {mine} vs {name}: {results[name][0] / results[mine][0]:.2f}x; tokens {same}")
            # How far the baselines agree with each other in bf16: the yardstick for hybridkv's agreement.
            for first, second in itertools.combinations(baselines, 2):
                print(f"  {first} vs {second}: tokens {agreement(results[first][1], results[second][1])}")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
