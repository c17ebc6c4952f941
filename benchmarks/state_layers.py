"""Models with state layers: hybridkv vs transformers' generate, one padded batch and one request at a time.

Same model and workload for every system, greedy, fp32, on the CPU; each system runs --repeats times in turn
(round r starts with system r mod 3) and a row gives the median of its runs. Workload: 32 requests, prompts
of 20-300 tokens (seeded), 64 new tokens each (throughput.py's "mixed"). Models, random, 8 layers, hidden
256, vocab 32k: a Qwen3.5-style hybrid (3 Gated DeltaNet : 1 full, twice) and a Bamba-style one (3 Mamba2 :
1 full, twice; Granite 4 and Nemotron-H mix the same layers). transformers' `generate_batch` refuses both
("Invalid layer type: linear_attention", printed as it comes), so the baselines are `generate` on one
left-padded batch (DynamicCache) and `generate` one request at a time. The reference tokens are the second
(no padding at all); the padded batch's own matches are printed too.
Memory: a request's state bytes (the same for any length) and KV bytes per token, from `stats()`.

    python benchmarks/state_layers.py [--models qwen3_5,bamba] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

import hybridkv
from hybridkv import SamplingParams
from hybridkv.tiny import tiny_model

VOCAB = 32_000
SIZE = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=8, max_position_embeddings=8192,
    pad_token_id=0,
)  # fmt: skip
MODELS = {
    "qwen3_5": lambda: tiny_model(
        "qwen3_5",
        **SIZE,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        num_attention_heads=8,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        initializer_range=0.02,
    ),
    "bamba": lambda: tiny_model(
        "bamba",
        **SIZE,
        attn_layer_indices=[3, 7],
        num_attention_heads=8,
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_chunk_size=64,
        initializer_range=0.02,
    ),
    # Nemotron-H's pattern: Mamba2 and MLP layers, a full-attention layer after every few.
    "nemotron_h": lambda: _nemotron_h(),
}


def _nemotron_h() -> torch.nn.Module:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        **SIZE,
        layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention"] * 2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        mamba_num_heads=8,
        mamba_head_dim=32,
        ssm_state_size=16,
        n_groups=1,
        chunk_size=64,
        initializer_range=0.02,
    )
    torch.manual_seed(0)
    return NemotronHForCausalLM(config).eval()


def workload() -> tuple[list[list[int]], int]:
    rng = random.Random(0)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(20, 300))] for _ in range(32)], 64


def run_padded(model, prompts, max_new):
    """transformers' generate on one left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
        )
    return time.perf_counter() - start, [row[width:].tolist() for row in out]


def run_one_at_a_time(model, prompts, max_new):
    """transformers' generate, one request at a time: no padding, the exact reference."""
    tokens = []
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
            )
            tokens.append(out[0, len(prompt) :].tolist())
    return time.perf_counter() - start, tokens


def run_hybridkv(model, prompts, max_new):
    llm = hybridkv.patch(model, max_model_len=8192)
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new), use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    hybridkv.unpatch(model)
    return seconds, [o.outputs[0].token_ids for o in outputs], stats


def generate_batch_verdict(model, prompts) -> str:
    """What transformers' continuous batching does with the model (it refused every state model tried)."""
    config = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None)
    try:
        model.generate_batch(
            prompts[:2], generation_config=config, continuous_batching_config=ContinuousBatchingConfig()
        )
    except Exception as error:  # any refusal is the finding
        return f"refused ({type(error).__name__}: {str(error).splitlines()[0][:80]})"
    return "ran (add it to the systems compared)"


def row(name: str, repeats: int) -> None:
    model = MODELS[name]()
    prompts, max_new = workload()
    generated = len(prompts) * max_new
    systems = ("padded", "one_at_a_time", "hybridkv")
    seconds: dict[str, list[float]] = {s: [] for s in systems}
    tokens: dict[str, list[list[list[int]]]] = {s: [] for s in systems}
    stats = {}
    for round_index in range(repeats):
        for system in systems[round_index % 3 :] + systems[: round_index % 3]:
            if system == "padded":
                run_s, run_tokens = run_padded(model, prompts, max_new)
            elif system == "one_at_a_time":
                run_s, run_tokens = run_one_at_a_time(model, prompts, max_new)
            else:
                run_s, run_tokens, stats = run_hybridkv(model, prompts, max_new)
            seconds[system].append(run_s)
            tokens[system].append(run_tokens)
    padded_s, single_s, ours_s = (statistics.median(seconds[s]) for s in systems)
    reference = tokens["one_at_a_time"][0]

    def ok(system: str) -> str:
        same = sum(all(run[i] == expected for run in tokens[system]) for i, expected in enumerate(reference))
        return f"{same}/{len(reference)}"

    print(
        f"{name:<9}{generated / padded_s:>9.1f}{generated / single_s:>9.1f}{generated / ours_s:>10.1f}"
        f"{padded_s / ours_s:>11.2f}x{single_s / ours_s:>11.2f}x{ok('padded'):>11}{ok('hybridkv'):>9}"
        f"{stats['state_bytes_per_request'] / 1024:>11.1f}{stats['kv_bytes_per_token'] / 1024:>9.2f}"
    )
    print(f"{'':<9}generate_batch: {generate_batch_verdict(model, prompts)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3_5,bamba")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} threads; tokens/s = generated tokens / wall seconds, median of "
        f"{args.repeats} runs per system, the systems in turn; 32 requests, prompts 20-300, 64 new tokens"
    )
    print(
        f"{'model':<9}{'padded':>9}{'1 by 1':>9}{'hybridkv':>10}{'vs padded':>12}{'vs 1 by 1':>12}"
        f"{'padded ok':>11}{'ours ok':>9}{'state KiB':>11}{'KV KiB/t':>9}"
    )
    for name in args.models.split(","):
        row(name, args.repeats)
    print(
        "'ok' = requests whose greedy tokens equal generate's one request at a time (no padding) in every run; "
        "state KiB = one request's state in all state layers, whatever its length; KV KiB/t = the attention "
        "layers' K/V bytes per token"
    )


if __name__ == "__main__":
    main()
