"""Memory per request on published state-layer layouts: hybridkv against transformers' own cache, 1k-32k tokens.

A model's cache bytes depend only on its layer layout, not its weights, so each model keeps every dimension its
cache depends on, as published, and shrinks the rest (hidden size 256, intermediate 512, vocab 1,024: random
bf16 weights, nothing downloaded):
  qwen3_5     transformers' Qwen3_5TextConfig defaults: 32 layers, 3 Gated DeltaNet : 1 full attention;
              attention 16 query / 4 KV heads of 256; linear attention 16 key / 32 value heads of 128, conv 4
  nemotron_h  Nemotron-H-8B: 52 layers "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-" (24 Mamba2,
              4 attention, 24 MLP); Mamba2 128 heads of 64, state 128, 8 groups, conv 4; attention 32 query /
              8 KV heads of 128
transformers: the bytes of every tensor in the `DynamicCache` its forward returns, measured at 1,024 and 2,048
tokens; at 4k-32k, those plus the per-token growth between the two (a DynamicCache's attention layers grow by
the same bytes per token; its state layers do not grow), marked "~". hybridkv: the blocks its allocator gives one
request of that length (a `KVCacheCoordinator` over the engine's own layout, default block size 16) times the
block bytes, plus the request's state slot, measured from `stats()`; its prefix-cache checkpoints and the
null block are shared by all requests and not counted.

    python benchmarks/state_memory.py [--models qwen3_5,nemotron_h]
"""

from __future__ import annotations

import argparse

import torch
import transformers

import hybridkv
from hybridkv.execution.sizing import blocks_for_requests
from hybridkv.memory.coordinator import KVCacheCoordinator
from hybridkv.memory.kv_request import KVRequest

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


def _build(model_cls, config) -> torch.nn.Module:
    torch.manual_seed(0)
    return model_cls(config).to(torch.bfloat16).eval()


MODELS = {"qwen3_5": qwen3_5, "nemotron_h": nemotron_h}


def transformers_cache_bytes(model: torch.nn.Module, length: int) -> int:
    """Bytes of every tensor of the cache the model's own forward returns for a prompt of `length` tokens."""
    ids = torch.randint(1, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = model(ids, use_cache=True, logits_to_keep=1).past_key_values
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
    parser.add_argument("--models", default="qwen3_5,nemotron_h")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; bf16, MiB per request")
    print(f"{'model':<11}{'tokens':>8}{'transformers':>15}{'hybridkv':>11}{'ratio':>8}{'state share':>13}")
    for name in args.models.split(","):
        model = MODELS[name]()
        settings = dict(max_model_len=max(LENGTHS), max_num_seqs=4)
        llm = hybridkv.patch(model, **settings, num_blocks=hybridkv.min_num_blocks(model, **settings))
        state = llm.stats()["state_bytes_per_request"]
        measured = {length: transformers_cache_bytes(model, length) for length in LENGTHS[:2]}
        per_token = (measured[LENGTHS[1]] - measured[LENGTHS[0]]) / (LENGTHS[1] - LENGTHS[0])
        for length in LENGTHS:
            theirs = measured.get(length)
            mark = " "
            if theirs is None:
                theirs, mark = measured[LENGTHS[1]] + per_token * (length - LENGTHS[1]), "~"
            ours = hybridkv_request_bytes(llm, length)
            print(
                f"{name:<11}{length:>8,}{mark:>3}{theirs / 2**20:>12.1f}{ours / 2**20:>11.1f}"
                f"{ours / theirs:>8.3f}{state / ours:>13.1%}"
            )
        hybridkv.unpatch(model)


if __name__ == "__main__":
    main()
