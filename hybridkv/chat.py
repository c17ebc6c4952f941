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
