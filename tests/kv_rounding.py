"""transformers' own generate with every layer's K/V rounded as a hybridkv cache of another dtype holds
them: the reference for 16-bit and fp8 pages (token-exact against it), where fp32 generate is not."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hybridkv.kernels.quant import as_cached

ROUNDED = "kv_rounded"


@contextlib.contextmanager
def kv_rounded_like(model: torch.nn.Module, llm) -> Iterator[None]:
    """While active, the (unpatched) model's attention sees K and V as `llm`'s pages hold them: each layer's
    rows rounded to its page dtype (fp8: divided by its scale, clamped, rounded, multiplied back); a
    KV-sharing layer's rows as its source's pages hold them; a latent attention layer's latent and rotary key
    (what it hands its cache, `DynamicCache.update`) rounded so before it expands them."""
    sources = llm.kv_config.shared_layers
    dtypes, scales = llm.core.layer_dtypes.dtypes, llm.core.layer_dtypes.scales
    configs = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            configs.setdefault(id(config), config)
    originals = {key: config._attn_implementation or "eager" for key, config in configs.items()}

    latent = llm.core.runner.latent_layers
    # The layer each attention module serves, as hybridkv found it (Zamba2's shared block has no index of its own).
    named = dict(model.named_modules())
    layer_of = {id(named[name]): layer_idx for layer_idx, name in llm.core.layout.module_names.items()}

    def rounded(layer_idx, key, value):
        k_scale, v_scale = scales[layer_idx]
        key = as_cached(key, dtypes[layer_idx], k_scale).to(key.dtype) * k_scale
        value = as_cached(value, dtypes[layer_idx], v_scale).to(value.dtype) * v_scale
        return key, value

    def attention(module, query, key, value, attention_mask, **kwargs):
        layer_idx = layer_of.get(id(module), module.layer_idx)
        layer_idx = sources.get(layer_idx, layer_idx)
        if layer_idx not in latent:  # a latent layer's pages hold what it hands its cache: rounded there
            key, value = rounded(layer_idx, key, value)
        original = originals.get(id(module.config), "sdpa")
        if original == "eager":
            function = sys.modules[type(module).__module__].eager_attention_forward
        else:
            function = ALL_ATTENTION_FUNCTIONS[original]
        return function(module, query, key, value, attention_mask, **kwargs)

    def mask(*args, config=None, **kwargs):
        return ALL_MASK_ATTENTION_FUNCTIONS[originals.get(id(config), "sdpa")](*args, config=config, **kwargs)

    AttentionInterface.register(ROUNDED, attention)
    AttentionMaskInterface.register(ROUNDED, mask)

    def update(cache, key, value, layer_idx, *args, **kwargs):
        if layer_idx in latent:
            key, value = rounded(layer_idx, key, value)
        return original_update(cache, key, value, layer_idx, *args, **kwargs)

    original_update = DynamicCache.update
    top = originals[id(model.config)]
    model.set_attn_implementation(ROUNDED)
    DynamicCache.update = update
    try:
        yield
    finally:
        DynamicCache.update = original_update
        model.set_attn_implementation(top)
