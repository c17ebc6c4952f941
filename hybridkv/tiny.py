"""Tiny random models built from configs, for demos, notebooks, tests and benchmarks; no download.

`tiny_model("gemma3")` is a random 6-layer Gemma 3 (5 sliding-window layers, then 1 full-attention
layer) with hidden size 64 and a 256-token vocabulary, in eval() mode, its weights drawn after
`torch.manual_seed(0)`. Keyword arguments override any config value, so a call names only what differs:
`tiny_model("gemma3", num_hidden_layers=12, vocab_size=len(tokenizer))`.

Every family starts from `COMMON` and adds its layout. Windows (`WINDOW`) are shorter than a demo's
prompts, so they really slide. Initializer ranges make greedy output change with the first token of a
40-token prompt: 0.2-0.3 for most families, 0.03 for the Gemmas, which scale embeddings by
sqrt(hidden_size). There are no special token ids: `generate` masks out every prompt token equal to the
pad id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import transformers

VOCAB = 256
WINDOW = 16
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


@dataclass(frozen=True, slots=True)
class TinyFamily:
    """A transformers config class and causal-LM class, by name (resolved on use, so importing this
    module loads no model code), and the config values a tiny model of the family sets beyond `COMMON`."""

    config_class: str
    model_class: str
    config_values: dict[str, Any]


FAMILIES: dict[str, TinyFamily] = {
    "llama": TinyFamily("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, initializer_range=0.3)),
    # All-sliding families need 3 layers for a 40-token prompt's first token to reach the output.
    "mistral": TinyFamily(
        "MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=3, sliding_window=WINDOW, initializer_range=0.2)
    ),
    "ministral": TinyFamily(
        "MinistralConfig",
        "MinistralForCausalLM",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            initializer_range=0.3,
        ),
    ),
    "qwen2": TinyFamily(
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            initializer_range=0.2,
        ),
    ),
    "qwen3": TinyFamily(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            initializer_range=0.3,
        ),
    ),
    "gemma2": TinyFamily(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            sliding_window=WINDOW,
            attn_logit_softcapping=5.0,
            initializer_range=0.03,
            tie_word_embeddings=False,
        ),
    ),
    "gemma3": TinyFamily(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=6,
            head_dim=16,
            sliding_window=WINDOW,
            initializer_range=0.03,
            tie_word_embeddings=False,
        ),
    ),
    "gpt_oss": TinyFamily(
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_hidden_layers=2,
            head_dim=16,
            sliding_window=WINDOW,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            initializer_range=0.3,
            max_position_embeddings=131072,  # its yarn rope scaling expects 32 x 4,096
        ),
    ),
    "cohere2": TinyFamily(
        "Cohere2Config", "Cohere2ForCausalLM", dict(num_hidden_layers=4, sliding_window=WINDOW, initializer_range=0.3)
    ),
    "phi3": TinyFamily(
        "Phi3Config", "Phi3ForCausalLM", dict(num_hidden_layers=3, sliding_window=WINDOW, initializer_range=0.2)
    ),
    # State layers beside attention (hybridkv/execution/state_layers.py): Qwen3.5's 3 Gated DeltaNet : 1 full, and
    # Bamba's 3 Mamba2 : 1 full (Granite 4 and Nemotron-H mix the same layers).
    "qwen3_5": TinyFamily(
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            initializer_range=0.2,
        ),
    ),
    "bamba": TinyFamily(
        "BambaConfig",
        "BambaForCausalLM",
        dict(
            num_hidden_layers=4,
            attn_layer_indices=[3],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_expand=1,
            mamba_chunk_size=32,
            initializer_range=0.2,
        ),
    ),
}


def tiny_config(family: str = "gemma3", **overrides: Any) -> transformers.PretrainedConfig:
    """The config of a tiny `family` model: `COMMON`, then the family's values, then `overrides`.
    Raises ValueError for a family not in `FAMILIES`."""
    if family not in FAMILIES:
        raise ValueError(f"no tiny model family {family!r}; choose one of: {', '.join(FAMILIES)}")
    config_class = getattr(transformers, FAMILIES[family].config_class)
    return config_class(**{**COMMON, **FAMILIES[family].config_values, **overrides})


def tiny_model(family: str = "gemma3", *, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A random model of `tiny_config(family, **overrides)` in torch's default dtype and eval() mode, its
    weights drawn after `torch.manual_seed(seed)`: the same arguments give the same weights."""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    return getattr(transformers, FAMILIES[family].model_class)(config).eval()


VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<eos>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_vision_model(
    corpus: list[str] | None = None,
    *,
    seed: int = 0,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    image_size: int = 28,
    tokens_per_image: int = 4,
) -> tuple[transformers.PreTrainedModel, Any]:
    """A random Gemma 3 with a SigLIP tower (by default a 28-pixel image is 4 tokens, which attend to each other
    both ways) and its processor: the PIL image processor (no torchvision) and a byte-level BPE tokenizer trained
    here with Gemma 3's image tokens and a chat template that reads image parts. No download. `text` and
    `vision` override config values; an image of `image_size` pixels (patches of 14) is pooled to
    `tokens_per_image` tokens (a square number)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gemma3 import Gemma3ImageProcessorPil, Gemma3Processor

    special = ["<eos>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus or ["a tiny random model looks at a tiny random picture. "] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<eos>",
        extra_special_tokens={"boi_token": special[1], "eoi_token": special[2], "image_token": special[3]},
    )
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}),
        tokenizer=tokenizer,
        image_seq_length=tokens_per_image,
        chat_template=VISION_CHAT_TEMPLATE,
    )
    ids = tokenizer.convert_tokens_to_ids(special)
    text_values = dict(
        COMMON,
        vocab_size=len(tokenizer),
        num_hidden_layers=6,
        head_dim=16,
        sliding_window=WINDOW,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    vision_values = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=image_size,
        patch_size=14,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config={**text_values, **(text or {})},
        vision_config={**vision_values, **(vision or {})},
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=ids[1],
        eoi_token_index=ids[2],
        image_token_index=ids[3],
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    for c in (config, config.text_config):
        for field in ("pad_token_id", "bos_token_id"):
            if getattr(c, field, None) is not None:
                object.__setattr__(c, field, None)
    object.__setattr__(config.text_config, "eos_token_id", ids[0])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    # transformers starts the projector at zero (every image alike); random weights make the image matter.
    model.model.multi_modal_projector.mm_input_projection_weight.data.normal_(0, 1.0)
    model.generation_config.eos_token_id = ids[0]
    return model, processor
