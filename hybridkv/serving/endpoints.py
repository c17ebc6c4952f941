"""`OpenAIServing`: OpenAI's completion and chat endpoints over an `AsyncLLMEngine`, without the HTTP.

A request's life: check the model name (the model's, or a LoRA adapter's: hybridkv/serving/served_models.py), make
the prompt token ids (a chat through the tokenizer's template; vLLM's render endpoints answer with these), refuse a
prompt over max_model_len, build `SamplingParams` (its checks are the 400s), submit, then either await the whole
output or turn its `StreamDelta`s into OpenAI's chunks. Whatever ends a request's handling early (a client gone, a
cancelled task) aborts the request, so its blocks return.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridkv.engine.chat import ChatOptions, chat_prompt, image_chat_prompt, render_chat
from hybridkv.outputs import Logprob, RequestOutput, StreamDelta
from hybridkv.scheduling.sampling_params import SamplingParams
from hybridkv.scheduling.structured_params import StructuredOutputsParams
from hybridkv.serving import tool_calls
from hybridkv.serving.images import decode_image
from hybridkv.serving.metrics import ServerMetrics
from hybridkv.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    OpenAIModel,
    SamplingFields,
    TokenizeRequest,
    TokenText,
    UnloadLoRAAdapterRequest,
    error_body,
    now,
    prompt_logprobs_body,
    usage,
)
from hybridkv.serving.request_ids import EngineIds
from hybridkv.serving.served_models import ServedModels

if TYPE_CHECKING:
    from starlette.requests import Request

    from hybridkv.async_engine import AsyncLLMEngine, RequestHandle
    from hybridkv.lora import LoRARequest

# OpenAI's default max_tokens for /v1/completions; a chat's default is what fits in max_model_len.
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_PROMPTS_PER_REQUEST = 256
DISCONNECT_POLL_SECONDS = 0.5
# Distinct sets of ignored fields warned about (each once); later new sets are logged at debug level only, so
# that bodies made up by clients cannot grow the server's memory.
MAX_IGNORED_FIELD_WARNINGS = 64
# This process's name in /get_server_info: a router that indexes its workers' caches tells them apart by it.
INSTANCE_ID = uuid.uuid4().hex

logger = logging.getLogger("hybridkv")


class OpenAIServing:
    """The endpoints' logic over one engine: its model's name and the LoRA adapters served with it (`lora_modules`,
    each read now: a ValueError names the fix for one the engine cannot serve). `strict_fields`: a body's unknown
    field is a 400 naming it (by default it is ignored with one warning, as vLLM does: `accept_fields`)."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_name: str,
        tool_call_parser: str | None = None,
        fetch_images: bool = False,
        lora_modules: Sequence[LoRARequest] = (),
        strict_fields: bool = False,
    ) -> None:
        self.engine = engine
        self.strict_fields = strict_fields
        self._warned_fields: set[tuple[str, ...]] = set()
        self.fetch_images = fetch_images
        self.model_name = model_name
        self.served_models = ServedModels(engine, model_name, lora_modules)
        self.tokenizer = engine.llm.tokenizer
        self.max_model_len = engine.llm.max_model_len
        self.token_text = TokenText(self.tokenizer)
        # The tool-call format of tool_choice "auto": named, or found in the chat template.
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_call_parser = tool_calls.check_parser(tool_call_parser) or tool_calls.parser_for_template(
            template if isinstance(template, str) else None
        )
        self.metrics = ServerMetrics(engine.stats)
        # What a router that indexes its workers' caches reads: fixed once the model is patched.
        self.kv_block_size = engine.llm.kv_event_block_size
        self.kv_events_config = engine.llm.config.kv_events_config
        self.engine_ids = EngineIds()
        self._recorders: set[asyncio.Task[None]] = set()

    def accept_fields(self, body: OpenAIModel, route: str) -> None:
        """Let a body with fields this server does not know through, warning once per route and set of names (a
        router adds the same ones to every request); with `strict_fields`, refuse it naming the first."""
        ignored = body.ignored_fields()
        if not ignored:
            return
        if self.strict_fields:
            message = f"unknown field {ignored[0]!r}; check its spelling (see the API reference)"
            raise APIError(400, message, param=ignored[0])
        key = (route, *sorted(ignored))
        if key in self._warned_fields:
            return
        if len(self._warned_fields) >= MAX_IGNORED_FIELD_WARNINGS:
            logger.debug("%s: ignored the request's unknown fields %s", route, ignored)
            return
        self._warned_fields.add(key)
        logger.warning(
            "%s: the request's fields %s are not used by this server and were ignored (said once for these fields; "
            "`hybridkv serve --strict-fields` refuses them instead)",
            route,
            ", ".join(repr(name) for name in ignored),
        )

    def models(self) -> dict[str, Any]:
        """`/v1/models`: the model, then each LoRA adapter served with it."""
        return {"object": "list", "data": self.served_models.cards()}

    def server_info(self) -> dict[str, Any]:
        """`/get_server_info` (SGLang's), what vllm-router's kv_aware discovery reads (its `ServerInfo`): the served
        model's name as model_id and model_path, the block size in tokens of the KV events' group 0 (what its index
        chunks prompts by) and this process's instance id."""
        return {
            "model_id": self.model_name,
            "model_path": self.model_name,
            "instance_id": INSTANCE_ID,
            "kv_block_size": self.kv_block_size,
        }

    def kv_event_sources(self) -> dict[str, Any]:
        """`/kv_event_sources` (vLLM's): per data-parallel rank (one here: "0"), the `KVEventsConfig` its events are
        published with, and the wire format's name and version (`encoding` "msgpack", `schema_version` 1: vllm-router's
        discovery subscribes only to a source that names them); empty when the engine publishes none. vllm-router puts
        the worker's host in place of a `*`."""
        config = self.kv_events_config
        if config is None or not config.publishes:
            return {}
        return {"0": {**dataclasses.asdict(config), "encoding": "msgpack", "schema_version": 1}}

    def model_info(self) -> dict[str, Any]:
        """`/get_model_info` (SGLang's, which routers may ask): the served model, where its tokenizer was read from,
        and that it generates text."""
        tokenizer_path = getattr(self.tokenizer, "name_or_path", None) or None
        return {"model_path": self.model_name, "tokenizer_path": tokenizer_path, "is_generation": True}

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> str:
        """`/v1/load_lora_adapter`: vLLM's success text (ServedModels.load)."""
        return await self.served_models.load(body.lora_name, body.lora_path)

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> str:
        """`/v1/unload_lora_adapter`: vLLM's success text (ServedModels.unload)."""
        return await self.served_models.unload(body.lora_name, body.lora_int_id)

    async def completion(
        self, body: CompletionRequest, request: Request, request_id: str
    ) -> dict[str, Any] | AsyncIterator[str]:
        """`/v1/completions`: the response body, or the server-sent events of a stream; `request_id` is the response's
        `id` (hybridkv/serving/request_ids.py). Several prompts run as concurrent requests; prompt i's samples are
        choices i x n .. i x n + n - 1, as OpenAI numbers them."""
        lora = self.served_models.resolve(body.model)
        echo_logprobs = body.echo and body.logprobs is not None  # OpenAI's: the prompt's logprobs lead the choice's
        if echo_logprobs and body.stream:
            raise APIError(400, "echo with logprobs is not streamed; set stream=false", param="echo")
        # Off the event loop: a long prompt's tokenization must not stall every other client (and /health).
        prompts = await asyncio.to_thread(self._completion_prompts, body.prompt)
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = self.engine.llm.default_sampling.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
        params = [self._params(body, prompt_ids, max_tokens, body.logprobs) for prompt_ids in prompts]
        if echo_logprobs:
            params = [dataclasses.replace(p, prompt_logprobs=body.logprobs) for p in params]
        await self._compile_grammar(params[0])
        await self._read_adapter(lora)
        echoes = [self._text(prompt_ids) if body.echo else "" for prompt_ids in prompts]
        handles = self._submit_all(prompts, params, request_id, lora)
        model = self.model_name if lora is None else lora.lora_name
        header = {"id": request_id, "object": "text_completion", "created": now(), "model": model}
        n = params[0].n
        num_top = body.logprobs or 0
        if body.stream:
            choice = functools.partial(
                self._completion_choice, echoes=echoes, n=n, num_top=num_top, token_ids=body.return_token_ids
            )
            return self._events(handles, header, prompts, n, body, choice)
        try:
            outputs = [await self._wait(handle, request) for handle in handles]
        except BaseException:  # a failed or cancelled wait leaves none of them running
            for handle in handles:
                handle.abort()
            raise
        choices = []
        for prompt_index, output in enumerate(outputs):
            for sample in output.outputs:
                logprobs = self.token_text.completion_logprobs(sample, num_top)
                if echo_logprobs:
                    logprobs = self.token_text.echoed_logprobs(output, sample, num_top)
                choice = {
                    "index": prompt_index * n + sample.index,
                    "text": echoes[prompt_index] + sample.text,
                    "logprobs": logprobs,
                    "finish_reason": sample.finish_reason,
                    "stop_reason": sample.stop_reason,
                }
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_body(output.prompt_logprobs)
                if body.return_token_ids:
                    choice.update(prompt_token_ids=output.prompt_token_ids, token_ids=list(sample.token_ids))
                choices.append(choice)
        counts = [_output_usage(output) for output in outputs]
        total = usage(sum(c["prompt_tokens"] for c in counts), sum(c["completion_tokens"] for c in counts))
        return {**header, "choices": choices, "usage": total}

    def _text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def _submit_all(
        self, prompts: list[list[int]], params: list[SamplingParams], request_id: str, lora: LoRARequest | None
    ) -> list[RequestHandle]:
        """Submit every prompt, or none: a refusal aborts those submitted before it. The first prompt's request is
        named `request_id`, the others `ID-1`, `ID-2`, ... (each made unique by `_submit`)."""
        handles: list[RequestHandle] = []
        try:
            for index, (prompt_ids, prompt_params) in enumerate(zip(prompts, params, strict=True)):
                wanted_id = request_id if index == 0 else f"{request_id}-{index}"
                handles.append(self._submit(prompt_ids, prompt_params, wanted_id, lora))
        except BaseException:
            for handle in handles:
                handle.abort()
            raise
        return handles

    async def chat(
        self, body: ChatCompletionRequest, request: Request, request_id: str
    ) -> dict[str, Any] | AsyncIterator[str]:
        """`/v1/chat/completions`: the response body, or the server-sent events of a stream; `request_id` is the
        response's `id` (hybridkv/serving/request_ids.py)."""
        lora = self.served_models.resolve(body.model)
        tools = self._tool_plan(body)
        # Off the event loop: the template, the tokenizer and an image's processing take long for a long chat.
        prompt = await asyncio.to_thread(self._chat_prompt, body)
        prompt_ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # vLLM's: what fits, or less by the model's generation config
            max_tokens = max(1, self.max_model_len - len(prompt_ids))
            max_tokens = min(max_tokens, self.engine.llm.default_sampling.get("max_tokens", max_tokens))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        num_top = body.top_logprobs or 0
        params = self._params(body, prompt_ids, max_tokens, logprobs)
        if tools.forced_schema is not None:
            if params.structured_outputs is not None:
                raise APIError(400, "a forced tool_choice constrains the output itself: drop response_format", "tools")
            params = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=tools.forced_schema))
        await self._compile_grammar(params)
        await self._read_adapter(lora)
        if isinstance(prompt, dict):  # a chat with images: the vision tower runs when the request is checked
            handle = await self._submit_off_loop(prompt, params, request_id, lora)
        else:
            handle = self._submit(prompt_ids, params, request_id, lora)
        model = self.model_name if lora is None else lora.lora_name
        header = {"id": request_id, "object": "chat.completion", "created": now(), "model": model}
        if body.stream:
            header["object"] = "chat.completion.chunk"
            choice = functools.partial(self._chat_choice, tools=tools, num_top=num_top, token_ids=body.return_token_ids)
            return self._events([handle], header, [prompt_ids], params.n, body, choice)
        output = await self._wait(handle, request)
        choices = []
        for sample in output.outputs:
            content, calls = tools.split(sample.text, self._raw_text(sample.token_ids))
            # vLLM's message always has the list, empty without calls (its tools client iterates it).
            message: dict[str, Any] = {"role": "assistant", "content": content}
            message["tool_calls"] = [call.as_openai() for call in calls]
            finish_reason = "tool_calls" if calls and sample.finish_reason == "stop" else sample.finish_reason
            logprobs = self.token_text.chat_logprobs(sample, num_top)
            choice = {"index": sample.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
            choice["stop_reason"] = sample.stop_reason
            if body.return_token_ids:
                choice["token_ids"] = list(sample.token_ids)
            choices.append(choice)
        response = {**header, "choices": choices, "usage": _output_usage(output)}
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_body(output.prompt_logprobs)
        if body.return_token_ids:
            response["prompt_token_ids"] = output.prompt_token_ids
        return response

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int] | dict[str, Any]:
        """The prompt a chat runs (in a worker thread: this is slow for a long chat): the token ids of its messages
        rendered by the chat template with the body's template settings and tools, or for a chat with images the
        processor's dict prompt (`prompt_token_ids` and the image tensors). A chat that cannot be rendered is a 400.
        The chat endpoint and its render both take their tokens from here, so they cannot differ."""
        image_urls = [url for message in body.messages for url in message.image_urls()]
        try:
            options = body.chat_options()
            messages = [message.as_dict() for message in body.messages]
            if image_urls:
                return self._image_prompt(messages, image_urls, body.tools, options)
            return chat_prompt(self.tokenizer, messages, body.tools, options)[1]
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), param="messages") from error

    def _tool_plan(self, body: ChatCompletionRequest) -> ToolPlan:
        """What the body's tools and tool_choice ask of the output (400s for what cannot be done)."""
        if not body.tools:
            if body.tool_choice not in (None, "none"):
                raise APIError(400, f"tool_choice {body.tool_choice!r} needs tools", param="tool_choice")
            return ToolPlan()
        try:
            functions = tool_calls.check_tools(body.tools)
        except ValueError as error:
            raise APIError(400, str(error), param="tools") from error
        choice = "auto" if body.tool_choice is None else body.tool_choice
        if choice == "none":
            return ToolPlan()
        if choice == "auto":
            if self.tool_call_parser is None:
                raise APIError(
                    400,
                    "tool_choice 'auto' needs a parser for this model's tool-call format, and none was found in its "
                    f"chat template: serve with --tool-call-parser (one of {', '.join(tool_calls.PARSER_NAMES)}), "
                    "or ask for tool_choice 'required' or a named function",
                    param="tool_choice",
                )
            return ToolPlan(parser=self.tool_call_parser, single=body.parallel_tool_calls is False)
        try:
            schema, named = tool_calls.forced_schema(functions, choice)
        except ValueError as error:
            raise APIError(400, str(error), param="tool_choice") from error
        if named is None and body.parallel_tool_calls is False:
            schema = {**schema, "maxItems": 1}
        return ToolPlan(forced_schema=schema, named=named)

    def _raw_text(self, token_ids: list[int]) -> str:
        """Output text with special tokens kept (tool-call markers are special in some vocabularies), EOS cut."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        eos = self.tokenizer.eos_token
        return text.removesuffix(eos) if eos else text

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """`/tokenize`: the token ids the server would run for the prompt or the chat, their count (and with
        `return_token_strs`, each token's text), as vLLM's."""
        self.served_models.resolve(body.model)
        tokenizer = self._tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either a prompt or messages", param="prompt")
        if body.messages is not None:
            if any(message.image_urls() for message in body.messages):
                raise APIError(
                    400, "/tokenize takes text messages only (images are expanded by the processor)", "messages"
                )
            options = body.chat_options()
            try:
                text = render_chat(tokenizer, [message.as_dict() for message in body.messages], body.tools, options)
            except (ValueError, TypeError) as error:
                raise APIError(400, str(error), param="messages") from error
            # vLLM's: the template holds a chat's special tokens, so none are added unless asked for.
            tokens = list(tokenizer(text, add_special_tokens=bool(body.add_special_tokens))["input_ids"])
        else:
            add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = list(tokenizer(body.prompt, add_special_tokens=add_special_tokens)["input_ids"])
        answer: dict[str, Any] = {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}
        if body.return_token_strs:
            answer["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
        return answer

    def render_completion(self, body: CompletionRequest, request_id: str) -> list[dict[str, Any]]:
        """`/v1/completions/render` (vLLM's, which vllm-router asks for a prompt's tokens to route by): per prompt, the
        token ids /v1/completions runs for this body, in vLLM's `GenerateRequest` fields (rendered_request); a prompt
        the endpoint would refuse is refused alike."""
        self.served_models.resolve(body.model)
        prompts = self._completion_prompts(body.prompt)
        for prompt_ids in prompts:
            self._check_length(prompt_ids, "prompt")
        return [
            rendered_request(request_id if index == 0 else f"{request_id}-{index}", prompt_ids, body.model)
            for index, prompt_ids in enumerate(prompts)
        ]

    def render_chat(self, body: ChatCompletionRequest, request_id: str) -> dict[str, Any]:
        """`/v1/chat/completions/render` (vLLM's): the token ids /v1/chat/completions runs for this chat, in vLLM's
        `GenerateRequest` fields. A chat with images is a 400: its image tokens are the processor's expansion,
        which vLLM's render describes with multimodal `features` this server does not make (vllm-router asks for no
        such render; it routes such a chat without its tokens)."""
        self.served_models.resolve(body.model)
        if any(message.image_urls() for message in body.messages):
            raise APIError(
                400,
                "a chat with images is not rendered here (its image tokens are made when it runs); "
                "send it to /v1/chat/completions",
                param="messages",
            )
        prompt_ids = self._chat_prompt(body)
        assert isinstance(prompt_ids, list)  # a chat without images is token ids
        self._check_length(prompt_ids, "messages")
        return rendered_request(request_id, prompt_ids, body.model)

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """`/detokenize`: the text of token ids (ids outside the vocabulary are a 400)."""
        self.served_models.resolve(body.model)
        tokenizer = self._tokenizer()
        vocab = len(tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer: it takes and gives token ids only", param="model")
        return self.tokenizer

    def _completion_prompts(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[list[int]]:
        """The token ids of each prompt the body holds (a text, token ids, or a list of either)."""
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        if not prompts or any(not p for p in prompts):
            raise APIError(400, "a prompt is empty; send at least one token or character", param="prompt")
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise APIError(
                400, f"{len(prompts)} prompts in one request; send at most {MAX_PROMPTS_PER_REQUEST}", param="prompt"
            )
        token_ids = []
        for one in prompts:
            if isinstance(one, str):
                if self.tokenizer is None:
                    raise APIError(400, "this server has no tokenizer: send the prompt as token ids", param="prompt")
                one = self.tokenizer(one, add_special_tokens=True)["input_ids"]
            token_ids.append(list(one))
        return token_ids

    def _params(
        self, body: SamplingFields, prompt_ids: list[int], max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        self._check_length(prompt_ids, "messages" if isinstance(body, ChatCompletionRequest) else "prompt")
        try:
            return body.sampling_params(max_tokens, logprobs, self.engine.llm.default_sampling)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), param=_setting_named(str(error))) from error

    def _check_length(self, prompt_ids: list[int], param: str) -> None:
        if len(prompt_ids) > self.max_model_len:
            raise APIError(
                400,
                f"prompt has {len(prompt_ids):,} tokens but max_model_len is {self.max_model_len:,}; "
                "shorten the prompt (or serve with a larger --max-model-len)",
                param=param,
            )

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """A constrained request's grammar, compiled off the event loop (the first one also builds the grammar
        library's view of the vocabulary: seconds); the submit that follows finds it cached."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(self.engine.llm.grammars.compile, params.structured_outputs)
        except (ValueError, TypeError, ImportError) as error:
            raise APIError(400, str(error), param="response_format") from error

    def _image_prompt(
        self,
        messages: list[dict[str, Any]],
        urls: list[str],
        tools: list[dict[str, Any]] | None,
        options: ChatOptions,
    ) -> dict[str, Any]:
        """A chat with images as the model's processor renders and processes it (in a worker thread)."""
        llm = self.engine.llm
        if llm.images is None:
            refused = llm.images_refused
            raise ValueError(
                refused or f"this model ({type(llm.model).__name__}) takes no images: send text parts only"
            )
        images = [decode_image(url, self.fetch_images) for url in urls]
        _, prompt = image_chat_prompt(llm.processor, messages, images, tools, options)
        return prompt

    async def _read_adapter(self, lora: LoRARequest | None) -> None:
        """A request's adapter read into the engine's host cache off the event loop (one evicted from it is read from
        its folder again: seconds for a large one), so that the submit that follows finds it there."""
        if lora is None:
            return
        try:
            await self.engine.add_lora(lora)
        except ValueError as error:
            raise APIError(400, str(error), param="model") from error

    async def _submit_off_loop(
        self, prompt: dict[str, Any], params: SamplingParams, wanted_id: str, lora: LoRARequest | None
    ) -> RequestHandle:
        """`_submit` of a prompt whose check takes long (a chat's images run the vision tower): in a worker thread."""
        with self._engine_id(wanted_id, param="messages") as engine_id:
            handle = await asyncio.to_thread(self.engine.submit, prompt, params, engine_id, lora)
        self._track(handle, lora)
        return handle

    def _submit(
        self, prompt_ids: list[int], params: SamplingParams, wanted_id: str, lora: LoRARequest | None
    ) -> RequestHandle:
        """Queue one request under `wanted_id`, or a unique variant of it while another request holds it."""
        with self._engine_id(wanted_id, param="prompt") as engine_id:
            handle = self.engine.submit(prompt_ids, params, engine_id, lora)
        self._track(handle, lora)
        return handle

    @contextlib.contextmanager
    def _engine_id(self, wanted_id: str, param: str) -> Iterator[str]:
        """An engine id of `wanted_id` (EngineIds.claim) for the submit in the block, freed if that fails; the engine's
        refusal (ValueError, TypeError) is a 400 naming `param`."""
        engine_id = self.engine_ids.claim(wanted_id)
        try:
            yield engine_id
        except BaseException as error:
            self.engine_ids.release(engine_id)
            if isinstance(error, ValueError | TypeError):
                raise APIError(400, str(error), param=param) from error
            raise

    def _track(self, handle: RequestHandle, lora: LoRARequest | None) -> None:
        """Observe every request when it ends, however its handling ends (a stream closed early too), and free its
        engine id then."""
        recorder = asyncio.ensure_future(self._record(handle, None if lora is None else lora.lora_name))
        self._recorders.add(recorder)
        recorder.add_done_callback(self._recorders.discard)

    async def _record(self, handle: RequestHandle, adapter: str | None) -> None:
        try:
            with contextlib.suppress(Exception):
                self.metrics.record(await handle, adapter)
        finally:
            self.engine_ids.release(handle.request_id)

    async def _wait(self, handle: RequestHandle, request: Request) -> RequestOutput:
        """The finished output; a client that disconnects first, or a cancelled task, aborts it."""
        waiter = asyncio.ensure_future(handle)
        try:
            while not (await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_SECONDS))[0]:
                if await request.is_disconnected():
                    handle.abort()
                    break
            output = await waiter
        except BaseException:
            handle.abort()
            raise
        if output.error is not None:
            raise APIError(500, output.error, error_type="server_error")
        return output

    async def _events(
        self,
        handles: list[RequestHandle],
        header: dict[str, Any],
        prompts: list[list[int]],
        n: int,
        body: SamplingFields,
        choice: Callable[[int, StreamDelta, bool, _Pending], dict[str, Any]],
    ) -> AsyncIterator[str]:
        """OpenAI's server-sent events for the requests of one body (one per prompt, of token ids `prompts`, their
        deltas as they come), ending with `data: [DONE]`. The chunk that finishes the last choice carries the usage;
        with stream_options.include_usage a last chunk without choices carries it too, as OpenAI sends it. A chunk's
        logprobs are those of the tokens since the choice's last chunk (a token whose text is held back waits
        for the chunk that shows it). With return_token_ids, the prompt's token ids come in the first chunk, as vLLM
        sends them: a chat's beside its choices, a completion's in each prompt's first choice. Closing or cancelling
        the stream (the client went away) aborts them all."""
        num_prompt_tokens = sum(map(len, prompts))
        chat = header["object"] == "chat.completion.chunk"
        num_completion_tokens, num_finished = 0, 0
        pending: dict[tuple[int, int], _Pending] = {}
        finished = False
        deltas = _merged(handles)
        try:
            async for prompt_index, delta in deltas:
                if delta.error is not None:
                    yield _event(error_body(delta.error, "server_error"))
                    break
                num_completion_tokens += len(delta.token_ids)
                num_finished += delta.finish_reason is not None
                first = (prompt_index, delta.index) not in pending
                held = pending.setdefault((prompt_index, delta.index), _Pending())
                held.all_token_ids += delta.token_ids
                held.unsent_token_ids += delta.token_ids
                if delta.logprobs is not None:
                    held.token_ids += delta.token_ids
                    held.logprobs += delta.logprobs
                if not (delta.text or delta.finish_reason or first):
                    continue
                chunk = {**header, "choices": [choice(prompt_index, delta, first, held)]}
                if body.return_token_ids and first:
                    if not chat:
                        chunk["choices"][0]["prompt_token_ids"] = prompts[prompt_index]
                    elif len(pending) == 1:
                        chunk["prompt_token_ids"] = prompts[0]
                if num_finished == n * len(handles):
                    chunk["usage"] = usage(num_prompt_tokens, num_completion_tokens)
                yield _event(chunk)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield _event({**header, "choices": [], "usage": usage(num_prompt_tokens, num_completion_tokens)})
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            await deltas.aclose()
            if not finished:
                for handle in handles:
                    handle.abort()

    def _completion_choice(
        self,
        prompt_index: int,
        delta: StreamDelta,
        first: bool,
        held: _Pending,
        echoes: list[str],
        n: int,
        num_top: int,
        token_ids: bool,
    ) -> dict[str, Any]:
        logprobs = None
        if delta.logprobs is not None:
            logprobs, held.text_offset = self.token_text.completion_logprobs_of(*held.take(), num_top, held.text_offset)
        text = echoes[prompt_index] + delta.text if first else delta.text
        index = prompt_index * n + delta.index
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        if token_ids:
            choice["token_ids"] = held.take_token_ids()
        return choice

    def _chat_choice(
        self,
        prompt_index: int,
        delta: StreamDelta,
        first: bool,
        held: _Pending,
        tools: ToolPlan,
        num_top: int,
        token_ids: bool,
    ) -> dict[str, Any]:
        """A chat chunk. A named tool_choice streams its one call's arguments as they come, as OpenAI does (the
        first chunk names the function). With other tools, text from where the calls start is held back; the
        calls come with the finishing chunk, one entry each (complete arguments), or the held text if they did
        not parse."""
        if tools.named is not None:
            return self._named_call_chunk(delta, first, held, tools.named, num_top)
        if tools.forced_schema is not None:
            return self._required_calls_chunk(delta, first, held, num_top)
        text, finish_reason, calls = delta.text, delta.finish_reason, []
        if tools.parses:
            held.text += delta.text
            raw = self._raw_text(held.all_token_ids)
            marker = tools.marker
            if not held.in_calls and tools.calls_started(held.text, raw):
                held.in_calls = True
                held.content_end = held.text.find(marker) if marker and marker in held.text else held.num_sent
            end = held.content_end if held.in_calls else len(held.text) - _marker_prefix(held.text, marker)
            if finish_reason is not None:
                _, calls = tools.split(held.text, raw)  # the content before the calls was streamed already
                if not calls:  # not calls after all: all the held text is content
                    end = len(held.text)
                elif finish_reason == "stop":
                    finish_reason = "tool_calls"
            text = held.text[held.num_sent : max(end, held.num_sent)]
            held.num_sent += len(text)
        message: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        if calls:
            message["tool_calls"] = [call.as_openai(index) for index, call in enumerate(calls)]
        logprobs = None
        if delta.logprobs is not None:
            logprobs = self.token_text.chat_logprobs_of(*held.take(), num_top)
        choice = {"index": delta.index, "delta": message, "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids:
            choice["token_ids"] = held.take_token_ids()
        return choice

    def _named_call_chunk(
        self, delta: StreamDelta, first: bool, held: _Pending, name: str, num_top: int
    ) -> dict[str, Any]:
        """A chunk of a named tool_choice's stream: the whole output is the function's arguments (held to its
        schema), so each delta's text is the next piece of them."""
        call: dict[str, Any] = {"index": 0, "function": {"arguments": delta.text}}
        message: dict[str, Any] = {"tool_calls": [call]}
        if first:
            call.update(id=tool_calls.ToolCall(name, "").id, type="function")
            call["function"]["name"] = name
            message = {"role": "assistant", "content": None, **message}
        finish_reason = "tool_calls" if delta.finish_reason == "stop" else delta.finish_reason
        logprobs = self.token_text.chat_logprobs_of(*held.take(), num_top) if delta.logprobs is not None else None
        return {"index": delta.index, "delta": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def _required_calls_chunk(self, delta: StreamDelta, first: bool, held: _Pending, num_top: int) -> dict[str, Any]:
        """A chunk of tool_choice "required"'s stream (the output a list of calls, held to its schema): each call's id
        and name once written, then its arguments' new text, as OpenAI and vLLM stream them; a call cut by max_tokens
        ends with finish_reason "length", as far as it went."""
        held.text += delta.text
        pieces = []
        for index, (name, arguments, _) in enumerate(tool_calls.required_calls_so_far(held.text)):
            piece: dict[str, Any] = {"index": index}
            function: dict[str, Any] = {}
            if index == len(held.arguments_sent):  # a new call: its id and name first
                held.arguments_sent.append(0)
                piece.update(id=tool_calls.ToolCall(name, "").id, type="function")
                function["name"] = name
            new = arguments[held.arguments_sent[index] :]
            if new or function:
                function["arguments"] = new
                held.arguments_sent[index] = len(arguments)
                pieces.append({**piece, "function": function})
        message: dict[str, Any] = {"role": "assistant", "content": None} if first else {}
        if pieces:
            message["tool_calls"] = pieces
        finish_reason = "tool_calls" if delta.finish_reason == "stop" else delta.finish_reason
        logprobs = self.token_text.chat_logprobs_of(*held.take(), num_top) if delta.logprobs is not None else None
        return {"index": delta.index, "delta": message, "logprobs": logprobs, "finish_reason": finish_reason}


async def _merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """(prompt index, delta) of every handle's deltas, as they come; closing it closes each handle's stream
    (which aborts a request that has not finished)."""
    if len(handles) == 1:
        async for delta in handles[0].deltas():
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, StreamDelta] | None] = asyncio.Queue()

    async def feed(prompt_index: int, handle: RequestHandle) -> None:
        try:
            async for delta in handle.deltas():
                await queue.put((prompt_index, delta))
        finally:
            await queue.put(None)

    feeders = [asyncio.ensure_future(feed(i, handle)) for i, handle in enumerate(handles)]
    try:
        remaining = len(feeders)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield item
    finally:
        for feeder in feeders:
            feeder.cancel()
        await asyncio.gather(*feeders, return_exceptions=True)


@dataclass(slots=True)
class _Pending:
    """A streamed choice's tokens and logprobs not yet sent, and where its next token's text starts."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    text_offset: int = 0
    # `return_token_ids`: the tokens not yet sent in a chunk's token_ids.
    unsent_token_ids: list[int] = field(default_factory=list)
    # With tools: every token and the text so far, how much of it was sent, and whether calls have begun.
    all_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_sent: int = 0
    in_calls: bool = False
    content_end: int = 0  # where the content ends once the calls have begun
    arguments_sent: list[int] = field(default_factory=list)  # tool_choice "required": each call's arguments sent

    def take(self) -> tuple[list[int], list[dict[int, Logprob]]]:
        """The tokens and logprobs not yet sent, now sent."""
        taken = self.token_ids, self.logprobs
        self.token_ids, self.logprobs = [], []
        return taken

    def take_token_ids(self) -> list[int]:
        """The tokens no chunk's token_ids has shown yet, now shown."""
        taken, self.unsent_token_ids = self.unsent_token_ids, []
        return taken


@dataclass(frozen=True)
class ToolPlan:
    """A chat's tool calls: parsed from the text in `parser`'s format (tool_choice "auto"), or the whole output
    held to `forced_schema` (tool_choice "required": a list of calls; a named function: its arguments)."""

    parser: str | None = None
    single: bool = False
    forced_schema: dict[str, Any] | None = None
    named: str | None = None

    @property
    def parses(self) -> bool:
        return self.parser is not None or self.forced_schema is not None

    @property
    def marker(self) -> str:
        return tool_calls.start_marker(self.parser) if self.parser is not None else ""

    def calls_started(self, text: str, raw: str) -> bool:
        if self.forced_schema is not None:
            return True
        marker = self.marker
        if self.parser in ("llama3_json", "pythonic"):  # the whole answer is the calls
            stripped = raw.strip().removeprefix("<|python_tag|>").lstrip()
            return stripped.startswith(marker) or stripped.startswith("```tool_code")
        return marker in raw

    def split(self, text: str, raw: str) -> tuple[str | None, list[tool_calls.ToolCall]]:
        """The content and the calls of a finished sample's text (`raw`: with special tokens)."""
        if self.forced_schema is not None:  # the whole output is calls: never content, even cut short
            return None, tool_calls.forced_calls(text, self.named)
        if self.parser is None:
            return text, []
        content, calls = tool_calls.parse(self.parser, raw)
        if not calls:
            return text, []
        return content, calls[:1] if self.single else calls


def _marker_prefix(text: str, marker: str) -> int:
    """How many of text's last characters could begin `marker` (held back until they cannot)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def rendered_request(request_id: str, token_ids: list[int], model: str | None) -> dict[str, Any]:
    """A render's answer for one prompt: vLLM's `GenerateRequest` fields that name the prompt (vllm-router reads
    `token_ids`, and refuses an item whose `features`, vLLM's multimodal data, is not null). The request's sampling
    settings are not included: this server runs no `GenerateRequest` (vLLM's /inference/v1/generate)."""
    return {"request_id": request_id, "token_ids": token_ids, "features": None, "model": model}


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _output_usage(output: RequestOutput) -> dict[str, int]:
    return usage(len(output.prompt_token_ids), sum(len(sample.token_ids) for sample in output.outputs))


def _setting_named(message: str) -> str | None:
    """The setting a SamplingParams message starts with ("top_p must be in (0, 1], got 2.0")."""
    name = message.split(" ", 1)[0]
    return name if name in SamplingParams.__dataclass_fields__ else None
