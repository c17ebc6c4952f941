"""`RunLoops`: the engine's loops over steps for callers that want results, not steps: `generate` and
`chat` run requests to completion, `stream` yields one request's deltas as they come.

A mixin of `LLMEngine` (hybridkv/engine/llm_engine.py), built on its request and step methods; every loop is
`exclusive` like the engine's other public calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hybridkv.engine.call_guard import exclusive
from hybridkv.engine.chat import ChatOptions, Messages, chat_images, chat_prompt, conversations, image_chat_prompt
from hybridkv.engine.stream import RequestStream
from hybridkv.execution.inputs import Prompt, prompt_list, refuse_lora_request
from hybridkv.execution.progress import progress_bar
from hybridkv.outputs import RequestOutput, StreamDelta
from hybridkv.sampling.beam_search import BeamSearchOutput, BeamSearchParams
from hybridkv.scheduling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hybridkv.engine.output_processor import RequestState


class RunLoops:
    """`generate`, `chat`, `beam_search` and `stream` over `LLMEngine`'s `_checked_request`, `_enqueue`,
    `_abort` and `step`."""

    @exclusive
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.generate`: run every prompt to completion; outputs come back in input order. A prompt is
        text, token ids, a 1-D tensor, or vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}` (with
        `multi_modal_data` for images); a [B, N] tensor is B prompts. `sampling_params`: one for all prompts, one
        each, or None for the model's defaults (`get_default_sampling_params`). Every prompt and params are
        checked before any is queued; if the call fails or is interrupted, the requests it queued are aborted.
        `priority` changes nothing here (accepted as vLLM's); a `lora_request` is refused."""
        refuse_lora_request(lora_request)
        prompts = prompt_list(prompts)
        params = _params_for(sampling_params, len(prompts), "prompts")
        checked = [self._checked_request(prompt, p, None) for prompt, p in zip(prompts, params, strict=True)]
        return self._run_to_completion(checked, use_tqdm)

    @exclusive
    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: `generate` for conversations (one, or a list of them), each rendered with the
        tokenizer's chat template, or `chat_template` (Jinja text), with `add_generation_prompt` (the model answers as
        the assistant) or `continue_final_message` (it continues the last message), and `chat_template_kwargs` for
        the template (e.g. `enable_thinking`). `tools`, OpenAI's function definitions, go to the template
        (hybridkv.serving.tool_calls parses the calls out of the text); a tokenizer without a template is a clear error.
        A message's content may be HF's parts, images among them (`{"type": "image", "image": image}`): the processor
        given to patch renders and processes that conversation."""
        refuse_lora_request(lora_request)
        if chat_template_content_format != "auto":
            raise ValueError(
                f"chat_template_content_format={chat_template_content_format!r}: hybridkv gives the template each "
                "message's content as it is ('auto'); convert the contents yourself"
            )
        options = ChatOptions(chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs)
        rendered = []
        for conversation in conversations(messages):
            images = chat_images(conversation)
            if images:  # content parts with images: the processor renders and processes them
                rendered.append(image_chat_prompt(self.processor, conversation, images, tools, options))
            else:
                rendered.append(chat_prompt(self.tokenizer, conversation, tools, options))
        params = _params_for(sampling_params, len(rendered), "conversations")
        checked = []
        for (text, prompt), p in zip(rendered, params, strict=True):
            checked.append(self._checked_request(prompt, p, None)._replace(prompt_text=text))
        return self._run_to_completion(checked, use_tqdm)

    @exclusive
    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: beam search for every prompt (vLLM's `{"prompt": text}` /
        `{"prompt_token_ids": ids}` dicts, or plain text or ids), in the same continuous batch as any other request
        (see hybridkv/sampling/beam_search.py for the rule, transformers' `generate(num_beams=...)`); one output per
        prompt, in input order, whose `.sequences` are its beam_width best hypotheses, best first, each with the
        prompt's and its own tokens and text, as vLLM's. `concurrency_limit` changes nothing here: every search runs in
        the batch."""
        refuse_lora_request(lora_request)
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a hybridkv.BeamSearchParams, got {type(params).__name__}")
        prompts = prompt_list(prompts)
        checked = [self._checked_request(prompt, params, None) for prompt in prompts]
        outputs = self._run_to_completion(checked, use_tqdm)
        for output in outputs:
            if output.error:
                raise RuntimeError(f"beam search of request {output.request_id!r} failed: {output.error}")
        return [BeamSearchOutput.of(output, params, self.tokenizer) for output in outputs]

    def _run_to_completion(
        self, checked: list[tuple[str, str | None, list[int], SamplingParams]], use_tqdm: bool
    ) -> list[RequestOutput]:
        """Queue checked requests and step until all finish; if that fails or is interrupted, abort them."""
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        progress = progress_bar(len(checked), use_tqdm)
        try:
            ids.extend(self._enqueue(*request) for request in checked)
            wanted = set(ids)
            while len(done) < len(ids):
                for output in self._step_claiming(wanted):
                    if output.finished:
                        done[output.request_id] = output
                        progress.update(1)
        except BaseException:
            for request_id in ids:
                self._abort(request_id)
            raise
        finally:
            progress.close()
        return [done[request_id] for request_id in ids]

    @exclusive
    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request and return its stream: iterating it yields each sample's new tokens and text
        (`StreamDelta`) as the engine produces them, until the request ends. Closing the stream, or
        dropping it, aborts the request. Other queued requests keep running meanwhile; their results
        wait for the next step() call."""
        if isinstance(sampling_params, BeamSearchParams):
            raise ValueError(
                "beam search does not stream: its best sequences are known only at the end; use beam_search()"
            )
        if sampling_params is not None and sampling_params.num_samples > sampling_params.n:
            raise ValueError(
                f"best_of={sampling_params.best_of} > n={sampling_params.n} does not stream: the best samples are "
                "known only at the end; use generate(), or best_of=n"
            )
        request_id = self._enqueue(*self._checked_request(prompt, sampling_params, request_id))
        return RequestStream(self, self.outputs.states[request_id])

    @exclusive
    def _advance_stream(self, state: RequestState) -> tuple[list[StreamDelta], bool]:
        """Step until the stream's request has news (unless it ended elsewhere, e.g. aborted); its deltas
        and whether it finished."""
        if not state.output.finished:
            self._step_claiming({state.group.request_id})
        return self.outputs.stream_deltas(state), state.output.finished

    def _step_claiming(self, wanted: set[str]) -> list[RequestOutput]:
        """One step; finished outputs of requests not in `wanted` are kept for the caller of step()."""
        outputs = self.step()
        mine = [o for o in outputs if o.request_id in wanted]
        self._unclaimed.extend(o for o in outputs if o.request_id not in wanted and o.finished)
        return mine


def _params_for(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int, what: str
) -> list[SamplingParams | None]:
    """One SamplingParams per prompt: the same for all (None: the model's defaults), or one each."""
    if isinstance(params, (SamplingParams, BeamSearchParams)) or params is None:
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {count} {what} but {len(params)} SamplingParams; give one or one each")
    return params
