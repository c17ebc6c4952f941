"""Memory per request on published state-layer layouts: hybridkv against transformers' own cache, 1k-32k tokens.

A model's cache bytes depend only on its layer layout, not its weights, so each model keeps every dimension its
cache depends on, as published, and shrinks the rest (hidden size 256, intermediate 512, vocab 1,024, two experts:
random bf16 weights, nothing downloaded); where a state's width follows the hidden size, the expansion keeps it:
  qwen3_5         transformers' Qwen3_5TextConfig defaults: 32 layers, 3 Gated DeltaNet : 1 full attention;
                  attention 16 query / 4 KV heads of 256; linear attention 16 key / 32 value heads of 128, conv 4
  nemotron_h      Nemotron-H-8B: 52 layers "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-" (24 Mamba2,
                  4 attention, 24 MLP); Mamba2 128 heads of 64, state 128, 8 groups, conv 4; attention 32 query /
                  8 KV heads of 128
  jamba           transformers' JambaConfig defaults (Jamba v0.1): 32 layers, 28 Mamba-1 : 4 full attention (32
                  query / 8 KV heads of 128); Mamba-1 8,192 channels (2 x its hidden 4,096), state 16, conv 4
                  (hidden 1,024 here, expansion 8)
  zamba2          transformers' Zamba2Config defaults (Zamba2-2.7B): 54 Mamba2 layers (8 heads of 640, state 64,
                  conv 4), 9 of them with the shared attention block (32 query / 32 KV heads of 160)
  minimax         transformers' MiniMaxConfig defaults: 32 layers alternating full attention (32 query / 8 KV heads
                  of 128) and lightning attention (a 128 x 128 state per head, 32 heads)
  recurrent_gemma transformers' RecurrentGemmaConfig defaults (RecurrentGemma-2B): 26 layers, 2 RG-LRU recurrent
                  blocks (width 2,560, conv 4) : 1 local attention (window 2,048, 10 KV heads of 256)
transformers: the bytes of every tensor in the cache its forward fills (`DynamicCache`, MiniMax's `MiniMaxCache`,
and the states RecurrentGemma's blocks keep on themselves), measured at 1,024 and 2,048 tokens (and 4,096 for a
model with windows); beyond, those plus the per-token growth between the last two (a DynamicCache's attention layers
grow by the same bytes per token, a window's and the states not at all), marked "~". hybridkv: the blocks its
allocator gives one request of that length (a `KVCacheCoordinator` over the engine's own layout, default block size
16) times the block bytes, plus the request's state slot, measured from `stats()`; its prefix-cache checkpoints and
the null block are shared by all requests and not counted. "at 16 GiB": how many such requests 16 GiB of cache holds,
transformers / hybridkv.

    python benchmarks/state_memory.py [--models qwen3_5,nemotron_h,jamba,zamba2,minimax,recurrent_gemma]
"""

from __future__ import annotations

import argparse

import torch
import transformers

import hybridkv
from hybridkv.execution.sizing import blocks_for_requests
from hybridkv.memory.coordinator import KVCacheCoordinator
from hybridkv.memory.kv_request import KVRequest
from hybridkv.patches.own_state import keeps_own_state

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
SMALL = dict(hidden_size=256, intermediate_size=512, vocab_size=1024, max_position_embeddings=32768)


def qwen3_5() -> torch.nn.Module:
    config = transformers.Qwen3_5TextConfig(**SMALL)
    return _build(transformers.Qwen3_5ForCausalLM, config)


def nemotron_h() -> torch.nn.Module:
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
    config = transformers.NemotronHConfig(
        **SMALL,
        layers_block_type=[kinds[c] for c in pattern],
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        mamba_num_heads=128,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        conv_kernel=4,
    )
    return _build(transformers.NemotronHForCausalLM, config)


# The experts of a MoE layer hold no cache: two small ones.
FEW_EXPERTS = dict(num_experts_per_tok=1, num_local_experts=2)


def jamba() -> torch.nn.Module:
    small = {**SMALL, "hidden_size": 1024}  # 8 heads of 128, as published; the Mamba-1 width 8 x 1,024 = 8,192
    config = transformers.JambaConfig(
        **small, num_attention_heads=8, num_key_value_heads=8, mamba_expand=8, **FEW_EXPERTS
    )
    return _build(transformers.JambaForCausalLM, config)


def zamba2() -> torch.nn.Module:
    published = transformers.Zamba2Config()
    config = transformers.Zamba2Config(
        **SMALL,
        mamba_expand=published.mamba_expand * published.hidden_size // SMALL["hidden_size"],
        attention_head_dim=published.attention_head_dim,
    )
    return _build(transformers.Zamba2ForCausalLM, config)


def minimax() -> torch.nn.Module:
    published = transformers.MiniMaxConfig()
    head_dim = published.hidden_size // published.num_attention_heads
    return _build(
        transformers.MiniMaxForCausalLM, transformers.MiniMaxConfig(**SMALL, head_dim=head_dim, **FEW_EXPERTS)
    )


def recurrent_gemma() -> torch.nn.Module:
    config = transformers.RecurrentGemmaConfig(**SMALL, lru_width=transformers.RecurrentGemmaConfig().lru_width)
    return _build(transformers.RecurrentGemmaForCausalLM, config)


def _build(model_cls, config) -> torch.nn.Module:
    torch.manual_seed(0)
    return model_cls(config).to(torch.bfloat16).eval()


MODELS = {
    "qwen3_5": qwen3_5,
    "nemotron_h": nemotron_h,
    "jamba": jamba,
    "zamba2": zamba2,
    "minimax": minimax,
    "recurrent_gemma": recurrent_gemma,
}
BUDGET = 16 << 30


def transformers_cache_bytes(model: torch.nn.Module, length: int) -> int:
    """Bytes of every tensor of the cache the model's own forward returns for a prompt of `length` tokens."""
    ids = torch.randint(1, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = getattr(model(ids, use_cache=True, logits_to_keep=1), "past_key_values", None)
        if cache is None:  # RecurrentGemma returns none: it fills the cache it is given
            cache = transformers.DynamicCache(config=model.config)
            model(ids, use_cache=True, logits_to_keep=1, past_key_values=cache)
    seen: dict[int, int] = {}

    def visit(value) -> None:
        if isinstance(value, torch.Tensor):
            seen[value.data_ptr()] = value.numel() * value.element_size()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)

    for layer in cache.layers:
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            visit(getattr(layer, name, None))
    visit(getattr(cache, "linear_cache", None))  # MiniMax's lightning attention states
    for module in model.modules():  # RecurrentGemma's blocks keep theirs on themselves
        if keeps_own_state(module):
            visit(module.conv1d_state)
            visit(module.rg_lru.recurrent_states)
    return sum(seen.values())


def hybridkv_request_bytes(llm, length: int) -> int:
    """The blocks hybridkv's allocator gives one request of `length` tokens, in bytes, and its state slot."""
    kv_config = llm.kv_config
    coordinator = KVCacheCoordinator(kv_config, blocks_for_requests(kv_config, length, 1), enable_caching=False)
    request = KVRequest("r", list(range(length)), kv_config.block_size)
    assert coordinator.allocate_slots(request, length)
    blocks = coordinator.stats().blocks_in_use
    return blocks * llm.bytes_per_block + llm.stats()["state_bytes_per_request"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; bf16, MiB per request")
    print(
        f"{'model':<16}{'tokens':>8}{'transformers':>15}{'hybridkv':>11}{'ratio':>8}{'state share':>13}"
        f"{'at 16 GiB':>16}"
    )
    for name in args.models.split(","):
        model = MODELS[name]()
        settings = dict(max_model_len=max(LENGTHS), max_num_seqs=4)
        llm = hybridkv.patch(model, **settings, num_blocks=hybridkv.min_num_blocks(model, **settings))
        state = llm.stats()["state_bytes_per_request"]
        windowed = any(group.sliding_window for group in llm.kv_config.groups)
        lengths = LENGTHS[: 3 if windowed else 2]  # past a window the cache stops growing: measured there
        measured = {length: transformers_cache_bytes(model, length) for length in lengths}
        last, before = lengths[-1], lengths[-2]
        per_token = (measured[last] - measured[before]) / (last - before)
        for length in LENGTHS:
            theirs = measured.get(length)
            mark = " "
            if theirs is None:
                theirs, mark = measured[last] + per_token * (length - last), "~"
            ours = hybridkv_request_bytes(llm, length)
            print(
                f"{name:<16}{length:>8,}{mark:>3}{theirs / 2**20:>12.1f}{ours / 2**20:>11.1f}"
                f"{ours / theirs:>8.3f}{state / ours:>13.1%}{f'{int(BUDGET // theirs)} / {int(BUDGET // ours)}':>16}"
            )
        hybridkv.unpatch(model)


if __name__ == "__main__":
    main()
