"""Chat prompts: messages rendered with the tokenizer's own chat template (vLLM's `LLM.chat` semantics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered, vLLM's options: another Jinja `chat_template` than the tokenizer's,
    `add_generation_prompt` (the model answers as the assistant) or `continue_final_message` (it continues the
    last message; not both), and `chat_template_kwargs` the template reads (e.g. `enable_thinking`)."""

    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message=True continues the last message, add_generation_prompt=True starts a new "
                "one: set add_generation_prompt=False"
            )
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(self.chat_template_kwargs).__name__}")

    def template_arguments(self) -> dict[str, Any]:
        """What `apply_chat_template` takes besides the messages and tools."""
        arguments = dict(self.chat_template_kwargs or {})
        if self.chat_template is not None:
            arguments["chat_template"] = self.chat_template
        arguments["add_generation_prompt"] = self.add_generation_prompt
        arguments["continue_final_message"] = self.continue_final_message
        return arguments


def render_chat(
    tokenizer: Any,
    messages: Messages,
    tools: list[dict[str, Any]] | None = None,
    options: ChatOptions | None = None,
) -> str:
    """One conversation as the prompt text the model was trained on: the tokenizer's chat template (or
    `options.chat_template`) with `add_generation_prompt=True` by default, so the model answers as the assistant,
    and `tools` (OpenAI's function definitions) given to the template as transformers does. The template adds the
    special tokens it needs; the engine then tokenizes the text as any prompt."""
    options = options or ChatOptions()
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer with a chat template: pass tokenizer= to hybridkv.patch")
    template = options.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) has no chat template; pass chat_template= (a Jinja "
            "template), set tokenizer.chat_template, or use generate() with a prompt you format yourself"
        )
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise TypeError('a conversation is a list of messages like {"role": "user", "content": "..."}')
    if tools and "tools" not in template:
        raise ValueError(
            "the chat template does not read `tools`, so the model would never see them; use a template that "
            "renders tools (the model's own, for a model trained to call them)"
        )
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, **options.template_arguments())


def chat_prompt(
    tokenizer: Any,
    messages: Messages,
    tools: list[dict[str, Any]] | None = None,
    options: ChatOptions | None = None,
) -> tuple[str, list[int]]:
    """The rendered conversation and its token ids. The template already holds the special tokens, so
    the text is tokenized without adding any (a second BOS would change the model's output)."""
    text = render_chat(tokenizer, messages, tools, options)
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
    processor: Any,
    messages: Messages,
    images: list[Any],
    tools: list[dict[str, Any]] | None = None,
    options: ChatOptions | None = None,
) -> tuple[str, dict[str, Any]]:
    """A conversation with images as the processor renders and processes it (its chat template places each
    image's start token, the processor expands it): the text, and a dict prompt of its token ids and image
    tensors (hybridkv/execution/multimodal.py). The template holds the special tokens, so none are added."""
    if processor is None or getattr(processor, "image_processor", None) is None:
        raise ValueError(
            "a chat with images needs the model's processor: hybridkv.patch(model, processor=AutoProcessor...)"
        )
    options = options or ChatOptions()
    if not (options.chat_template or getattr(processor, "chat_template", None)):
        raise ValueError(
            f"the processor ({type(processor).__name__}) has no chat template; pass chat_template= or set "
            "processor.chat_template"
        )
    text = processor.apply_chat_template(messages, tools=tools or None, tokenize=False, **options.template_arguments())
    try:
        out = processor(text=text, images=images, add_special_tokens=False, return_tensors="pt")
    except Exception as exc:
        raise ValueError(f"the processor refused the conversation's images: {type(exc).__name__}: {exc}") from exc
    data = {key: value for key, value in out.items() if key not in ("input_ids", "attention_mask")}
    return text, {"prompt_token_ids": out["input_ids"][0].tolist(), "multi_modal_data": data}
