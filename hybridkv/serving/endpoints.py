"""`OpenAIServing`: OpenAI's completion and chat endpoints over an `AsyncLLMEngine`, without the HTTP.

A request's life: check the model name, make the prompt token ids (a chat through the tokenizer's
template), refuse a prompt over max_model_len, build `SamplingParams` (its checks are the 400s), submit,
then either await the whole output or turn its `StreamDelta`s into OpenAI's chunks. Whatever ends a
request's handling early (a client gone, a cancelled task) aborts the request, so its blocks return.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridkv.chat import chat_prompt
from hybridkv.outputs import RequestOutput, StreamDelta, TokenLogprobs
from hybridkv.sampling_params import SamplingParams
from hybridkv.serving.metrics import ServerMetrics
from hybridkv.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    TokenText,
    error_body,
    now,
    request_id,
    usage,
)

if TYPE_CHECKING:
    from starlette.requests import Request

    from hybridkv.async_engine import AsyncLLMEngine, RequestHandle

# OpenAI's default max_tokens for /v1/completions; a chat's default is what fits in max_model_len.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DISCONNECT_POLL_SECONDS = 0.5


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


class OpenAIServing:
    """The endpoints' logic over one engine and the one model name it answers to."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.llm.tokenizer
        self.max_model_len = engine.llm.max_model_len
        self.token_text = TokenText(self.tokenizer)
        self.metrics = ServerMetrics()
        self._recorders: set[asyncio.Task[None]] = set()

    def models(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": now(), "owned_by": "hybridkv"}
        return {"object": "list", "data": [{**card, "max_model_len": self.max_model_len}]}

    async def completion(self, body: CompletionRequest, request: Request) -> dict[str, Any] | AsyncIterator[str]:
        """`/v1/completions`: the response body, or the server-sent events of a stream."""
        self._check_model(body.model)
        prompt_ids = self._completion_prompt_ids(body.prompt)
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = self._params(body, prompt_ids, max_tokens, body.logprobs)
        handle, created = self._submit(prompt_ids, params, "cmpl"), now()
        header = {"id": handle.request_id, "object": "text_completion", "created": created, "model": self.model_name}
        if body.stream:
            return self._events(handle, header, len(prompt_ids), params.n, body, self._completion_choice)
        output = await self._wait(handle, request)
        choices = [
            {
                "index": sample.index,
                "text": sample.text,
                "logprobs": self.token_text.completion_logprobs(sample),
                "finish_reason": sample.finish_reason,
            }
            for sample in output.outputs
        ]
        return {**header, "choices": choices, "usage": _output_usage(output)}

    async def chat(self, body: ChatCompletionRequest, request: Request) -> dict[str, Any] | AsyncIterator[str]:
        """`/v1/chat/completions`: the response body, or the server-sent events of a stream."""
        self._check_model(body.model)
        try:
            _, prompt_ids = chat_prompt(self.tokenizer, [message.as_dict() for message in body.messages])
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), param="messages") from error
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - len(prompt_ids))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._params(body, prompt_ids, max_tokens, logprobs)
        handle, created = self._submit(prompt_ids, params, "chatcmpl"), now()
        header = {"id": handle.request_id, "object": "chat.completion", "created": created, "model": self.model_name}
        if body.stream:
            header["object"] = "chat.completion.chunk"
            return self._events(handle, header, len(prompt_ids), params.n, body, self._chat_choice)
        output = await self._wait(handle, request)
        choices = [
            {
                "index": sample.index,
                "message": {"role": "assistant", "content": sample.text},
                "logprobs": self.token_text.chat_logprobs(sample),
                "finish_reason": sample.finish_reason,
            }
            for sample in output.outputs
        ]
        return {**header, "choices": choices, "usage": _output_usage(output)}

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404, f"model {model!r} does not exist; this server serves {self.model_name!r}", param="model"
            )

    def _completion_prompt_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(
                    400,
                    f"got {len(prompt)} prompts; send one prompt per request (requests run concurrently)",
                    param="prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this server has no tokenizer: send the prompt as token ids", param="prompt")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        return list(prompt)

    def _params(
        self, body: SamplingFields, prompt_ids: list[int], max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        if len(prompt_ids) > self.max_model_len:
            raise APIError(
                400,
                f"prompt has {len(prompt_ids):,} tokens but max_model_len is {self.max_model_len:,}; "
                "shorten the prompt (or serve with a larger --max-model-len)",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )
        try:
            return body.sampling_params(max_tokens, logprobs)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), param=_setting_named(str(error))) from error

    def _submit(self, prompt_ids: list[int], params: SamplingParams, prefix: str) -> RequestHandle:
        try:
            handle = self.engine.submit(prompt_ids, params, request_id=request_id(prefix))
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), param="prompt") from error
        # Every request is observed when it ends, however its handling ends (a stream closed early too).
        recorder = asyncio.ensure_future(self._record(handle))
        self._recorders.add(recorder)
        recorder.add_done_callback(self._recorders.discard)
        return handle

    async def _record(self, handle: RequestHandle) -> None:
        with contextlib.suppress(Exception):
            self.metrics.record(await handle)

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
        handle: RequestHandle,
        header: dict[str, Any],
        num_prompt_tokens: int,
        n: int,
        body: SamplingFields,
        choice: Callable[[StreamDelta, bool, _Pending], dict[str, Any]],
    ) -> AsyncIterator[str]:
        """OpenAI's server-sent events for one request, ending with `data: [DONE]`. The chunk that
        finishes the last choice carries the usage; with stream_options.include_usage a last chunk
        without choices carries it too, as OpenAI sends it. A chunk's logprobs are those of the tokens
        since the choice's last chunk (a token whose text is held back waits for the chunk that shows it).
        Closing or cancelling the stream (the client went away) aborts the request."""
        num_completion_tokens, num_finished = 0, 0
        pending: dict[int, _Pending] = {}
        finished = False
        try:
            async for delta in handle.deltas():
                if delta.error is not None:
                    yield _event(error_body(delta.error, "server_error"))
                    break
                num_completion_tokens += len(delta.token_ids)
                num_finished += delta.finish_reason is not None
                first = delta.index not in pending
                held = pending.setdefault(delta.index, _Pending())
                if delta.logprobs is not None:
                    held.token_ids += delta.token_ids
                    held.logprobs += delta.logprobs
                if not (delta.text or delta.finish_reason or first):
                    continue
                chunk = {**header, "choices": [choice(delta, first, held)]}
                if num_finished == n:
                    chunk["usage"] = usage(num_prompt_tokens, num_completion_tokens)
                yield _event(chunk)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield _event({**header, "choices": [], "usage": usage(num_prompt_tokens, num_completion_tokens)})
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                handle.abort()

    def _completion_choice(self, delta: StreamDelta, first: bool, held: _Pending) -> dict[str, Any]:
        logprobs = None
        if delta.logprobs is not None:
            logprobs, held.text_offset = self.token_text.completion_logprobs_of(
                held.token_ids, held.logprobs, held.text_offset
            )
            held.token_ids, held.logprobs = [], []
        return {"index": delta.index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}

    def _chat_choice(self, delta: StreamDelta, first: bool, held: _Pending) -> dict[str, Any]:
        message = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        logprobs = None
        if delta.logprobs is not None:
            logprobs = self.token_text.chat_logprobs_of(held.token_ids, held.logprobs)
            held.token_ids, held.logprobs = [], []
        return {"index": delta.index, "delta": message, "logprobs": logprobs, "finish_reason": delta.finish_reason}


@dataclass(slots=True)
class _Pending:
    """A streamed choice's tokens and logprobs not yet sent, and where its next token's text starts."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text_offset: int = 0


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _output_usage(output: RequestOutput) -> dict[str, int]:
    return usage(len(output.prompt_token_ids), sum(len(sample.token_ids) for sample in output.outputs))


def _setting_named(message: str) -> str | None:
    """The setting a SamplingParams message starts with ("top_p must be in (0, 1], got 2.0")."""
    name = message.split(" ", 1)[0]
    return name if name in SamplingParams.__dataclass_fields__ else None
