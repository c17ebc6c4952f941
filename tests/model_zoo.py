"""A zoo of tiny random transformers models, one builder per `model_type`, built from configs (no downloads).

`ZOO` holds decoders whose attention a paged KV cache can serve: full, sliding-window and hybrid layouts,
MoE, attention sinks, softcapping, layers without RoPE, KV shared across layers, and multimodal wrappers fed
text only. It re-exports every family of tests/tiny_models.py (`FAMILIES`) and adds the other transformers
5.23 model types that gave `generate`'s exact greedy tokens through hybridkv. `REFUSED` holds families
hybridkv must refuse, because their layers keep something it cannot serve exactly: a recurrent state in a
cache of their own or a scan that ignores the state it is given, multi-head latent attention, sparse or
compressed attention. `STATE` holds the families with state layers (linear attention, Mamba2, short
convolutions) beside attention, whose states hybridkv keeps in state slots. `KV_LAYOUTS` holds the served
layouts beyond one K/V shape: per-layer head dims and head counts (Gemma 4, MiMo-V2-Flash), KV-sharing
layers, chunked local attention (Llama 4).

Every builder seeds torch with 0 and returns an fp32 model in eval() mode with a 256-token vocabulary,
hidden size 64, 2-6 layers, and windows (`WINDOW`, 16) shorter than the test prompts so that they really
slide. Initializer ranges are tuned per model so that greedy output is not one repeated token and changes
when the first token of a 40-token prompt changes; for hybrid models also of a 150-token prompt, where
the first token lies outside every window and reaches the output only through the full layers. (Some
FAMILIES builders fail this: see `tiny_models`.) Multimodal wrappers keep their image/video token ids
outside the vocabulary, so random prompts never hold one. `LAYER_KINDS` describes each tiny model's
layer layout as built, for `ZOO` and `REFUSED`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
from transformers import PreTrainedModel
from transformers import models as hf

from hybridkv import tiny
from hybridkv.tiny import tiny_model

from tiny_models import COMMON, FAMILIES, VOCAB, WINDOW

# The fast tier (`pytest -m "not slow"`) runs each zoo-wide test on these cheap families, one per kind of layer
# the paged cache serves: full attention, sliding windows beside full layers (with attention sinks), state layers,
# multi-head latent attention and per-layer K/V shapes. The full suite runs every family.
FAST_FAMILIES = ("llama", "gpt_oss", "lfm2", "minicpm3", "gemma4_text")


def slow_except(names, fast=FAST_FAMILIES):
    """`names` as parametrize cases (same ids), each marked slow unless it is one of `fast`."""
    return [name if name in fast else pytest.param(name, marks=pytest.mark.slow) for name in names]


class _RoutedLoop(torch.nn.Module):
    """An MLP run only for the routes its rows pick, in a Python loop over them, as MoE experts that loop over the
    experts a router picked do: data-dependent, so torch.compile(fullgraph=True) cannot trace it."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.inner = mlp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        route = hidden[..., 0] > 0
        for picked in torch.unique(route).tolist():
            rows = route == picked
            out[rows] = self.inner(hidden[rows])
        return out


def untraceable_llama() -> PreTrainedModel:
    """A tiny Llama whose MLPs loop over routes (`_RoutedLoop`): a model dynamo cannot trace whole on every
    transformers version (Step3p7's experts were one until 5.25)."""
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.mlp = _RoutedLoop(layer.mlp)
    return model


S, F = "sliding_attention", "full_attention"
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
SIGLIP_TINY = dict(  # one 2 x 2-patch image -> 4 soft tokens
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)


def _tiny(model_cls, config) -> PreTrainedModel:
    # No special ids: some configs insist on ints (or swap None for ids outside the vocabulary), and
    # `generate` masks out every prompt token equal to the pad id. Strict fields typed `int` refuse None
    # through setattr, hence object.__setattr__.
    for c in (config, config.get_text_config()):
        for field in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(c, field, None) is not None:
                object.__setattr__(c, field, None)
    torch.manual_seed(0)
    return model_cls(config).eval()


def _build(model_cls, config_cls, **kwargs) -> PreTrainedModel:
    return _tiny(model_cls, config_cls(**{**COMMON, **kwargs}))


def _gemma3():
    m = hf.gemma3
    text = dict(
        COMMON,
        num_hidden_layers=6,
        head_dim=16,
        sliding_window=WINDOW,
        initializer_range=0.3,  # with 6 untied layers this does not collapse (0.03 is weakly dependent)
        tie_word_embeddings=False,
    )
    config = m.Gemma3Config(
        text_config=text,
        vision_config=SIGLIP_TINY,
        mm_tokens_per_image=4,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    return _tiny(m.Gemma3ForConditionalGeneration, config)


def _gemma3n_text():
    m = hf.gemma3n
    return _build(
        m.Gemma3nForCausalLM,
        m.Gemma3nTextConfig,
        num_hidden_layers=6,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=[S, S, F, S, S, F],
        num_kv_shared_layers=3,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        altup_num_inputs=2,
        laurel_rank=8,
        initializer_range=0.15,
        tie_word_embeddings=False,
    )


def _step3p7():
    m = hf.step3p7
    text = dict(
        COMMON,
        num_hidden_layers=4,
        head_dim=16,
        layer_types=[S, S, S, F],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        sliding_window=WINDOW,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        share_expert_dim=32,
        pad_token_id=0,  # must be an int here; _tiny clears it
        initializer_range=0.2,
    )
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    config = m.Step3p7Config(text_config=text, vision_config=vision)
    return _tiny(m.Step3p7ForConditionalGeneration, config)


def _cohere_compass():
    m = hf.cohere_compass
    text = dict(
        COMMON,
        num_hidden_layers=4,
        layer_types=[S, S, S, F],
        sliding_window=WINDOW,
        # keyed by layer type; full layers run without RoPE; M-RoPE sections sum to head_dim / 2
        rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}, F: None},
        initializer_range=0.1,
    )
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, deepstack_visual_indexes=[0]
    )
    config = m.CohereCompassConfig(text_config=text, vision_config=vision)
    return _tiny(m.CohereCompassForConditionalGeneration, config)


def _cwm():
    m = hf.cwm
    config = m.CwmConfig(
        **{**COMMON, "bos_token_id": 0},  # must be an int here; _tiny clears it
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        initializer_range=0.1,
    )
    return _tiny(m.CwmForCausalLM, config)  # eos None made __post_init__ pick Llama 3's: _tiny clears them


NEW = {
    "gemma3": _gemma3,
    "gemma3n_text": _gemma3n_text,
    "olmo2": lambda: _build(
        hf.olmo2.Olmo2ForCausalLM, hf.olmo2.Olmo2Config, num_hidden_layers=2, initializer_range=0.2
    ),
    "olmo3": lambda: _build(
        hf.olmo3.Olmo3ForCausalLM,
        hf.olmo3.Olmo3Config,
        num_hidden_layers=4,
        sliding_window=WINDOW,
        layer_types=[S, S, S, F],
        initializer_range=0.3,
    ),
    "smollm3": lambda: _build(
        hf.smollm3.SmolLM3ForCausalLM, hf.smollm3.SmolLM3Config, num_hidden_layers=4, initializer_range=0.3
    ),
    "exaone4": lambda: _build(
        hf.exaone4.Exaone4ForCausalLM,
        hf.exaone4.Exaone4Config,
        num_hidden_layers=4,
        sliding_window=WINDOW,
        sliding_window_pattern=4,
        initializer_range=0.2,
    ),
    "exaone_moe": lambda: _build(
        hf.exaone_moe.ExaoneMoeForCausalLM,
        hf.exaone_moe.ExaoneMoeConfig,
        num_hidden_layers=4,
        sliding_window=WINDOW,
        sliding_window_pattern=4,
        num_experts=4,
        num_shared_experts=1,
        **MOE,
        initializer_range=0.02,
    ),
    "kolibri1": lambda: _build(
        hf.kolibri1.Kolibri1ForCausalLM,
        hf.kolibri1.Kolibri1Config,
        num_hidden_layers=5,
        head_dim=16,
        sliding_window=WINDOW,
        num_local_experts=4,
        shared_expert_intermediate_size=32,
        **MOE,
        initializer_range=0.15,
    ),
    "qwen2_moe": lambda: _build(
        hf.qwen2_moe.Qwen2MoeForCausalLM,
        hf.qwen2_moe.Qwen2MoeConfig,
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=4,  # even layers below max_window_layers slide
        num_experts=4,
        shared_expert_intermediate_size=32,
        **MOE,
        initializer_range=0.3,
    ),
    "qwen3_moe": lambda: _build(
        hf.qwen3_moe.Qwen3MoeForCausalLM,
        hf.qwen3_moe.Qwen3MoeConfig,
        num_hidden_layers=2,
        head_dim=16,
        num_experts=4,
        **MOE,
        initializer_range=0.3,
    ),
    "mixtral": lambda: _build(
        hf.mixtral.MixtralForCausalLM,
        hf.mixtral.MixtralConfig,
        num_hidden_layers=3,  # sliding on every layer: 3 layers of 16-token windows reach back over 40 tokens
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        initializer_range=0.2,
    ),
    "gemma": lambda: _build(
        hf.gemma.GemmaForCausalLM,
        hf.gemma.GemmaConfig,
        num_hidden_layers=2,
        head_dim=16,
        initializer_range=0.07,
        tie_word_embeddings=False,
    ),
    "starcoder2": lambda: _build(
        hf.starcoder2.Starcoder2ForCausalLM,
        hf.starcoder2.Starcoder2Config,
        num_hidden_layers=4,  # 3 layers of 16-token windows reach back over a 40-token prompt, 4 depend on it
        sliding_window=WINDOW,
        initializer_range=0.3,
    ),
    "glm4": lambda: _build(
        hf.glm4.Glm4ForCausalLM, hf.glm4.Glm4Config, num_hidden_layers=2, head_dim=16, initializer_range=0.3
    ),
    "granite": lambda: _build(
        hf.granite.GraniteForCausalLM, hf.granite.GraniteConfig, num_hidden_layers=2, initializer_range=0.2
    ),
    "granite_swa": lambda: _build(
        hf.granite_swa.GraniteSWAForCausalLM,
        hf.granite_swa.GraniteSWAConfig,
        num_hidden_layers=4,
        sliding_window=WINDOW,
        initializer_range=0.15,
    ),
    "granitemoe_swa": lambda: _build(
        hf.granitemoe_swa.GraniteMoeSWAForCausalLM,
        hf.granitemoe_swa.GraniteMoeSWAConfig,
        num_hidden_layers=4,
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        initializer_range=0.1,
    ),
    "cohere2_moe": lambda: _build(
        hf.cohere2_moe.Cohere2MoeForCausalLM,
        hf.cohere2_moe.Cohere2MoeConfig,
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=WINDOW,
        sliding_window_pattern=4,
        num_experts=4,
        num_experts_per_tok=2,
        initializer_range=0.25,
    ),
    "afmoe": lambda: _build(
        hf.afmoe.AfmoeForCausalLM,
        hf.afmoe.AfmoeConfig,
        num_hidden_layers=4,
        head_dim=16,
        num_dense_layers=1,
        global_attn_every_n_layers=4,
        sliding_window=WINDOW,
        num_experts=4,
        num_shared_experts=1,
        **MOE,
        initializer_range=0.3,
    ),
    "laguna": lambda: _build(
        hf.laguna.LagunaForCausalLM,
        hf.laguna.LagunaConfig,
        num_hidden_layers=4,
        head_dim=16,
        layer_types=[S, S, S, F],
        sliding_window=WINDOW,
        num_experts=4,
        shared_expert_intermediate_size=32,
        **MOE,
        initializer_range=0.2,
    ),
    "step3p7": _step3p7,
    "mellum": lambda: _build(
        hf.mellum.MellumForCausalLM,
        hf.mellum.MellumConfig,
        num_hidden_layers=4,
        head_dim=16,
        layer_types=[S, S, S, F],
        sliding_window=WINDOW,
        num_local_experts=4,
        **MOE,
        initializer_range=0.2,
    ),
    "flint": lambda: _build(
        hf.flint.FlintForCausalLM,
        hf.flint.FlintConfig,
        num_hidden_layers=4,
        head_dim=16,
        layer_types=[F, S, S, F],
        mlp_only_layers=[0],
        sliding_window=WINDOW,
        num_experts=4,
        shared_expert_intermediate_size=32,
        **MOE,
        initializer_range=0.15,
    ),
    "dots1": lambda: _build(
        hf.dots1.Dots1ForCausalLM,
        hf.dots1.Dots1Config,
        num_hidden_layers=3,
        sliding_window=WINDOW,
        max_window_layers=1,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        **MOE,
        initializer_range=0.15,
    ),
    "beam": lambda: _build(
        hf.beam.BeamForCausalLM,
        hf.beam.BeamConfig,
        num_hidden_layers=4,
        head_dim=16,
        layer_types=[S, S, S, F],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        sliding_window=WINDOW,
        num_experts=4,
        n_group=1,
        topk_group=1,
        **MOE,
        initializer_range=0.03,
    ),
    "cwm": _cwm,
    "vaultgemma": lambda: _build(
        hf.vaultgemma.VaultGemmaForCausalLM,
        hf.vaultgemma.VaultGemmaConfig,
        num_hidden_layers=4,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        initializer_range=0.2,
        tie_word_embeddings=False,
    ),
    "cohere_compass": _cohere_compass,
}


def _cohere2_vision():
    m = hf.cohere2_vision
    text = dict(COMMON, model_type="cohere2", num_hidden_layers=4, sliding_window=WINDOW, initializer_range=0.08)
    config = m.Cohere2VisionConfig(
        text_config=text, vision_config=SIGLIP_TINY, alignment_intermediate_size=64, tie_word_embeddings=False
    )
    return _tiny(m.Cohere2VisionForConditionalGeneration, config)


def _exaone4_5():
    m = hf.exaone4_5
    text = dict(
        COMMON,
        model_type="exaone4",
        num_hidden_layers=4,
        sliding_window=WINDOW,
        sliding_window_pattern=4,
        initializer_range=0.2,
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        num_key_value_heads=2,
        out_hidden_size=64,
        fullatt_block_indexes=[0],
    )
    # its image / video token ids default to 67 / 68, inside the tiny vocabulary: move them out of it
    config = m.Exaone4_5_Config(text_config=text, vision_config=vision, image_token_id=VOCAB, video_token_id=VOCAB + 1)
    return _tiny(m.Exaone4_5_ForConditionalGeneration, config)


def _muse_glimmer():
    m = hf.muse_glimmer
    text = dict(COMMON, num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, initializer_range=0.2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = m.MuseGlimmerConfig(text_config=text, vision_config=vision, out_hidden_size=64, projector_hidden_size=64)
    return _tiny(m.MuseGlimmerForConditionalGeneration, config)


EXTRA = {
    "cohere2_vision": _cohere2_vision,
    "exaone4_5": _exaone4_5,
    "muse_glimmer": _muse_glimmer,
    "modernbert-decoder": lambda: _build(
        hf.modernbert_decoder.ModernBertDecoderForCausalLM,
        hf.modernbert_decoder.ModernBertDecoderConfig,
        num_hidden_layers=4,
        global_attn_every_n_layers=3,
        local_attention=2 * WINDOW,  # the decoder's window is half of local_attention
        pad_token_id=0,  # pad and bos must be ints here; _tiny clears them
        bos_token_id=0,
        initializer_range=0.3,
    ),
    "phimoe": lambda: _build(
        hf.phimoe.PhimoeForCausalLM,
        hf.phimoe.PhimoeConfig,
        num_hidden_layers=3,
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        initializer_range=0.2,
    ),
    # Absolute position embeddings: positions reach the model through position_ids, not RoPE.
    "gpt2": lambda: _tiny(
        hf.gpt2.GPT2LMHeadModel,
        hf.gpt2.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.3),
    ),
}

GEMMA4_TEXT = dict(
    COMMON,
    head_dim=16,
    global_head_dim=32,  # full layers use a wider head than sliding ones
    sliding_window=WINDOW,
    vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=8,
    initializer_range=0.03,
    tie_word_embeddings=False,
)


def _gemma4():
    """Like Gemma 4 E2B/E4B: the full layers' K/V cost twice the sliding layers' bytes per token, and the
    last two layers reuse the K/V of layers 3 (sliding) and 2 (full)."""
    m = hf.gemma4
    text = dict(GEMMA4_TEXT, num_hidden_layers=6, layer_types=[S, S, F, S, S, F], num_kv_shared_layers=2)
    special = ("image_token_id", "video_token_id", "audio_token_id", "boi_token_id", "eoi_token_id", "boa_token_id")
    config = m.Gemma4Config(
        text_config=text,
        vision_config=None,
        audio_config=None,
        tie_word_embeddings=False,
        eoa_token_index=VOCAB + len(special),
        **{field: VOCAB + i for i, field in enumerate(special)},
    )
    model = _tiny(m.Gemma4ForConditionalGeneration, config)
    # Its forward embeds the pad id where media placeholders sit (none in text prompts): any id serves.
    model.config.text_config.pad_token_id = 0
    return model


KV_LAYOUTS = {
    # Like Gemma 4 31B / 26B-A4B: full layers hold fewer, wider heads with V from the K projection,
    # half the sliding layers' bytes per token.
    "gemma4_text": lambda: _build(
        hf.gemma4.Gemma4ForCausalLM,
        hf.gemma4.Gemma4TextConfig,
        **{
            **GEMMA4_TEXT,
            "num_hidden_layers": 4,
            "layer_types": [S, S, S, F],
            "num_key_value_heads": 4,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
        },
    ),
    # Chunked local attention (chunks of 16) on 3 of 4 layers; the full layer has no RoPE.
    "llama4_text": lambda: _build(
        hf.llama4.Llama4ForCausalLM,
        hf.llama4.Llama4TextConfig,
        num_hidden_layers=4,
        head_dim=16,
        attention_chunk_size=WINDOW,
        intermediate_size_mlp=128,
        num_local_experts=4,
        num_experts_per_tok=1,
        initializer_range=0.2,
    ),
    "gemma4": _gemma4,
    "mimo_v2_flash": lambda: _build(
        hf.mimo_v2_flash.MiMoV2FlashForCausalLM,
        hf.mimo_v2_flash.MiMoV2FlashConfig,
        num_hidden_layers=4,
        head_dim=24,
        v_head_dim=16,  # K head dim != V head dim; sliding layers get twice the kv heads
        layer_types=[S, S, S, F],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        sliding_window=WINDOW,
        n_routed_experts=4,
        **MOE,
        initializer_range=0.2,
    ),
}

LIN = "linear_attention"

# State layers (linear attention, SSM, short convolution) beside attention: a per-request state each, held in
# state slots (hybridkv/execution/state_layers.py). Each builder's state reaches its output: the first of 40 prompt
# tokens changes the greedy tokens (tests/test_model_zoo.py), and the step check continues a prompt from it.
STATE = {
    "lfm2_moe": lambda: _build(
        hf.lfm2_moe.Lfm2MoeForCausalLM,
        hf.lfm2_moe.Lfm2MoeConfig,
        num_hidden_layers=4,
        layer_types=["conv", F, "conv", F],
        num_dense_layers=2,
        num_experts=4,
        **MOE,
        initializer_range=0.2,
    ),
    "olmo_hybrid": lambda: _build(
        hf.olmo_hybrid.OlmoHybridForCausalLM,
        hf.olmo_hybrid.OlmoHybridConfig,
        num_hidden_layers=4,
        layer_types=[LIN, LIN, LIN, F],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        initializer_range=0.3,  # at 0.5 its tokens do not depend on the prompt's first token
    ),
    "qwen3_next": lambda: _build(  # hybridkv.tiny's qwen3_5 layers, with MoE
        hf.qwen3_next.Qwen3NextForCausalLM,
        hf.qwen3_next.Qwen3NextConfig,
        **tiny.FAMILIES["qwen3_5"].config_values,
        num_experts=4,
        shared_expert_intermediate_size=32,
        **MOE,
    ),
    "lfm2": lambda: _build(
        hf.lfm2.Lfm2ForCausalLM,
        hf.lfm2.Lfm2Config,
        num_hidden_layers=4,
        layer_types=["conv", F, "conv", F],
        block_auto_adjust_ff_dim=False,
        initializer_range=0.1,
    ),
    "lfm3": lambda: _build(
        hf.lfm3.Lfm3ForCausalLM,
        hf.lfm3.Lfm3Config,
        num_hidden_layers=5,  # conv, conv, full, conv, sliding
        head_dim=16,
        sliding_window=WINDOW,
        initializer_range=0.2,
    ),
    "qwen3_5_text": partial(tiny_model, "qwen3_5"),  # 3 Gated DeltaNet : 1 full
    "bamba": partial(tiny_model, "bamba"),  # 3 Mamba2 : 1 full
    "granitemoehybrid": lambda: _build(
        hf.granitemoehybrid.GraniteMoeHybridForCausalLM,
        hf.granitemoehybrid.GraniteMoeHybridConfig,
        num_hidden_layers=4,
        layer_types=[LIN, LIN, LIN, "attention"],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_expand=1,
        mamba_chunk_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
        initializer_range=0.2,
    ),
    "nemotron_h": lambda: _build(
        hf.nemotron_h.NemotronHForCausalLM,
        hf.nemotron_h.NemotronHConfig,
        layers_block_type=[LIN, "moe", F, LIN, "mlp", F],
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        chunk_size=32,
        n_groups=1,
        n_routed_experts=4,
        n_shared_experts=1,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        num_experts_per_tok=2,
        initializer_range=0.2,
    ),
    "zaya": lambda: _build(  # its attention's q/k/v projection holds a conv state and a recurrent value state
        hf.zaya.ZayaForCausalLM,
        hf.zaya.ZayaConfig,
        num_hidden_layers=4,
        layer_types=["hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding"],
        sliding_window=WINDOW,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        router_hidden_size=16,
        initializer_range=0.5,  # below, its greedy tokens repeat one token (the test would be weak)
    ),
    "jamba": lambda: _build(  # Mamba-1 (state), continued from its carried state: execution/state_continuations.py
        hf.jamba.JambaForCausalLM,
        hf.jamba.JambaConfig,
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_dt_rank=8,
        initializer_range=0.2,
    ),
    "zamba2": lambda: _build(  # two shared attention blocks, the first used at depths 0 and 4, each use its own K/V
        hf.zamba2.Zamba2ForCausalLM,
        hf.zamba2.Zamba2Config,
        num_hidden_layers=5,
        layers_block_type=["hybrid", "mamba", "hybrid", "mamba", "hybrid"],
        num_mem_blocks=2,
        use_shared_attention_adapter=True,  # per-use LoRA on the shared block's q, k and v
        adapter_rank=8,
        use_mem_rope=True,
        num_key_value_heads=4,  # the adapters' outputs are added to K and V: as wide as the block's input, as published
        mamba_d_state=8,
        n_mamba_heads=8,
        mamba_headdim=8,
        mamba_expand=1,
        chunk_size=32,
        attention_head_dim=32,
        initializer_range=0.2,
    ),
    "minimax": lambda: _build(  # lightning attention continued in its block form: execution/state_continuations.py
        hf.minimax.MiniMaxForCausalLM,
        hf.minimax.MiniMaxConfig,
        num_hidden_layers=4,
        head_dim=16,
        layer_types=[LIN, LIN, LIN, F],
        block_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        initializer_range=0.2,
    ),
    "recurrent_gemma": lambda: _tiny(  # its blocks keep their state on themselves: patches/own_state.py
        hf.recurrent_gemma.RecurrentGemmaForCausalLM,
        hf.recurrent_gemma.RecurrentGemmaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,  # recurrent, recurrent, local attention
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            lru_width=64,
            attention_window_size=WINDOW,
            w_init_variance_scale=0.5,  # its own init knobs, not initializer_range
            final_w_init_variance_scale=1.0,
            pad_token_id=0,  # _tiny clears it
            bos_token_id=None,
            eos_token_id=None,
        ),
    ),
    "falcon_h1": lambda: _build(
        hf.falcon_h1.FalconH1ForCausalLM,
        hf.falcon_h1.FalconH1Config,
        num_hidden_layers=3,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_expand=1,
        mamba_chunk_size=32,
        head_dim=16,
        initializer_range=0.2,
    ),
}

ZOO: dict[str, Callable[[], PreTrainedModel]] = {**FAMILIES, **NEW, **EXTRA, **KV_LAYOUTS, **STATE}


MLA = dict(  # multi-head latent attention: K/V are projected from a shared latent, K 24 / V 16 per head
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
)


# Multi-head latent attention (hybridkv/patches/latent.py): paged as the latent and the rotary key each layer hands its
# cache.
LATENT = {
    "deepseek_v2": lambda: _build(
        hf.deepseek_v2.DeepseekV2ForCausalLM, hf.deepseek_v2.DeepseekV2Config, num_hidden_layers=2, **MLA, **MOE,
        initializer_range=0.2,
    ),
    "deepseek_v3": lambda: _build(
        hf.deepseek_v3.DeepseekV3ForCausalLM, hf.deepseek_v3.DeepseekV3Config, num_hidden_layers=2, **MLA, **MOE,
        initializer_range=0.2,
    ),
    "minicpm3": lambda: _build(
        hf.minicpm3.MiniCPM3ForCausalLM, hf.minicpm3.MiniCPM3Config, num_hidden_layers=2, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        initializer_range=0.5,  # 0.2 collapses to a few tokens
    ),
    # 3 Kimi Delta Attention (state) : 1 latent attention
    "kimi_linear": lambda: _build(
        hf.kimi_linear.KimiLinearForCausalLM,
        hf.kimi_linear.KimiLinearConfig,
        num_hidden_layers=4,
        layer_types=[LIN, LIN, LIN, F],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        linear_num_heads=4,
        linear_head_dim=16,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        initializer_range=0.2,
    ),
    # 3 linear attention (state) : 1 latent attention with an output gate
    "bailing_hybrid": lambda: _build(
        hf.bailing_hybrid.BailingHybridForCausalLM, hf.bailing_hybrid.BailingHybridConfig, num_hidden_layers=4,
        layer_group_size=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, initializer_range=0.2,
    ),
}  # fmt: skip

ZOO.update(LATENT)


def _bart_decoder(module: str, model_cls: str, config_cls: str, **extra) -> PreTrainedModel:
    """A BART-family decoder alone (`...ForCausalLM`): learned position embeddings taken from the cache's
    length, not from position_ids, so a step of several sequences embeds them at the wrong positions."""
    m = getattr(hf, module)
    config = getattr(m, config_cls)(
        vocab_size=VOCAB,
        d_model=64,
        decoder_layers=2,
        encoder_layers=2,
        decoder_attention_heads=4,
        encoder_attention_heads=4,
        decoder_ffn_dim=128,
        encoder_ffn_dim=128,
        max_position_embeddings=512,
        is_decoder=True,
        is_encoder_decoder=False,
        init_std=0.2,
        **extra,
    )
    return _tiny(getattr(m, model_cls), config)


def _paligemma():
    """PaliGemma's language model attends bidirectionally over the prompt (is_causal=False: a prefix-LM)."""
    m = hf.paligemma
    text = dict(
        COMMON, model_type="gemma", num_hidden_layers=2, head_dim=16, initializer_range=0.3, tie_word_embeddings=False
    )
    config = m.PaliGemmaConfig(text_config=text, vision_config=SIGLIP_TINY, image_token_index=VOCAB)
    return _tiny(m.PaliGemmaForConditionalGeneration, config)


REFUSED: dict[str, Callable[[], PreTrainedModel]] = {
    "mamba2": lambda: _build(
        hf.mamba2.Mamba2ForCausalLM,
        hf.mamba2.Mamba2Config,
        num_heads=4,
        head_dim=16,
        state_size=8,
        expand=1,
        n_groups=1,
        chunk_size=32,
        initializer_range=0.2,
    ),
    "deepseek_v32": lambda: _build(
        hf.deepseek_v32.DeepseekV32ForCausalLM,
        hf.deepseek_v32.DeepseekV32Config,
        num_hidden_layers=2,
        **MLA,
        index_topk=8,  # each query attends to the 8 keys its indexer picks
        index_head_dim=16,
        index_n_heads=2,
        **MOE,
        initializer_range=0.2,
    ),
    "deepseek_v4": lambda: _tiny(
        hf.deepseek_v4.DeepseekV4ForCausalLM,
        hf.deepseek_v4.DeepseekV4Config(
            vocab_size=VOCAB,
            hidden_size=64,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=8,
            sliding_window=WINDOW,
            n_routed_experts=4,
            num_experts_per_tok=2,
            num_nextn_predict_layers=0,
            max_position_embeddings=512,
            bos_token_id=0,  # must be an int here; _tiny clears it
            eos_token_id=None,
            initializer_range=0.2,
        ),
    ),
    # Found by a sweep of every causal LM type (benchmarks/causal_lm_sweep.py): the layer checks pass, the steps
    # give other tokens; the end-to-end check of patch (hybridkv/execution/step_check.py) refuses them.
    "bart": lambda: _bart_decoder("bart", "BartForCausalLM", "BartConfig"),
    "mbart": lambda: _bart_decoder("mbart", "MBartForCausalLM", "MBartConfig"),
    "marian": lambda: _bart_decoder("marian", "MarianForCausalLM", "MarianConfig", decoder_vocab_size=VOCAB),
    "pegasus": lambda: _bart_decoder("pegasus", "PegasusForCausalLM", "PegasusConfig"),
    "plbart": lambda: _bart_decoder("plbart", "PLBartForCausalLM", "PLBartConfig"),
    "blenderbot": lambda: _bart_decoder("blenderbot", "BlenderbotForCausalLM", "BlenderbotConfig"),
    "blenderbot-small": lambda: _bart_decoder(
        "blenderbot_small", "BlenderbotSmallForCausalLM", "BlenderbotSmallConfig"
    ),
    "bigbird_pegasus": lambda: _bart_decoder(
        "bigbird_pegasus", "BigBirdPegasusForCausalLM", "BigBirdPegasusConfig", attention_type="original_full"
    ),
    "paligemma": _paligemma,
}

LAYER_KINDS: dict[str, str] = {
    # tiny_models.FAMILIES
    "llama": "full",
    "mistral": "sliding on every layer",
    "ministral": "sliding, full, sliding (layer_types)",
    "qwen2": "full, then sliding from max_window_layers on (1 full : 2 sliding)",
    "qwen3": "full, then sliding from max_window_layers on (1 full : 2 sliding)",
    "gemma2": "alternating sliding / full, logit softcapping",
    "gemma3_text": "5 sliding : 1 full",
    "gpt_oss": "sliding, full, attention sinks",
    "cohere2": "3 sliding : 1 full",
    "phi3": "sliding on every layer",
    # other plain decoders
    "gemma3": "5 sliding : 1 full (multimodal wrapper; images too: tests/test_images.py)",
    "gemma3n_text": "2 sliding : 1 full, twice; the last 3 layers reuse earlier K/V and hold no pages",
    "olmo2": "full",
    "olmo3": "3 sliding : 1 full",
    "smollm3": "full; every 4th layer without RoPE",
    "exaone4": "3 sliding : 1 full",
    "exaone_moe": "3 sliding : 1 full",
    "kolibri1": "4 sliding : 1 full",
    "qwen2_moe": "alternating sliding / full (window passed through the mask only)",
    "qwen3_moe": "full",
    "mixtral": "sliding on every layer",
    "gemma": "full",
    "starcoder2": "sliding on every layer",
    "glm4": "full",
    "granite": "full",
    "granite_swa": "1 full : 3 sliding, attention sinks",
    "granitemoe_swa": "1 full : 3 sliding, attention sinks",
    "cohere2_moe": "3 sliding : 1 full",
    "afmoe": "3 sliding : 1 full",
    "laguna": "3 sliding : 1 full",
    "step3p7": "3 sliding : 1 full (multimodal wrapper, text only)",
    "mellum": "3 sliding : 1 full",
    "flint": "full, 2 sliding, full, attention sinks",
    "dots1": "full, then sliding from max_window_layers on (1 full : 2 sliding)",
    "beam": "3 sliding : 1 full; full layers without RoPE",
    "cwm": "1 full : 3 sliding",
    "vaultgemma": "alternating sliding / full",
    "cohere_compass": "3 sliding : 1 full; full layers without RoPE (multimodal wrapper, text only)",
    "cohere2_vision": "3 sliding : 1 full (multimodal wrapper, text only)",
    "exaone4_5": "3 sliding : 1 full (multimodal wrapper, text only)",
    "muse_glimmer": "3 sliding : 1 full; full layers without RoPE (multimodal wrapper, text only)",
    "modernbert-decoder": "full, 2 sliding, full",
    "phimoe": "sliding on every layer (window passed through the mask only)",
    "gpt2": "full; absolute position embeddings",
    # KV_LAYOUTS
    "gemma4_text": "3 sliding (4 kv heads of 16) : 1 full (1 kv head of 32, V from the K projection)",
    "gemma4": "2 sliding (head dim 16) : 1 full (head dim 32), twice; the last 2 layers reuse earlier K/V "
    "(multimodal wrapper; images too: tests/test_images.py)",
    "mimo_v2_flash": "3 sliding (twice the kv heads, attention sinks) : 1 full, K head dim 24 / V head dim 16",
    "llama4_text": "3 chunked local (chunks of 16) : 1 full (no RoPE)",
    # STATE
    "qwen3_next": "3 Gated DeltaNet (linear attention, state) : 1 full",
    "lfm2": "alternating short conv (state) / full",
    "lfm3": "conv, conv, full, conv, sliding (conv layers: state)",
    "qwen3_5_text": "3 Gated DeltaNet (linear attention, state) : 1 full",
    "bamba": "3 Mamba2 (state) : 1 full",
    "granitemoehybrid": "3 Mamba2 (state) : 1 full, MoE",
    "nemotron_h": "Mamba2 (state), MoE, full, Mamba2, MLP, full",
    "falcon_h1": "every layer full attention and Mamba2 side by side (state)",
    "zaya": "full and sliding, each projecting q/k/v through a convolution and a delayed value of its own (state), MoE",
    "lfm2_moe": "alternating short conv (state) / full, MoE after the first 2",
    "olmo_hybrid": "3 Gated DeltaNet (linear attention, state) : 1 full",
    "minimax": "3 lightning attention (linear attention in blocks of 16, state) : 1 full, MoE",
    "recurrent_gemma": "RG-LRU recurrent block (state), RG-LRU recurrent block (state), local attention (sliding)",
    "jamba": "alternating Mamba-1 (state) / full, MoE on every other layer",
    "zamba2": "Mamba2 (state) on every layer; layers 0, 2 and 4 add a shared attention block (full, 2 blocks tied "
    "in turn), with per-use adapters",
    # LATENT
    "deepseek_v2": "multi-head latent attention (latent 16 + rotary key 8 paged; K 24 / V 16 per head), MoE",
    "deepseek_v3": "multi-head latent attention (latent 16 + rotary key 8 paged; K 24 / V 16 per head), MoE",
    "minicpm3": "multi-head latent attention (latent 16 + rotary key 8 paged; K 24 / V 16 per head)",
    "kimi_linear": "3 Kimi Delta Attention (linear attention, state) : 1 multi-head latent attention (no RoPE)",
    "bailing_hybrid": "3 linear attention (state) : 1 multi-head latent attention with an output gate",
    # REFUSED
    "mamba2": "Mamba2 only (state), no attention",
    "deepseek_v32": "indexed sparse attention (top 8 keys) over latent attention",
    "deepseek_v4": "heavily compressed, compressed sparse",
    "bart": "full; learned position embeddings from the cache's length",
    "mbart": "full; learned position embeddings from the cache's length",
    "marian": "full; sinusoidal position embeddings from the cache's length",
    "pegasus": "full; sinusoidal position embeddings from the cache's length",
    "plbart": "full; learned position embeddings from the cache's length",
    "blenderbot": "full; learned position embeddings from the cache's length",
    "blenderbot-small": "full; learned position embeddings from the cache's length",
    "bigbird_pegasus": "full; learned position embeddings from the cache's length",
    "paligemma": "full, bidirectional over the prompt (prefix-LM; multimodal wrapper, text only)",
}
