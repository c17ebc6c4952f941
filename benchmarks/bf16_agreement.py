"""How far greedy tokens agree in bf16 between transformers' generate, generate_batch and hybridkv, on the
CPU: the yardstick for reading bf16 agreement figures (fp32 is the token-exact setting). Tiny random
models: a 4-layer Llama-style one and the throughput benchmark's hybrid; 16 prompts of 20-200 tokens,
32 new tokens. For each pair: requests whose tokens are all equal, and the mean first differing position.

    python benchmarks/bf16_agreement.py [--threads 2]
"""

from __future__ import annotations

import argparse
import itertools
import random

import torch

from hybridkv.tiny import tiny_model

from throughput import agreement, hybrid_model, run_generate, run_generate_batch, run_hybridkv


def llama_model() -> torch.nn.Module:
    return tiny_model(
        "llama", vocab_size=32_000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192, initializer_range=0.02,
        pad_token_id=0,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 32_000) for _ in range(rng.randint(20, 200))] for _ in range(16)]
    for name, build in (("llama", llama_model), ("hybrid", hybrid_model)):
        model = build().to(torch.bfloat16)
        tokens = {
            "generate": run_generate(model, prompts, 32)[1],
            "generate_batch": run_generate_batch(model, prompts, 32)[1],
            "hybridkv": run_hybridkv(model, prompts, 32)[1],
        }
        for first, second in itertools.combinations(tokens, 2):
            print(f"{name:<7} {first} vs {second}: {agreement(tokens[first], tokens[second])}", flush=True)


if __name__ == "__main__":
    main()
