"""GPU end-to-end throughput: hybridkv vs transformers' generate_batch and a padded generate, on CUDA.

Models shaped as published (random bf16 weights, no download): Gemma-3-1B (26 layers, 5 sliding-window
512 : 1 full, 1 KV head of 256, vocab 262,144) and Llama-3.2-1B (16 layers, 8 KV heads of 64, vocab
128,256). Workloads: "mixed", 256 requests of 64..1,024 prompt tokens (seeded), 128 new tokens each;
"shared", 256 requests sharing a 2,048-token system prompt plus 16..64 unique tokens, 64 new tokens.
Greedy, no EOS. Every system first runs 8 of the requests untimed (Triton compiles, CUDA graphs are
captured, cuBLAS warms up), then the whole workload timed, its own set-up (hybridkv's patch: the
profiling forward and the pool; generate_batch's manager and graphs) inside the timed region.
transformers' generate_batch runs with its defaults (CUDA graphs decided by itself). bf16 greedy
tokens can differ between systems after a near tie; for every pair of systems the share of requests
whose tokens are equal, and the mean first differing position, are printed.

    python benchmarks/throughput_gpu.py [--models gemma3,llama] [--workloads mixed,shared] [--requests 256]
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time

import torch
import transformers
from transformers import GenerationConfig

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


def run_generate(model, prompts, max_new):
    """transformers' generate on left-padded batches of 64 (one batch of 256 x 1,152 positions' logits and
    activations is what a user would split)."""
    tokens = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for first in range(0, len(prompts), 64):
        batch = prompts[first : first + 64]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
            )
        tokens += [row[width:].tolist() for row in out]
    torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def run_generate_batch(model, prompts, max_new):
    config = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, eos_token_id=None)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=config)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ordered = sorted(outputs.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
    return seconds, [o.generated_tokens for o in ordered]


def run_hybridkv(model, prompts, max_new):
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm = hybridkv.patch(model, max_model_len=4096)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new), use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    stats = llm.stats()
    hybridkv.unpatch(model)
    return seconds, [o.outputs[0].token_ids for o in outputs], stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gemma3,llama")
    parser.add_argument("--workloads", default="mixed,shared")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--systems", default="generate,generate_batch,hybridkv")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("throughput_gpu.py needs a CUDA GPU; benchmarks/throughput.py is the CPU comparison")
    runners = {"generate": run_generate, "generate_batch": run_generate_batch, "hybridkv": run_hybridkv}
    systems = args.systems.split(",")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
    for model_name in args.models.split(","):
        model = MODELS[model_name]()
        for workload_name in args.workloads.split(","):
            prompts, max_new = workload(workload_name, args.requests, model.config.vocab_size)
            generated = len(prompts) * max_new
            results = {}
            for name in systems:
                runners[name](model, prompts[:8], 8)  # warm-up, untimed
                result = runners[name](model, prompts, max_new)
                results[name] = result
                line = f"{model_name} {workload_name} {name:<15} {result[0]:8.2f} s {generated / result[0]:10.0f} tok/s"
                if name == "hybridkv":
                    stats = result[2]
                    host_ms = stats["overhead_seconds"] / stats["num_steps"] * 1e3
                    line += (
                        f"  (steps {stats['num_steps']}, at most {stats['max_num_running']} running, prefix hits "
                        f"{stats['prefix_cache_hit_rate']:.0%}, host {host_ms:.2f} ms/step)"
                    )
                print(line, flush=True)
            if "hybridkv" in results:
                ours = results["hybridkv"][0]
                for name in systems:
                    if name != "hybridkv":
                        same = agreement(results["hybridkv"][1], results[name][1])
                        print(f"  hybridkv vs {name}: {results[name][0] / ours:.2f}x; tokens {same}")
            # How far the baselines agree with each other in bf16: the yardstick for hybridkv's agreement.
            for first, second in itertools.combinations([name for name in systems if name != "hybridkv"], 2):
                print(f"  {first} vs {second}: tokens {agreement(results[first][1], results[second][1])}")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
