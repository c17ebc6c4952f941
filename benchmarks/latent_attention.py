"""Latent attention (MLA, issue 49): KV bytes per token on DeepSeek-V2-Lite's layout, and decode speed on the CPU.

Memory: DeepSeek-V2-Lite's attention layout (27 layers, 16 heads, kv_lora_rank 512, qk_rope_head_dim 64,
qk_nope_head_dim 128, v_head_dim 128, hidden 2048) with a tiny MLP and vocabulary (per-token KV bytes depend on the
attention alone), bf16. Printed per token: hybridkv's pages (`bytes_per_block / block_size`), the latent's
`(kv_lora_rank + qk_rope_head_dim) x layers x 2 bytes`, transformers' DynamicCache after a prompt (measured: since
transformers 5.23 an MLA layer hands its cache the latent too), and the expanded per-head K/V that a cache of
keys and values would hold (what hybridkv paged before latent attention, and what `generate_batch` would). Then,
at the KV budget of --budget-requests DynamicCache requests of --context tokens, how many such requests hybridkv's
pool holds at once (its own block count) and a per-head K/V pool would.

Speed: a tiny-to-mid DeepSeek-V3 (hidden 256, 4 layers, 8 heads, latent 64 + rotary 16, fp32, random weights),
--requests prompts of 100-300 tokens, --new-tokens each, greedy: `model.generate` (padded batch, DynamicCache),
`generate_batch` (transformers' continuous batching, if it serves the model) and hybridkv with its decode rows
attended in latent space (the default: on the CPU by the C decode kernel, and again through the torch path) and
expanded, each timed from the call to the last token with set-up
outside; tokens compared with generate's. `--speed-only` skips the memory part; `--device cuda` runs the speed part
on a GPU (fp32: the Triton decode kernel's ieee dots). `--micro`: the decode rows' attention alone on random pages,
the C decode kernel against the torch path (the CPU's choice).

    python benchmarks/latent_attention.py [--budget-requests 8] [--context 4096] [--requests 8] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time

import torch
from transformers import (
    ContinuousBatchingConfig,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GenerationConfig,
)

import hybridkv
from hybridkv import SamplingParams
from hybridkv.kernels import cpu_decode

LITE = dict(  # DeepSeek-V2-Lite's attention (its published config), a tiny MLP and vocabulary
    num_hidden_layers=27, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
    q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=512,
    intermediate_size=64, moe_intermediate_size=64, n_routed_experts=2, num_experts_per_tok=1, n_group=1,
    topk_group=1, first_k_dense_replace=27, max_position_embeddings=8192,
)  # fmt: skip
MID = dict(
    num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=64,
    q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, vocab_size=4096, intermediate_size=512,
    moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
    first_k_dense_replace=1, max_position_embeddings=4096, initializer_range=0.05, num_mtp_layers=0,
)  # fmt: skip


def memory(budget_requests: int, context: int) -> None:
    torch.manual_seed(0)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**LITE)).to(torch.bfloat16).eval()
    layers = LITE["num_hidden_layers"]
    latent = (LITE["kv_lora_rank"] + LITE["qk_rope_head_dim"]) * layers * 2
    heads = LITE["num_attention_heads"]
    expanded = heads * (LITE["qk_nope_head_dim"] + LITE["qk_rope_head_dim"] + LITE["v_head_dim"]) * layers * 2
    prompt = torch.randint(0, LITE["vocab_size"], (1, 64))
    with torch.inference_mode():
        cache = model(input_ids=prompt, use_cache=True).past_key_values
    dynamic = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers) // prompt.shape[1]
    budget = budget_requests * context * dynamic
    llm = hybridkv.patch(model, block_size=16, max_model_len=context, kv_cache_memory=budget)
    ours = llm.bytes_per_block // 16
    num_blocks = llm.stats()["num_blocks"]
    print("DeepSeek-V2-Lite's layout, bf16, KV bytes per token")
    print(f"  hybridkv pages            {ours:>8,}  ({ours / latent:.3f}x the latent's (512 + 64) x 27 x 2)")
    print(f"  latent (ideal)            {latent:>8,}")
    print(f"  DynamicCache (measured)   {dynamic:>8,}  ({dynamic / ours:.2f}x hybridkv's)")
    print(f"  expanded per-head K/V     {expanded:>8,}  ({expanded / ours:.2f}x hybridkv's)")
    print(f"at DynamicCache's budget for {budget_requests} requests of {context} tokens ({budget / 2**20:,.0f} MiB):")
    print(f"  hybridkv's pool: {num_blocks:,} blocks of 16 tokens, {num_blocks * 16 // context} requests at once")
    print(f"  a per-head K/V pool: {budget // (expanded * context)} requests at once")
    hybridkv.unpatch(model)


def speed(num_requests: int, new_tokens: int, device: str = "cpu") -> None:
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**MID)).eval().to(device)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, MID["vocab_size"]) for _ in range(rng.randint(100, 300))] for _ in range(num_requests)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
        generate_seconds = time.perf_counter() - start
    expected = out[:, width:].tolist()
    rows = [("generate (padded, DynamicCache)", generate_seconds, None)]
    try:
        generation = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        start = time.perf_counter()
        outputs = model.generate_batch(
            prompts, generation_config=generation, continuous_batching_config=ContinuousBatchingConfig()
        )
        seconds = time.perf_counter() - start
        ordered = sorted(outputs.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
        errors = [o.error for o in ordered if getattr(o, "error", None)]
        if errors:
            print(f"generate_batch failed every request ({len(errors)}): {str(errors[0])[:160]}")
        else:
            rows.append(("generate_batch", seconds, [o.generated_tokens for o in ordered] == expected))
    except Exception as error:
        print(f"generate_batch does not serve this model: {type(error).__name__}: {str(error)[:200]}")
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    forms = [("hybridkv (decode absorbed)", True, False), ("hybridkv (decode expanded)", False, False)]
    if device == "cpu":  # the absorbed rows through the torch path, not the C decode kernel
        forms.insert(1, ("hybridkv (absorbed, no C kernel)", True, True))
    for name, absorb, no_c_kernel in forms:
        llm = hybridkv.patch(model, block_size=16, max_model_len=1024)
        for layer in llm.core.runner.layers.values():
            layer.latent.absorb = absorb
        with cpu_decode.disabled() if no_c_kernel else contextlib.nullcontext():
            start = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        rows.append((name, seconds, [r.outputs[0].token_ids for r in results] == expected))
        hybridkv.unpatch(model)
    total = num_requests * new_tokens
    shape = "DeepSeek-V3 (hidden 256, 4 layers, latent 64 + 16), fp32"
    print(f"\n{shape}, {num_requests} prompts of 100-300 tokens, {new_tokens} new")
    for name, seconds, same in rows:
        same_text = "" if same is None else f"  tokens equal generate's: {same}"
        ratio = generate_seconds / seconds
        print(f"  {name:<32}{total / seconds:>8.1f} tok/s  {ratio:.2f}x generate{same_text}")


def decode_micro() -> None:
    """The decode rows' attention alone (`latent_attention` on random pages, every row a decode row): the C decode
    kernel against the torch path, median ms of 15 calls, each alternated twice."""
    print("\nlatent decode rows alone (batch, heads, latent, rotary, context): median ms, C kernel / torch path")
    for shape in [
        (16, 16, 512, 64, 128, 128, 1000),  # DeepSeek-V2-Lite's attention
        (32, 16, 512, 64, 128, 128, 300),
        (8, 8, 64, 16, 32, 32, 250),  # the speed part's model
    ]:
        c_ms, torch_ms = _time_decode(*shape)
        print(
            f"  {shape[:4] + shape[-1:]!s:<28}{c_ms:>8.2f} / {torch_ms:>6.2f} ms  ({torch_ms / c_ms:.2f}x faster in C)"
        )


def _time_decode(batch, heads, latent, rotary, nope, value, context, block_size=16) -> tuple[float, float]:
    from hybridkv.kernels import PagedAttentionMetadata
    from hybridkv.kernels.latent_attention import latent_attention

    per_seq = -(-context // block_size)
    torch.manual_seed(0)
    pages = torch.randn(batch * per_seq + 1, block_size, 1, latent + rotary)
    up = torch.nn.Linear(latent, heads * (nope + value), bias=False)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    query = torch.randn(batch, heads, nope + rotary)

    def run():
        metadata = PagedAttentionMetadata.build([1] * batch, [context] * batch, tables, block_size)
        with torch.no_grad():
            latent_attention(query, pages, pages[..., :latent], metadata, up, nope, 0.1)

    times: dict[str, list[float]] = {"C kernel": [], "torch path": []}
    for name in ["C kernel", "torch path"] * 2:
        with cpu_decode.disabled() if name == "torch path" else contextlib.nullcontext():
            run()
            calls = []
            for _ in range(15):
                start = time.perf_counter()
                run()
                calls.append(time.perf_counter() - start)
        times[name].append(sorted(calls)[7] * 1e3)
    return min(times["C kernel"]), min(times["torch path"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-requests", type=int, default=8)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--speed-only", action="store_true")
    parser.add_argument("--micro", action="store_true", help="only the decode rows' attention: C kernel / torch path")
    parser.add_argument("--device", default="cpu", help="where the speed part runs (cuda: a GPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.micro:
        decode_micro()
        return
    if not args.speed_only:
        memory(args.budget_requests, args.context)
    speed(args.requests, args.new_tokens, args.device)


if __name__ == "__main__":
    main()
