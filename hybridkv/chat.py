"""Chat prompts: messages rendered with the tokenizer's own chat template (vLLM's `LLM.chat` semantics)."""

from __future__ import annotations

from typing import Any

Messages = list[dict[str, Any]]


def render_chat(tokenizer: Any, messages: Messages, tools: list[dict[str, Any]] | None = None) -> str:
    """One conversation as the prompt text the model was trained on: the tokenizer's chat template with
    `add_generation_prompt=True`, so the model answers as the assistant, and `tools` (OpenAI's function
    definitions) given to the template as transformers does. The template adds the special tokens it
    needs; the engine then tokenizes the text as any prompt."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer with a chat template: pass tokenizer= to hybridkv.patch")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) has no chat template; set tokenizer.chat_template "
            "(a Jinja template) or use generate() with a prompt you format yourself"
        )
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise TypeError('a conversation is a list of messages like {"role": "user", "content": "..."}')
    if tools and "tools" not in tokenizer.chat_template:
        raise ValueError(
            "the tokenizer's chat template does not read `tools`, so the model would never see them; use a "
            "template that renders tools (the model's own, for a model trained to call them)"
        )
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)


def chat_prompt(tokenizer: Any, messages: Messages, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    """The rendered conversation and its token ids. The template already holds the special tokens, so
    the text is tokenized without adding any (a second BOS would change the model's output)."""
    text = render_chat(tokenizer, messages, tools)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def conversations(messages_or_conversations: Messages | list[Messages]) -> list[Messages]:
    """`chat()`'s argument as a list of conversations: one conversation (a list of messages) or several."""
    if isinstance(messages_or_conversations, list) and messages_or_conversations:
        if all(isinstance(c, list) for c in messages_or_conversations):
            return messages_or_conversations
        return [messages_or_conversations]
    raise TypeError("chat() takes a conversation (a non-empty list of message dicts) or a list of conversations")


def chat_images(messages: Messages) -> list[Any]:
    """The images of a conversation's content parts (HF's `{"type": "image", "image": ...}`), in order."""
    images = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    if "image" not in part:
                        raise ValueError(
                            'an image part needs its image: {"type": "image", "image": PIL image or array}'
                        )
                    images.append(part["image"])
    return images


def image_chat_prompt(
    processor: Any, messages: Messages, images: list[Any], tools: list[dict[str, Any]] | None = None
) -> tuple[str, dict[str, Any]]:
    """A conversation with images as the processor renders and processes it (its chat template places each
    image's start token, the processor expands it): the text, and a dict prompt of its token ids and image
    tensors (hybridkv/multimodal.py). The template holds the special tokens, so none are added."""
    if processor is None or getattr(processor, "image_processor", None) is None:
        raise ValueError(
            "a chat with images needs the model's processor: hybridkv.patch(model, processor=AutoProcessor...)"
        )
    if not getattr(processor, "chat_template", None):
        raise ValueError(
            f"the processor ({type(processor).__name__}) has no chat template; set processor.chat_template"
        )
    text = processor.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
    try:
        out = processor(text=text, images=images, add_special_tokens=False, return_tensors="pt")
    except Exception as exc:
        raise ValueError(f"the processor refused the conversation's images: {type(exc).__name__}: {exc}") from exc
    data = {key: value for key, value in out.items() if key not in ("input_ids", "attention_mask")}
    return text, {"prompt_token_ids": out["input_ids"][0].tolist(), "multi_modal_data": data}
