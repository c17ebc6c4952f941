"""Sweep every causal-LM model type transformers knows through hybridkv, hunting silent wrong tokens.

For each `model_type` in transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` (plus `EXTRA_TYPES`, image-text
wrappers served text only, such as PaliGemma), build a tiny random fp32 model from the config class's
defaults, shrunk by one generic function over common attribute names (vocabulary 256, hidden size 64, 4
layers, 4 heads / 2 KV heads, head dim 16, intermediate 128, 4 experts / top 2, windows of 16,
initializer range 0.2 or as below, no special token ids), applied to the config and to each of its sub-configs. Then:

* reference: `model.generate` greedy, 8 new tokens, for prompts of 7, 40 and 90 random token ids;
* `hybridkv.patch(model, max_model_len=256, block_size=8)` and `generate` with
  `SamplingParams(temperature=0, max_tokens=8)`; again with `max_num_batched_tokens=16` (chunked prefill).

Each type ends as one of:

* exact: every token equal to transformers' in both runs;
* tie: tokens differ only where transformers' top-2 logits were within 1e-5 (a near-tie, not a bug);
* mismatch: a token differs where transformers' choice was clear: silent wrong tokens (prompt, first
  differing index and the logit gap are printed);
* refused: hybridkv's `patch` raised ValueError / TypeError / NotImplementedError (its first line is printed);
* error: any other exception (in `patch`, one raised from the model's or torch's code rather than hybridkv's,
  with the file that raised it), or a request that ended with an error;
* unbuildable: the tiny model could not be built, or transformers' own generate failed on it;
* timeout: the type took longer than --timeout seconds.

The initializer range is the first of `INIT_RANGES` (0.2, 0.03, 0.5) under which transformers' greedy
tokens depend on the prompt (differ between prompts, are not just each prompt's last token repeated, and
change when the first token of the 40-token prompt does); a type where none does is marked "weak test".

    python benchmarks/causal_lm_sweep.py                  # every type: 3-8 minutes on 2 CPU cores
    python benchmarks/causal_lm_sweep.py --types llama,bart,paligemma --json /tmp/sweep.json
    python benchmarks/causal_lm_sweep.py --image-text     # also the image-text-to-text mapping's types

It imports whichever hybridkv Python finds (the first output line names it): to sweep another revision,
put a copy of its hybridkv/ folder first on PYTHONPATH.

Types whose configs set `is_decoder` (BERT-style encoders behind a causal-LM head) are built with
`is_decoder=True`, the setting that makes them causal.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import signal
import sys
import time
import traceback
import warnings
from typing import Any

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

import hybridkv

VOCAB = 256
WINDOW = 16
LAYERS = 4
PROMPT_LENGTHS = (7, 40, 90)
MAX_NEW_TOKENS = 8
TIE_GAP = 1e-5
PATCH_SETTINGS = dict(max_model_len=256, block_size=8)
CHUNKED_SETTINGS = dict(PATCH_SETTINGS, max_num_batched_tokens=16)
REFUSALS = (ValueError, TypeError, NotImplementedError)

# Image-text wrappers the causal-LM mapping lacks, served text only: model_type -> class name.
EXTRA_TYPES = {"paligemma": "PaliGemmaForConditionalGeneration"}

# Config field -> its tiny value; set where the config has the field and its value is a non-zero number (None
# means "derived" or "off", a sliding window of None stays off; but head_dim and num_key_value_heads are set
# even when None, since some defaults leave them None and their models cannot build from that).
LAYER_FIELDS = (
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers", "num_decoder_layers",
    "num_encoder_layers", "depth",
)  # fmt: skip
INIT_FIELDS = ("initializer_range", "init_std")
# Tried in turn until greedy output depends on the prompt (see `weakness`): 0.2 suits most tiny models; the
# Gemmas, which scale embeddings by sqrt(hidden_size), need less, or each token's embedding drowns the rest.
INIT_RANGES = (0.2, 0.03, 0.5)
SHRINK: dict[str, int | float] = {
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input", "audio_vocab_size", "unpadded_vocab_size"), VOCAB),
    **dict.fromkeys((
        "hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim", "word_embed_proj_dim", "projection_dim",
        "embedding_size", "lru_width", "out_hidden_size", "text_hidden_size", "hidden_dim", "emb_dim",
    ), 64),
    **dict.fromkeys(LAYER_FIELDS, LAYERS),
    **dict.fromkeys((
        "num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads", "encoder_attention_heads",
        "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
        "linear_num_value_heads", "num_encoder_attention_heads", "num_decoder_attention_heads",
    ), 4),
    **dict.fromkeys((
        "num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_global_key_value_heads",
        "num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "linear_num_key_heads",
    ), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "n_group", "topk_group", "first_k_dense_replace"), 1),
    **dict.fromkeys((
        "head_dim", "kv_channels", "attention_head_dim", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank",
        "linear_key_head_dim", "linear_value_head_dim", "index_head_dim", "hidden_size_per_layer_input",
    ), 16),
    **dict.fromkeys(("qk_rope_head_dim", "mamba_d_state", "state_size", "ssm_state_size", "mamba_dt_rank"), 8),
    **dict.fromkeys(("index_topk",), 8),
    **dict.fromkeys((
        "q_lora_rank", "moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size",
        "moe_ffn_hidden_size", "global_head_dim",
    ), 32),
    **dict.fromkeys((
        "intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "ffn_hidden_size", "d_ff",
        "d_inner", "inner_hidden_size", "intermediate_size_mlp",
    ), 128),
    **dict.fromkeys((
        "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length", "seq_length",
        "max_target_positions", "max_source_positions",
    ), 512),
    **dict.fromkeys(("sliding_window", "attention_window_size", "local_window_size", "attention_chunk_size"), WINDOW),
    **dict.fromkeys(INIT_FIELDS, 0.2),
}  # fmt: skip
# Fields only some families have, shrunk wherever they are non-zero numbers (after the derived-field check).
LOW_RANKS: dict[str, int] = {
    "decoder_vocab_size": VOCAB, "rotary_dim": 8, "d_head": 16, "expand": 1, "mamba_expand": 1, "mamba_n_heads": 4,
    "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_n_groups": 1, "n_groups": 1, "mamba_d_conv": 4, "conv_kernel": 4,
}  # fmt: skip
# The few families the generic shrink cannot get right: model_type -> config values (a dict value under a
# sub-config's name applies to that sub-config).
QWEN4_EXP_INDEXER = dict(  # its defaults leave the sparse-attention indexer's sizes unset
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4,
    hc_lowrank=16,
)  # fmt: skip
COHERE_COMPASS_TEXT = dict(  # its defaults have no RoPE parameters: keyed by layer type, none on full layers
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": None},
)
TYPE_OVERRIDES: dict[str, dict[str, Any]] = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 2]], window_size=WINDOW),
    "zaya": dict(num_experts_per_tok=1),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),  # its defaults name no experts
    "deepseek_v2": dict(num_experts_per_tok=2),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 2, num_dense_layers=1),  # its defaults set no layers
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),  # its attention needs both, defaults lack them
    "zamba": dict(layers_block_type=["linear_attention", "hybrid"] * 2, attention_head_dim=32),
    # These use a pad id in their forward (positions, lengths); generate's is cleared after the build.
    "prophetnet": dict(pad_token_id=0),
    "reformer": dict(axial_pos_embds_dim=[32, 32], axial_pos_shape=[16, 32], pad_token_id=0),
    "xlm": dict(causal=True, pad_token_id=2),
    "dory": dict(n_input_layers=1, n_output_layers=1),  # 1 input, 2 recurrent, 1 output layer
    "bamba": dict(attn_layer_indices=[1, 3]),  # its defaults have no attention layer
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"] * 2),
    "qwen4_exp_text": QWEN4_EXP_INDEXER,
    "qwen4_exp": QWEN4_EXP_INDEXER,  # Qwen4ExpForCausalLM takes the text config
    "cohere_compass_text": COHERE_COMPASS_TEXT,
    "cohere_compass": dict(text_config=COHERE_COMPASS_TEXT),
}
# Set on the built model: Gemma 4's forward embeds the pad id where media placeholders sit (none in text
# prompts: any id serves); X-MOD needs a language adapter picked.
AFTER_BUILD: dict[str, Any] = {
    "gemma4": lambda model: object.__setattr__(model.config.get_text_config(), "pad_token_id", 0),
    "gemma4_unified": lambda model: object.__setattr__(model.config.get_text_config(), "pad_token_id", 0),
    "xmod": lambda model: model.set_default_language("en_XX"),
}
MEDIA = re.compile(r"image|video|audio|vision|media|boi|eoi|boa|eoa|bov|eov")
SPECIAL_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "forced_bos_token_id", "forced_eos_token_id")


class SweepTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so that no stage's `except Exception` swallows it."""


def first_line(error: BaseException, limit: int = 300) -> str:
    """The error's type and message on one line: its first line, and the next ones too when the first ends
    with a colon (hybridkv's refusals say why on the lines after "cannot serve ...:")."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    for line in lines[1:]:
        if not text.endswith(":"):
            break
        text += " " + line
    return f"{type(error).__name__}: {text}"[:limit]


# ---------------------------------------------------------------------------------------------------- building


def _layer_count(config) -> int | None:
    for name in LAYER_FIELDS:
        value = _raw(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _per_layer(values: list, n: int) -> list:
    """A per-layer list cut to n layers that keeps every kind the full list had (the missing ones go last):
    [S, S, S, S, S, F] * 8 -> [S, S, S, F]."""
    kinds = list(dict.fromkeys(values))
    out = list(values[:n])
    missing = [kind for kind in kinds if kind not in out]
    for i, kind in enumerate(reversed(missing)):
        if i < n:
            out[n - 1 - i] = kind
    return out


_MISSING = object()


def _raw(config, name: str, default: Any = _MISSING) -> Any:
    """A config field's stored value (Gemma 4 style configs refuse plain access to per-layer fields)."""
    stored = getattr(config, "__dict__", {})
    if name in stored:
        return stored[name]
    try:
        return getattr(config, name)
    except Exception:
        if default is _MISSING:
            raise
        return default


def _declared_defaults(config) -> dict[str, Any]:
    """Init field -> its declared default (`_MISSING` for factories); non-dataclass configs: every key."""
    if dataclasses.is_dataclass(config):
        return {
            f.name: f.default if f.default is not dataclasses.MISSING else _MISSING
            for f in dataclasses.fields(config)
            if f.init
        }
    return dict.fromkeys(config.to_dict(), _MISSING)


def _fit_mrope(rope: dict, head_dim: int, partial: float | None) -> dict:
    """Multimodal RoPE sections (time, height, width) rescaled to sum to half the tiny rotary dim."""
    rope = dict(rope)
    for key, value in rope.items():
        if isinstance(value, dict):
            rope[key] = _fit_mrope(value, head_dim, partial)
    sections = rope.get("mrope_section")
    if isinstance(sections, list | tuple) and sections and all(isinstance(v, int) for v in sections):
        half = int(head_dim * (rope.get("partial_rotary_factor") or partial or 1.0)) // 2
        fitted = [max(1, v * half // sum(sections)) for v in sections]
        fitted[-1] += half - sum(fitted)
        rope["mrope_section"] = fitted
    return rope


def shrunk_config(config, overrides: dict[str, Any] | None = None, init_range: float = 0.2):
    """A copy of `config` (built again from its values) with every known size field made tiny, per-layer
    lists cut to the new layer count, and each sub-config shrunk the same way.

    A field declared with default None whose value is what a default instance holds is left out: it was
    derived from other fields (a head dim, a layer-type list) and is derived again from the tiny ones."""
    declared = _declared_defaults(config)
    try:
        fresh = type(config)()
    except Exception:
        fresh = None
    old_layers = _layer_count(config)
    sub_configs = getattr(config, "sub_configs", {}) or {}
    overrides = overrides or {}
    # Layers that reuse earlier layers' K/V (Gemma 3n / 4): 2 more, each kind still computed before them.
    kv_shared = 2 if (_raw(config, "num_kv_shared_layers", 0) or 0) > 0 else 0
    n_layers = overrides.get("num_hidden_layers", LAYERS + kv_shared)

    def per_layer(values: list) -> list:
        if kv_shared:
            return _per_layer(values, n_layers - kv_shared) + _per_layer(values, kv_shared)
        return _per_layer(values, n_layers)

    kwargs: dict[str, Any] = {}
    nested: set[str] = set()
    for name, default in declared.items():
        value = _raw(config, name, _MISSING)
        if value is _MISSING or name in ("transformers_version", "architectures", "_name_or_path"):
            continue
        if name in sub_configs or isinstance(value, transformers.PreTrainedConfig):
            if isinstance(value, transformers.PreTrainedConfig):
                value = shrunk_config(value, overrides.get(name), init_range)
                nested.add(name)
            kwargs[name] = value
            continue
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        is_list = isinstance(value, list | tuple)
        if name in SHRINK:
            tiny = n_layers if name in LAYER_FIELDS else init_range if name in INIT_FIELDS else SHRINK[name]
            if (is_number and value != 0) or (value is None and name in ("head_dim", "num_key_value_heads")):
                value = tiny  # some defaults leave head_dim None, which their models cannot build from
            elif is_list and old_layers and len(value) == old_layers and all(isinstance(v, int) for v in value):
                value = [tiny] * n_layers  # one size per layer
            kwargs[name] = value
            continue
        if name == "num_kv_shared_layers" and kv_shared:
            kwargs[name] = kv_shared
            continue
        if (
            is_list
            and old_layers
            and name.endswith(("_layers", "indexes", "indices", "idxs", "_ids"))
            and all(isinstance(v, int) for v in value)
        ):
            kwargs[name] = [v for v in value if v < n_layers]  # layer indices: drop those past the last layer
            continue
        if is_list and old_layers and old_layers != n_layers and len(value) == old_layers:
            if all(not isinstance(v, list | dict) for v in value):
                kwargs[name] = per_layer(list(value))
            continue
        if default is None and fresh is not None and value is not None and _raw(fresh, name, None) == value:
            continue  # derived in __post_init__: derived again from the tiny values
        if name.endswith(("_layer_period", "_layer_offset")) and isinstance(value, int) and value >= n_layers:
            value = 2 if name.endswith("period") else 1  # a hybrid period / offset: keep each kind in 4 layers
        elif name in LOW_RANKS and is_number and value:
            value = LOW_RANKS[name]
        elif is_number and name.endswith(("_token_id", "_token_index")) and MEDIA.search(name) and value < VOCAB:
            value = VOCAB + 1 + len(kwargs)  # media placeholders: outside the vocabulary, never in a prompt
        kwargs[name] = value
    rope = kwargs.get("rope_parameters", _raw(config, "rope_parameters", None))
    if isinstance(rope, dict) and "mrope_section" in getattr(config, "ignore_keys_at_rope_validation", ()):
        rope = {"mrope_section": [16, 24, 24], **rope}  # Qwen2-VL-style models fall back to full-size sections
    if isinstance(rope, dict) and "mrope_section" in repr(rope):
        head_dim = kwargs.get("qk_rope_head_dim") or kwargs.get("head_dim") or 64 // 4
        kwargs["rope_parameters"] = _fit_mrope(rope, head_dim, kwargs.get("partial_rotary_factor"))
    if "kv_lora_rank" in kwargs:  # latent attention: head_dim is the rotary part, one KV head per query head
        if "head_dim" in declared and "qk_rope_head_dim" in kwargs:
            kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
        if "num_key_value_heads" in kwargs and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    if "is_decoder" in declared:
        kwargs["is_decoder"] = True
    for name in SPECIAL_IDS:
        if name in declared:
            kwargs[name] = None
    kwargs.update({k: v for k, v in overrides.items() if k not in nested})
    try:
        new = type(config)(**kwargs)
    except Exception:
        # Some configs insist on int special ids: build with the originals, clear them afterwards.
        for name in SPECIAL_IDS:
            if name in declared and name not in overrides:
                kwargs[name] = _raw(config, name, None)
        new = type(config)(**kwargs)
    for name in SPECIAL_IDS:
        if name not in overrides and _raw(new, name, None) is not None:
            object.__setattr__(new, name, None)
    for name, value in vars(config).items():  # attributes kept outside the fields (DBRX's rope_theta)
        if name not in vars(new) and not name.startswith("_") and name not in declared:
            object.__setattr__(new, name, value)
    return new


def model_class(model_type: str, class_name: str):
    cls = getattr(transformers, class_name, None)
    if cls is None:
        raise ImportError(f"transformers has no {class_name}")
    return cls


def build_model(model_type: str, class_name: str, init_range: float = 0.2) -> torch.nn.Module:
    cls = model_class(model_type, class_name)
    config_cls = getattr(cls, "config_class", None) or CONFIG_MAPPING[model_type]
    overrides = TYPE_OVERRIDES.get(model_type, {})
    config = shrunk_config(config_cls(), overrides, init_range)
    for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for name in SPECIAL_IDS:
            if name not in overrides and _raw(c, name, None) is not None:
                object.__setattr__(c, name, None)
    torch.manual_seed(0)
    model = cls(config).float().eval()
    # No special ids for generate either: it would mask out every prompt token equal to a pad id.
    if getattr(model, "generation_config", None) is not None:
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "forced_bos_token_id", "forced_eos_token_id"):
            setattr(model.generation_config, name, None)
    if model_type in AFTER_BUILD:
        AFTER_BUILD[model_type](model)
    return model


# ---------------------------------------------------------------------------------------------------- checking


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def reference(model, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [logits[0].float() for logits in out.logits]


def compare(run: str, refs, outputs) -> tuple[str, list[str]]:
    """("exact" | "tie" | "mismatch" | "error", details) for one hybridkv run against the references."""
    status, details = "exact", []
    for i, ((tokens, logits), output) in enumerate(zip(refs, outputs, strict=True)):
        if output.error:
            return "error", [f"{run}: prompt {i} ({PROMPT_LENGTHS[i]} tokens) failed: {output.error}"]
        got = list(output.outputs[0].token_ids)
        if got == tokens:
            continue
        common = min(len(got), len(tokens))
        step = next((j for j in range(common) if got[j] != tokens[j]), common)
        if step < len(logits) and step < common:
            top = torch.topk(logits[step], 2).values
            gap = float(top[0] - top[1])
        else:
            gap = math.inf  # a length difference
        kind = "tie" if gap < TIE_GAP else "mismatch"
        details.append(
            f"{run}: prompt {i} ({PROMPT_LENGTHS[i]} tokens) differs at new token {step} "
            f"(hf {tokens[step] if step < len(tokens) else '-'} vs hybridkv {got[step] if step < len(got) else '-'}, "
            f"top-2 gap {gap:.3g}){' [tie]' if kind == 'tie' else ''}"
        )
        status = max(status, kind, key=RANK.__getitem__)
    return status, details


RANK = {"exact": 0, "tie": 1, "error": 2, "mismatch": 3}


def weakness(batch: list[list[int]], outputs: list[list[int]], variant_output: list[int]) -> str | None:
    """Why transformers' greedy tokens make a weak test, or None: the same for every prompt, each prompt's
    last token echoed, or blind to the first token of the 40-token prompt."""
    if len({tuple(tokens) for tokens in outputs}) == 1:
        return "the same tokens for every prompt"
    if all(set(tokens) == {prompt[-1]} for prompt, tokens in zip(batch, outputs, strict=True)):
        return "each prompt's last token, repeated"
    if variant_output == outputs[1]:
        return f"the same tokens when the first of {PROMPT_LENGTHS[1]} prompt tokens changes"
    return None


def tiny_model_and_references(model_type: str, class_name: str, batch: list[list[int]]):
    """The first of `INIT_RANGES` whose model makes a strong test (else the first that built): the model,
    transformers' references (tokens, logits) per prompt, the range, and the weakness if any."""
    variant = [(batch[1][0] + 1) % VOCAB, *batch[1][1:]]
    first = None
    for i, init_range in enumerate(INIT_RANGES):
        try:
            model = build_model(model_type, class_name, init_range)
        except Exception as error:
            if i == 0:
                raise BuildError("build: " + first_line(error)) from error
            continue
        try:
            refs = [reference(model, prompt) for prompt in batch]
            weak = weakness(batch, [tokens for tokens, _ in refs], reference(model, variant)[0])
        except Exception as error:
            if i == 0:
                raise BuildError("transformers generate: " + first_line(error)) from error
            continue
        if weak is None:
            return model, refs, init_range, None
        if first is None:
            first = (model, refs, init_range, weak)
    return first


class BuildError(Exception):
    pass


def _hybridkv_dirs() -> tuple[str, ...]:
    import hybridkv.kernels
    import hybridkv.patches

    packages = (hybridkv, hybridkv.patches, hybridkv.kernels)
    return tuple(os.path.realpath(d) + os.sep for package in packages for d in package.__path__)


def raised_in(error: BaseException) -> str | None:
    """None when hybridkv's own code raised `error` (a refusal); else the file that did (a crash in a model's or
    torch's code that patch ran into, which is no refusal)."""
    tb = error.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = os.path.realpath(tb.tb_frame.f_code.co_filename)
    if path.startswith(_hybridkv_dirs()):
        return None
    parts = path.split(os.sep)
    return os.sep.join(parts[parts.index("site-packages") + 1 :] if "site-packages" in parts else parts[-2:])


def check_type(model_type: str, class_name: str) -> dict[str, Any]:
    result: dict[str, Any] = {"type": model_type, "class": class_name}
    batch = prompts()
    try:
        model, refs, result["init_range"], weak = tiny_model_and_references(model_type, class_name, batch)
    except SweepTimeout:
        raise
    except BuildError as error:
        return {**result, "status": "unbuildable", "detail": str(error)}
    result["params"] = sum(p.numel() for p in model.parameters())
    result["reference"] = [tokens for tokens, _ in refs]
    if weak:
        result["note"] = f"weak test: transformers gives {weak} (initializer ranges {INIT_RANGES})"
    params = hybridkv.SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS)
    status, details = "exact", []
    try:
        for run, settings in (("default", PATCH_SETTINGS), ("chunked", CHUNKED_SETTINGS)):
            hybridkv.unpatch(model)
            try:
                llm = hybridkv.patch(model, **settings)
            except REFUSALS as error:
                origin = raised_in(error)
                if run == "default" and origin is None:
                    return {**result, "status": "refused", "detail": first_line(error)}
                result["traceback"] = traceback.format_exc()
                where = f" (raised in {origin})" if origin else ""
                return {**result, "status": "error", "detail": f"patch ({run}): {first_line(error)}{where}"}
            outputs = llm.generate(batch, params, use_tqdm=False)
            result[f"hybridkv_{run}"] = [list(o.outputs[0].token_ids) if o.outputs else [] for o in outputs]
            run_status, run_details = compare(run, refs, outputs)
            details += run_details
            status = max(status, run_status, key=RANK.__getitem__)
    except SweepTimeout:
        raise
    except Exception as error:
        result["traceback"] = traceback.format_exc()
        return {**result, "status": "error", "detail": first_line(error)}
    finally:
        with contextlib.suppress(Exception):
            hybridkv.unpatch(model)
    if result["init_range"] != INIT_RANGES[0]:
        details.insert(0, f"initializer range {result['init_range']}")
    if "note" in result:
        details.append(result["note"])
    return {**result, "status": status, "detail": "; ".join(details)}


def _alarm(signum, frame):
    raise SweepTimeout()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: every causal-LM type + extras)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per type (default 60)")
    parser.add_argument("--image-text", action="store_true", help="also the image-text-to-text mapping's types")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()

    catalog = dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    extras = dict(EXTRA_TYPES)
    if args.image_text:
        extras.update({t: c for t, c in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items() if t not in catalog})
    for model_type, class_name in extras.items():
        catalog.setdefault(model_type, class_name)
    if args.types:
        wanted = [t.strip() for t in args.types.split(",") if t.strip()]
        unknown = [t for t in wanted if t not in catalog and t not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES]
        if unknown:
            parser.error(f"unknown model types: {', '.join(unknown)}")
        catalog = {t: catalog.get(t) or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[t] for t in wanted}

    print(f"hybridkv from {hybridkv.__file__}, transformers {transformers.__version__}, torch {torch.__version__}")
    signal.signal(signal.SIGALRM, _alarm)
    results = []
    start = time.perf_counter()
    for model_type, class_name in catalog.items():
        if isinstance(class_name, tuple | list):
            class_name = class_name[0]
        began = time.perf_counter()
        signal.alarm(args.timeout)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # some models print from their forward
                result = check_type(model_type, class_name)
        except SweepTimeout:
            result = {"type": model_type, "class": class_name, "status": "timeout", "detail": f">{args.timeout} s"}
        finally:
            signal.alarm(0)
        result["seconds"] = round(time.perf_counter() - began, 2)
        results.append(result)
        print(f"{model_type:<28} {result['status']:<11} {result['seconds']:6.1f}s  {result['detail']}", flush=True)

    counts: dict[str, int] = {}
    for result in results:
        counts[result["status"]] = counts.get(result["status"], 0) + 1
    order = ("mismatch", "error", "timeout", "unbuildable", "refused", "tie", "exact")
    summary = ", ".join(f"{counts[s]} {s}" for s in order if s in counts)
    print(f"\n{len(results)} types in {time.perf_counter() - start:.0f} s: {summary}")
    for status in ("mismatch", "error"):
        names = [r["type"] for r in results if r["status"] == status]
        if names:
            print(f"{status}: {', '.join(names)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "results": results}, f,
                      indent=1)  # fmt: skip
    sys.exit(0)


if __name__ == "__main__":
    main()
