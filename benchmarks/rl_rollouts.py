"""RL rollouts (issue 51): the seconds TRL's GRPOTrainer spends generating per step, with its rollouts through
hybridkv (`hybridkv.rollouts.trl_rollout_func`), through transformers' continuous batching (TRL's
`use_transformers_continuous_batching`, `max_batch_tokens=512`: its fastest CPU setting, benchmarks/throughput.py), and
through plain `generate` (TRL's default path), in one run: the same policy (a random Gemma-3-style hybrid, hidden 256,
6 layers; a fresh copy per system), prompts, sampling settings and GRPO steps.

A step's generation time is TRL's `_generate` call, timed around it (tokenization, generation, decoding: the same
boundary for every path); the optimizer's time is not counted. The first step is reported apart (it includes
hybridkv's `patch`, and each path's warm-up); the figure is the median of the later steps. Mean completion lengths
are printed too: the policies are random, so completions run to max_completion_length unless an EOS is sampled.

    python benchmarks/rl_rollouts.py [--steps 4] [--prompts 8] [--generations 8] [--new 64] [--device cuda]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
import warnings

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from hybridkv.rollouts import trl_rollout_func
from hybridkv.serving.cli import tiny_tokenizer
from hybridkv.tiny import tiny_model

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
SYSTEMS = ("hybridkv", "transformers continuous batching", "transformers generate")
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "tiny",
    "models",
    "dream",
    "of",
    "long",
    "windows",
    "and",
    "caches",
]


def distinct_characters(completions, **kwargs):
    """A toy reward that varies between samples (GRPO learns from its spread within a prompt's group)."""
    return [len(set(text)) / max(len(text), 1) for text in completions]


def policy(vocab_size: int) -> torch.nn.Module:
    return tiny_model(
        "gemma3", vocab_size=vocab_size, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
        num_attention_heads=8, head_dim=32, sliding_window=128, max_position_embeddings=4096, pad_token_id=0,
    )  # fmt: skip


def run(system: str, model: torch.nn.Module, tokenizer, dataset: Dataset, args) -> tuple[list[float], list[int]]:
    """One GRPO run; returns the seconds of each step's generation and the tokens it generated."""
    config = dict(
        output_dir=tempfile.mkdtemp(prefix="rl-rollouts-"),
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        max_completion_length=args.new,
        max_steps=args.steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        use_cpu=args.device == "cpu",
        save_strategy="no",
        seed=0,
        temperature=1.0,
        bf16=False,  # fp32 weights trained in fp32: every path generates in the weights' dtype
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    extra = {}
    if system == "hybridkv":
        extra["rollout_func"] = trl_rollout_func(max_model_len=1024, use_tqdm=False)
    elif system == "transformers continuous batching":
        config["use_transformers_continuous_batching"] = True
        config["transformers_continuous_batching_config"] = {"max_batch_tokens": 512}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=distinct_characters,
        args=GRPOConfig(**config),
        train_dataset=dataset,
        processing_class=tokenizer,
        **extra,
    )
    seconds, tokens = [], []
    generate = trainer._generate

    def timed(prompts):
        start = time.perf_counter()
        out = generate(prompts)
        seconds.append(time.perf_counter() - start)
        tokens.append(sum(len(ids) for ids in out[1]))  # (prompt_ids, completion_ids, ...)
        return out

    trainer._generate = timed
    trainer.train()
    return seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (GRPO's group)")
    parser.add_argument("--new", type=int, default=64, help="max_completion_length")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    base = policy(len(tokenizer)).to(args.device)
    prompts = [
        " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + i % 5)) for i in range(args.prompts * args.steps)
    ]
    dataset = Dataset.from_dict({"prompt": prompts})
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"GRPO on {device}: {args.prompts} prompts x {args.generations} generations per step, up to {args.new} new "
        f"tokens, {args.steps} steps; generation seconds per step (first step apart: set-up, warm-up)"
    )
    results = {}
    for system in SYSTEMS:
        seconds, tokens = run(system, copy.deepcopy(base), tokenizer, dataset, args)
        later = slice(1, None) if len(seconds) > 1 else slice(None)
        steady = statistics.median(seconds[later])
        rate = sum(tokens[later]) / sum(seconds[later])
        results[system] = (steady, rate)
        print(
            f"  {system:34s} first {seconds[0]:7.2f} s   later (median) {steady:7.2f} s   {rate:7.0f} tokens/s   "
            f"mean completion {sum(tokens) / len(tokens) / (args.prompts * args.generations):5.1f} tokens"
        )
    ours = results["hybridkv"]
    for system in SYSTEMS[1:]:
        theirs = results[system]
        print(
            f"hybridkv vs {system}: {theirs[0] / ours[0]:.2f}x the seconds per step, "
            f"{ours[1] / theirs[1]:.2f}x the tokens per second"
        )


if __name__ == "__main__":
    main()
