"""OpenAI's request bodies as pydantic models, their `SamplingParams`, and the response bodies.

A field hybridkv does not know is accepted and ignored, as vLLM's server does (routers such as vllm-router and SGLang's
add fields of their own, e.g. `no_stop_trim`): `OpenAIModel.ignored_fields` names them for the server's one warning
(and `hybridkv serve --strict-fields` makes them a 400 naming the first, so a typo never passes silently).
Beyond OpenAI's fields a body may carry vLLM's extra settings: top_k, min_p, min_tokens,
ignore_eos, stop_token_ids, repetition_penalty, cache_salt, skip_special_tokens, include_stop_str_in_output,
prompt_logprobs, return_token_ids, structured_outputs (one of json, regex, choice, grammar, json_object; beside
OpenAI's response_format), and for a chat chat_template, chat_template_kwargs, add_generation_prompt and
continue_final_message; `model` may be left out, `request_id` names the request (hybridkv/serving/request_ids.py),
and `priority` is accepted (it changes no output). A sampling field a body leaves out takes the model's default (its
generation config's, as vLLM's `--generation-config auto`), else vLLM's.
"""

from __future__ import annotations

import json
import time
from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hybridkv.engine.chat import ChatOptions
from hybridkv.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from hybridkv.scheduling.sampling_params import SamplingParams
from hybridkv.scheduling.structured_params import StructuredOutputsParams

STRUCTURED_OUTPUTS_FIELDS = tuple(f.name for f in fields(StructuredOutputsParams))
# vLLM's `guided_<name>` request fields and the structured_outputs field each is.
_GUIDED_FIELDS = {
    "json": "json",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "whitespace_pattern": "whitespace_pattern",
}


class OpenAIModel(BaseModel):
    """A request body (or a part of one): fields it does not declare are kept aside, not refused (vLLM's
    `OpenAIBaseModel`), and `ignored_fields` names them."""

    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        """The body's undeclared fields, a nested part's as `part.field`, in the order sent."""
        names = list(self.model_extra or ())
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, OpenAIModel):
                names += [f"{name}.{inner}" for inner in value.ignored_fields()]
        return names


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON that follows a schema; and vLLM's
    `structural_tag` (free text in which each trigger starts a structure: `structures`, `triggers`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "structural_tag":
            return StructuredOutputsParams(structural_tag={"structures": self.structures, "triggers": self.triggers})
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
        return StructuredOutputsParams(json=self.json_schema.json_schema)


class SamplingFields(OpenAIModel):
    """The fields both endpoints share: OpenAI's sampling settings and vLLM's extras."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's older names for structured_outputs' fields (its examples and many clients still send them).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # the grammar library is llguidance's, whatever this names
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    request_id: str | None = None
    priority: int = 0

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The body's constraint: OpenAI's `response_format`, vLLM's `structured_outputs` or its older `guided_*`
        fields (one of the three)."""
        from_format = self.response_format.structured_outputs() if self.response_format is not None else None
        guided = {
            field: getattr(self, f"guided_{name}")
            for name, field in _GUIDED_FIELDS.items()
            if getattr(self, f"guided_{name}") is not None
        }
        given = [
            name
            for name, value in (
                ("response_format", from_format),
                ("structured_outputs", self.structured_outputs),
                ("guided_*", guided or None),
            )
            if value is not None
        ]
        if len(given) > 1:
            raise ValueError(
                f"send one of response_format, structured_outputs and guided_*, not both {given[0]} and {given[1]}"
            )
        if guided:
            return StructuredOutputsParams(**guided)
        if self.structured_outputs is None:
            return from_format
        unknown = set(self.structured_outputs) - set(STRUCTURED_OUTPUTS_FIELDS)
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown field(s) {sorted(unknown)}; "
                f"it takes one of {STRUCTURED_OUTPUTS_FIELDS}"
            )
        return StructuredOutputsParams(**self.structured_outputs)

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """The body's settings as `SamplingParams` (which checks them: its ValueError or TypeError is
        the 400's message); a field the body leaves out takes `defaults` (the model's), else SamplingParams'."""
        names = (
            "temperature",
            "top_p",
            "n",
            "stop",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "top_k",
            "min_p",
            "min_tokens",
            "ignore_eos",
            "stop_token_ids",
            "repetition_penalty",
            "cache_salt",
            "best_of",
            "logit_bias",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "prompt_logprobs",
        )
        settings = {key: value for key, value in (defaults or {}).items() if key != "max_tokens"}
        settings.update({name: getattr(self, name) for name in names if getattr(self, name, None) is not None})
        structured = self.structured_outputs_params()
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured, **settings)
        if self.stream and params.num_samples > params.n:
            raise ValueError(f"best_of={params.best_of} > n={params.n} cannot be streamed; set stream=false")
        if self.stream and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not streamed; set stream=false to get them")
        return params


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: a prompt (text or token ids) or a list of them; `logprobs` is the top count and
    `echo` puts the prompt before each choice's text (OpenAI's)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_and_image_parts_only(cls, content: Any) -> Any:
        """Content parts must be text or images (`image_url`): a part of another kind (audio, a file) dropped
        from the prompt would be answered as if it had not been sent."""
        if isinstance(content, list):
            for index, part in enumerate(content):
                kind = part.get("type")
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise ValueError(f"part {index} (type 'text') needs a string 'text'")
                elif kind == "image_url":
                    image_url = part.get("image_url")
                    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
                        raise ValueError(f'part {index} (type \'image_url\') needs "image_url": {{"url": "data:..."}}')
                else:
                    raise ValueError(
                        f"part {index} is of type {kind!r}: this server takes parts of type 'text' and 'image_url' "
                        "(audio, video and files are not served)"
                    )
        return content

    def image_urls(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part["image_url"]["url"] for part in self.content if part.get("type") == "image_url"]

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined into one text (or, with images, HF's
        parts: `{"type": "text", ...}` and `{"type": "image"}` in order), and an assistant's tool calls with
        their arguments as objects (OpenAI sends JSON text; templates read a mapping)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if self.image_urls():
                message["content"] = [
                    {"type": "image"} if part.get("type") == "image_url" else {"type": "text", "text": part["text"]}
                    for part in self.content
                ]
            else:
                message["content"] = "".join(part.get("text", "") for part in self.content)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_with_argument_object(call) for call in calls]
        return message


def _with_argument_object(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            raise ValueError(f"a tool call's arguments are not JSON: {function['arguments']!r}") from None
        return {**call, "function": {**function, "arguments": arguments}}
    return call


class ChatTemplateFields(OpenAIModel):
    """What renders a chat's messages (vLLM's fields), the same for `/v1/chat/completions` and `/tokenize`: the
    template and its settings, and the tools it shows."""

    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def chat_options(self) -> ChatOptions:
        return ChatOptions(
            self.chat_template, self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs
        )


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    """`POST /v1/chat/completions`: `logprobs` is a flag and `top_logprobs` the top count (OpenAI's); `tools` and
    `tool_choice` ("none", "auto", "required" or {"type": "function", "function": {"name": ...}})."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(ChatTemplateFields):
    """`POST /tokenize` (vLLM's): a prompt's token ids as `/v1/completions` makes them (`add_special_tokens`,
    default true), or a chat's as `/v1/chat/completions` renders it (`messages`, with the same template settings and
    `tools`); `return_token_strs` adds each token's text."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    """`POST /detokenize` (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(OpenAIModel):
    """`POST /v1/load_lora_adapter` (vLLM's): serve the PEFT folder `lora_path` under the model name `lora_name`."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    """`POST /v1/unload_lora_adapter` (vLLM's): stop serving the adapter named `lora_name` (or, with no name, the one of
    vLLM's `lora_int_id`)."""

    lora_name: str | None = None
    lora_int_id: int | None = None


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class APIError(Exception):
    """A request the server refuses: HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, _code(self.status))


def _code(status: int) -> str | None:
    return {404: "model_not_found"}.get(status)


class TokenText:
    """Token ids as the text OpenAI's logprobs show: each token decoded on its own."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, sample: CompletionOutput, num_top: int) -> dict[str, Any] | None:
        """`/v1/completions`' logprobs: tokens, their logprobs, the `num_top` top tokens' and text offsets."""
        if sample.logprobs is None:
            return None
        return self.completion_logprobs_of(sample.token_ids, sample.logprobs, num_top)[0]

    def completion_logprobs_of(
        self, token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int, offset: int = 0
    ) -> tuple[dict[str, Any], int]:
        """Those of some tokens whose text starts at `offset` (a stream's next chunk), and the offset after them."""
        tokens = [self(token_id) for token_id in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        pairs = list(zip(token_ids, entries, strict=True))
        body = {
            "tokens": tokens,
            "token_logprobs": [entry[token].logprob for token, entry in pairs],
            "top_logprobs": [{self(top_id): lp for top_id, lp in _top(entry, num_top)} for _, entry in pairs],
            "text_offset": offsets,
        }
        return body, offset

    def echoed_logprobs(self, output: RequestOutput, sample: CompletionOutput, num_top: int) -> dict[str, Any]:
        """`/v1/completions`' logprobs with `echo`: the prompt's tokens first (the first with no logprob, as OpenAI
        gives it), then the sample's."""
        prompt_ids, prompt_entries = output.prompt_token_ids, output.prompt_logprobs or []
        body, offset = self.completion_logprobs_of(
            prompt_ids[1:], prompt_entries[1:], num_top, len(self(prompt_ids[0]))
        )
        generated, _ = self.completion_logprobs_of(list(sample.token_ids), sample.logprobs or [], num_top, offset)
        return {
            "tokens": [self(prompt_ids[0]), *body["tokens"], *generated["tokens"]],
            "token_logprobs": [None, *body["token_logprobs"], *generated["token_logprobs"]],
            "top_logprobs": [None, *body["top_logprobs"], *generated["top_logprobs"]],
            "text_offset": [0, *body["text_offset"], *generated["text_offset"]],
        }

    def chat_logprobs(self, sample: CompletionOutput, num_top: int) -> dict[str, Any] | None:
        """`/v1/chat/completions`' logprobs: one entry per token with its `num_top` top alternatives."""
        if sample.logprobs is None:
            return None
        return self.chat_logprobs_of(sample.token_ids, sample.logprobs, num_top)

    def chat_logprobs_of(self, token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int) -> dict[str, Any]:
        pairs = zip(token_ids, entries, strict=True)
        return {"content": [self._chat_entry(token, entry, num_top) for token, entry in pairs]}

    def _chat_entry(self, token_id: int, entry: dict[int, Logprob], num_top: int) -> dict[str, Any]:
        token = self(token_id)
        top = [{"token": self(i), "logprob": lp, "bytes": list(self(i).encode())} for i, lp in _top(entry, num_top)]
        return {"token": token, "logprob": entry[token_id].logprob, "bytes": list(token.encode()), "top_logprobs": top}


def _top(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, float]]:
    """The `num_top` most likely tokens of one position's logprobs (vLLM's dict: the sampled token with its rank,
    then the top k), most likely first."""
    ranked = sorted((lp.rank or 0, order, token_id, lp.logprob) for order, (token_id, lp) in enumerate(entry.items()))
    return [(token_id, logprob) for _, _, token_id, logprob in ranked[:num_top]]


def prompt_logprobs_body(prompt_logprobs: PromptLogprobs | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` in a response: per prompt position, token id (as a string key) -> logprob, rank and
    decoded token; None for the first position."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]
