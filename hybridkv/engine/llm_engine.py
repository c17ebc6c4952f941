"""The engine's front, `LLMEngine`: prompts in (`add_request`, `generate`, `chat`, `stream`, `beam_search`), outputs
out (`RequestOutput`s, streams), over an `EngineCore` (hybridkv/engine/core.py) that schedules, executes, samples and
updates.

A step, synchronous: `core.schedule()` -> `core.execute(plan)` (prompt logprobs recorded here) -> `core.sample` ->
`core.update` -> `OutputProcessor.process` (text, logprobs, stop decisions) -> `core.finish` for each request that
stopped -> the step's reports. With async scheduling `AsyncSteps` (hybridkv/engine/async_steps.py) composes the same
steps one ahead.

What comes before and after a step lives beside it: `hybridkv/execution/inputs.py` (prompts into checked ids),
`hybridkv/engine/output_processor.py` (text, logprobs, stop decisions, outputs), `hybridkv/engine/stream.py` (a
streamed request), `hybridkv/engine/stats.py` (`stats()`).

Every public call is `exclusive` (one thread at a time; none after `unpatch`). Nothing is lost on the way out: a
request whose call fails or is interrupted (KeyboardInterrupt) is aborted, and every block it held returns to the
pool.

The engine follows the model (`hybridkv/execution/model_watch.py`): the first step of a call that may admit a request
(or replay a CUDA graph) checks whether the model changed since the last call, and a request admitted after a change is
hashed under the new model's key, so the prefix cache never serves it K/V of the old one. What it does not follow, an
attention implementation switched or an attention-shaping config value edited, the first step of every call refuses
(`hybridkv/execution/layout_watch.py`), naming `hybridkv.patch(model)` again. The EOS ids and sampling defaults are read
from the generation config and the tokenizer as they are when each request is checked
(`hybridkv/engine/generation_settings.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch

from hybridkv.engine.async_steps import AsyncSteps
from hybridkv.engine.call_guard import CLOSED_MESSAGE, exclusive
from hybridkv.engine.chat import ChatOptions, Messages, chat_images, chat_prompt, conversations, image_chat_prompt
from hybridkv.engine.core import NOTHING_SAMPLED, EngineCore, PromptLogprobs, Reload, SampledTokens, WeightMemory
from hybridkv.engine.generation_settings import GenerationSettings
from hybridkv.engine.metrics import Metric, engine_metrics
from hybridkv.engine.output_processor import OutputProcessor, RequestState, SampleState, sampling_rows
from hybridkv.engine.speculation import check_draft
from hybridkv.engine.stats import engine_stats
from hybridkv.engine.stream import RequestStream
from hybridkv.execution.config import EngineConfig
from hybridkv.execution.eval_semantics import eval_modules, evaluating, restore_training
from hybridkv.execution.inputs import (
    InputProcessor,
    Prompt,
    plain_prompt,
    prompt_list,
)
from hybridkv.execution.layout_watch import ModelReshaped
from hybridkv.execution.multimodal import ImageEncoder, MultiModalInputs
from hybridkv.execution.progress import progress_bar
from hybridkv.execution.sizing import min_num_blocks
from hybridkv.lora.request import AdapterRef
from hybridkv.memory.grouping import KVCacheConfig
from hybridkv.outputs import RequestOutput, StreamDelta
from hybridkv.patches import attention
from hybridkv.patches.probe import image_attention_layers
from hybridkv.sampling.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from hybridkv.sampling.sampler import SampledLogprobs
from hybridkv.sampling.structured_outputs import GrammarCompiler
from hybridkv.scheduling.output import SchedulerOutput
from hybridkv.scheduling.request import Request, RequestStatus, SampleGroup
from hybridkv.scheduling.sampling_params import RequestOutputKind, SamplingParams
from hybridkv.scheduling.stopping import StopRules
from hybridkv.scheduling.validation import check_bool

__all__ = ["CheckedRequest", "EngineConfig", "LLMEngine", "Prompt", "min_num_blocks"]


class CheckedRequest(NamedTuple):
    """A request as `check_request` passed it, what `enqueue` takes."""

    request_id: str
    prompt_text: str | None
    prompt_ids: list[int]
    params: SamplingParams | BeamSearchParams
    multimodal: MultiModalInputs | None = None
    lora: AdapterRef | None = None


class LLMEngine:
    """A continuous-batching engine bound to one Hugging Face model (see `hybridkv.patch`): the front over its
    `EngineCore` (`core`)."""

    def __init__(
        self, model: torch.nn.Module, tokenizer: Any = None, config: EngineConfig | None = None, processor: Any = None
    ) -> None:
        config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.processor = processor
        self.config = config
        # The samples' records, made before the core, which reads their sampling rows (`sampling_rows`), and held by
        # the output processor, which fills them.
        samples: dict[Request, SampleState] = {}
        self.core = EngineCore(model, config, functools.partial(sampling_rows, samples), self._draft_engine)
        self._build_requests(samples)
        # Finished outputs no caller claimed yet (those of `abort_request`, of a loop's step that other requests
        # finished in, of an async step finished early): the next `step()` returns them first.
        self.unclaimed: list[RequestOutput] = []
        # Requests added with output_kind FINAL_ONLY: step() reports them once, finished (vLLM's rule).
        self.final_only: set[str] = set()
        self._said_weights_stay = False  # sleep() says once that a caller's model keeps its weights
        self._weights_moved = False  # woken at new addresses while the pages slept: followed when both are awake
        # Streams dropped while an engine call was under way: aborted when the next call begins.
        self._pending_aborts: deque[str] = deque()
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._depth = 0  # engine calls under way in the owning thread (they nest)
        self._training_modules: list[torch.nn.Module] = []  # switched to eval for the call under way (`_begin_call`)
        self._closed = False
        self.step_seconds = 0.0
        self.update_seconds = 0.0
        # The model as the caches know it: checked at most once per engine call (`follow_model`).
        self._model_checked = True
        # The attention implementation and config the layout was built for: checked at the first step of each call.
        self._layout_checked = True
        speculates = self.core.speculator is not None
        ahead = config.async_scheduling
        if ahead is None:
            ahead = self.core.on_one_gpu and not speculates
        self.async_steps = AsyncSteps(self.core, self.outputs, self) if ahead else None

    @classmethod
    def from_engine_args(
        cls, engine_args: Any, usage_context: Any = None, stat_loggers: Any = None, enable_multiprocessing: bool = False
    ) -> LLMEngine:
        """vLLM's `LLMEngine.from_engine_args`: load the checkpoint an `EngineArgs` names and bind an engine to it
        (`EngineArgs.create_engine`, hybridkv/engine/arg_utils.py). vLLM's other arguments change nothing here. A
        pooling model is refused: `LLM(model, runner="pooling")` serves it."""
        if engine_args.pooling_kind():
            raise ValueError(
                "these engine arguments name a pooling model, which LLMEngine does not step: use LLM(model=..., "
                "runner='pooling') and its embed / classify / score / reward"
            )
        return engine_args.create_engine()

    def _build_requests(self, samples: dict[Request, SampleState]) -> None:
        """What a request goes through besides the step: its prompt checked into ids, its images encoded, its
        grammar compiled, its outputs and stop rules, and the defaults of a request without sampling settings."""
        model, tokenizer = self.model, self.tokenizer
        self.inputs = InputProcessor(model, tokenizer)
        # The EOS ids and the defaults of a request without sampling settings of its own, read again when the
        # generation config or the tokenizer changes (`follow_generation_settings`).
        self.generation = GenerationSettings(model, tokenizer, read_defaults=self.config.generation_config == "auto")
        stop_rules = StopRules(self.eos_token_ids, self.max_model_len)
        self.outputs = OutputProcessor(tokenizer, stop_rules, self.core.input_device, samples)
        self.grammars = GrammarCompiler(tokenizer, self.inputs.vocab_size, self.eos_token_ids)
        self.images_refused: str | None = None  # why a model that takes images cannot get them here
        self.images = self._image_encoder(model, self.processor)

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a sample: the generation config's and the tokenizer's EOS ids, as of the last request
        checked (`follow_generation_settings`)."""
        return self.generation.eos_token_ids

    @property
    def default_sampling(self) -> dict[str, Any]:
        """What a request without sampling settings of its own takes (`get_default_sampling_params`), as the
        generation config is now."""
        self.follow_generation_settings()
        return self.generation.default_sampling

    def follow_generation_settings(self) -> None:
        """Read the EOS ids and sampling defaults again if the generation config or the tokenizer changed
        (`GenerationSettings.follow`, a few microseconds): from then on every sample stops at the new EOS ids (those
        running too), and grammars end there."""
        before = self.generation.eos_token_ids
        if self.generation.follow() and self.generation.eos_token_ids != before:
            self.outputs.stop_rules = StopRules(self.eos_token_ids, self.max_model_len)
            grammars = GrammarCompiler(self.tokenizer, self.inputs.vocab_size, self.eos_token_ids)
            grammars.counters = self.grammars.counters  # `stats()` counts over the engine's life
            self.grammars = grammars

    def _draft_engine(self, draft: torch.nn.Module, core: EngineCore) -> LLMEngine:
        """A draft model's engine for speculative decoding (`EngineCore`'s speculator): as many blocks as the model's,
        its length, greedy by default."""
        config = self.config
        draft_text_config = getattr(getattr(draft, "config", None), "get_text_config", lambda: None)()
        target_vocab = self.model.config.get_text_config().vocab_size
        check_draft(draft, self.model, target_vocab, draft_text_config, core.max_model_len)
        draft_config = EngineConfig(
            block_size=config.block_size,
            num_blocks=core.num_blocks,
            kv_cache_dtype=config.kv_cache_dtype,
            max_model_len=core.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            generation_config="vllm",
            attention_backend=config.attention_backend,
            cpu_threads=None,
            enforce_eager=config.enforce_eager,
            compile=config.compile,
            use_tqdm=False,
            async_scheduling=False,
        )
        with evaluating(draft):  # a draft in training mode is probed and checked without dropout, as the model is
            engine = LLMEngine(draft, None, draft_config)
        attention.install(draft)
        return engine

    def _image_encoder(self, model: torch.nn.Module, processor: Any) -> ImageEncoder | None:
        """Images for a model that takes them (a placeholder id and `get_image_features`): which layers let an
        image's tokens attend both ways is read from the model's own masks (hybridkv/patches/probe.py). A model that
        cannot say, or whose images would need what hybridkv does not run with them (state layers,
        chunked local attention, tensor parallelism), gets None: a prompt with images is then refused."""
        encoder = ImageEncoder(model, processor, bidirectional=False, cache_bytes=self.config.encoder_cache_bytes)
        if not encoder.serves_images:
            return None
        refused = self.core.images_refused()
        if refused is None:
            try:
                layers = image_attention_layers(model)
            except ValueError as error:
                refused = str(error)
            else:
                refused = self.core.images_refused(layers)
        if refused is not None:
            self.images_refused = refused
            return None
        encoder.bidirectional = bool(layers)
        return encoder

    # ---- read-only figures ------------------------------------------------------------------------

    @property
    def kv_config(self) -> KVCacheConfig:
        """The KV cache groups: which layers share pages, their kinds and block sizes (hybridkv/memory/grouping.py)."""
        return self.core.kv_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def kv_event_block_size(self) -> int:
        """The tokens per block of the KV events' group 0, what an index of them chunks prompts by (vllm-router's
        `--kv-event-block-size`); without events, of the prefix cache's hashes."""
        return self.core.kv_event_block_size

    @property
    def max_num_batched_tokens(self) -> int:
        return self.config.max_num_batched_tokens

    @property
    def bytes_per_block(self) -> int:
        return self.core.bytes_per_block

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def num_generated_tokens(self) -> int:
        return self.core.num_generated_tokens

    @property
    def num_forward_tokens(self) -> int:
        return self.core.num_forward_tokens

    @property
    def closed(self) -> bool:
        """Whether `close` ran (`hybridkv.unpatch`): every call is refused."""
        return self._closed

    # ---- requests -----------------------------------------------------------------------------

    @exclusive
    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | BeamSearchParams | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
        priority: int = 0,
    ) -> str:
        """Queue a request under `request_id` (vLLM's `LLMEngine.add_request`, its arguments in its order); returns
        the id. `prompt`: text (needs the tokenizer given to patch), token ids, or vLLM's dict prompts
        (`{"prompt": text}`, `{"prompt_token_ids": ids}`, with `multi_modal_data` for images). `params` None takes
        the model's default sampling settings (`get_default_sampling_params`). A request that can never run
        finishes at once with an error, reported by the next step. With BeamSearchParams the request is a beam
        search: its output, once finished, lists the beam_width best sequences. `lora_request` (a LoRARequest; the
        engine patched with enable_lora=True) runs it with that adapter. `arrival_time` and `priority` change nothing
        here (accepted as vLLM's)."""
        if not isinstance(request_id, str) or isinstance(prompt, (SamplingParams, BeamSearchParams)):
            raise TypeError(
                f"add_request takes (request_id, prompt, params), vLLM's order: request_id must be a str, got "
                f"{type(request_id).__name__} {request_id!r}, and prompt a prompt, got {type(prompt).__name__}"
            )
        kind = params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.CUMULATIVE
        if kind is RequestOutputKind.DELTA:
            raise ValueError(
                "output_kind=RequestOutputKind.DELTA: step() reports each request's live record (everything so far); "
                "for deltas, stream it (llm.stream(prompt, params)) or serve it with hybridkv.AsyncLLM, whose "
                "generate() yields deltas"
            )
        request_id = self.enqueue(self.check_request(prompt, params, request_id, lora_request=lora_request))
        if kind is RequestOutputKind.FINAL_ONLY:
            self.final_only.add(request_id)
        return request_id

    @exclusive
    def add_lora(self, lora_request: Any) -> bool:
        """vLLM's `add_lora`: read an adapter into the host cache ahead of its requests (a ValueError names what is
        wrong with it); True."""
        self.core.adapter(lora_request)
        return True

    @exclusive
    def remove_lora(self, lora_id: int) -> bool:
        """vLLM's `remove_lora`: drop the adapter of that `lora_int_id` from the host cache; whether it was there."""
        return self.core.lora is not None and self.core.lora.remove(lora_id)

    def list_loras(self) -> set[int]:
        """vLLM's `list_loras`: the `lora_int_id`s of the adapters in the host cache."""
        return set() if self.core.lora is None else self.core.lora.cached_ids()

    def get_tokenizer(self) -> Any:
        """The tokenizer given to patch (None without one), vLLM's name."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling settings a request without its own takes. With `generation_config="auto"` (the
        default) the model's generation config sets those it changes from transformers' defaults among
        temperature, top_k, top_p, min_p, repetition_penalty and max_new_tokens (as max_tokens); with "vllm",
        SamplingParams' own defaults. A new object each call: change it freely."""
        return SamplingParams(**self.default_sampling)  # read as the generation config is now

    def check_request(
        self,
        prompt: Prompt | dict[str, Any],
        params: SamplingParams | BeamSearchParams | None,
        request_id: str | None,
        follow_model: bool = True,
        lora_request: Any = None,
    ) -> CheckedRequest:
        """Everything add_request checks, before anything is queued: a ValueError or TypeError naming the fix. The
        request keeps a checked copy of its SamplingParams (`clone`), the model's defaults when it gives none.
        A dict prompt with images has them through the vision tower here (hybridkv/execution/multimodal.py), after the
        model is checked for changes (`follow_model`: False from a thread other than the engine's, which only reads the
        key; a request whose images another model encoded is refused when it is queued). A `lora_request`'s adapter is
        read here (`EngineCore.adapter`: a ValueError names what is wrong with it)."""
        if self.is_sleeping():
            raise RuntimeError("this engine is asleep (llm.sleep() gave its memory back): call llm.wake_up() first")
        lora = self.core.adapter(lora_request)
        self.follow_generation_settings()
        if params is None:
            params = self.get_default_sampling_params()
        elif isinstance(params, SamplingParams):
            params = params.clone()
        elif not isinstance(params, BeamSearchParams):
            raise TypeError(
                f"params must be a hybridkv.SamplingParams (or BeamSearchParams), got {type(params).__name__}"
            )
        if request_id is None:
            request_id = next(i for i in map(str, self._ids) if i not in self.outputs.states)
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}: pass str(...)")
        elif request_id in self.outputs.states:
            raise ValueError(f"request id {request_id!r} is already in use; give each request its own id")
        multimodal = None
        if isinstance(prompt, dict):
            prompt, cache_salt = plain_prompt(prompt)
            if cache_salt is not None:  # vLLM's prompt-level salt
                if isinstance(params, BeamSearchParams):
                    raise ValueError("a beam search's prompt takes no cache_salt")
                params = dataclasses.replace(params, cache_salt=cache_salt)
        if isinstance(prompt, dict):
            if follow_model and not self._model_checked:
                self.follow_model()
            prompt_text, prompt_ids, multimodal = self._multimodal_prompt(prompt)
        else:
            prompt_text, prompt_ids = self.inputs.tokenize(prompt)
        if isinstance(params, BeamSearchParams):
            return CheckedRequest(request_id, prompt_text, prompt_ids, params, multimodal, lora)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to hybridkv.patch, or use stop_token_ids")
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # checked now; kept for enqueue
        vocab_size = self.inputs.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(params, name)
            if count is not None and count > vocab_size:
                raise ValueError(
                    f"{name}={count} asks for more tokens than the vocabulary has ({vocab_size}); ask for at most "
                    f"{vocab_size}, or -1 for every token"
                )
        if params.logit_bias and max(params.logit_bias) >= vocab_size:
            raise ValueError(
                f"logit_bias names token id {max(params.logit_bias)}, outside the vocabulary [0, {vocab_size})"
            )
        return CheckedRequest(request_id, prompt_text, prompt_ids, params, multimodal, lora)

    def _multimodal_prompt(self, prompt: dict[str, Any]) -> tuple[str | None, list[int], MultiModalInputs | None]:
        if self.images is None:
            if self.images_refused and (prompt.get("multi_modal_data") or {}):
                raise ValueError(f"this model's prompts cannot hold images here: {self.images_refused}")
            encoder = ImageEncoder(self.model, self.processor, bidirectional=False)
        else:
            encoder = self.images
        text, ids, multimodal = encoder.inputs(prompt, self.core.model_key)
        placeholder = encoder.image_token_id if multimodal is not None else None
        self.inputs.check(ids, allowed=placeholder)
        if multimodal is not None and multimodal.bidirectional:
            longest = max(end - start for start, end in multimodal.spans)
            cap = self.core.chunk_cap()
            if longest > cap:
                raise ValueError(
                    f"an image of {longest} tokens attends both ways and must be computed in one prefill chunk, "
                    f"but chunks hold at most {cap} tokens: raise max_num_batched_tokens (and "
                    "long_prefill_token_threshold)"
                )
        return text, ids, multimodal

    def enqueue(self, checked: CheckedRequest) -> str:
        """Queue a request `check_request` passed (its records made, its groups given to the core); its id."""
        request_id, prompt_text, prompt_ids, params, multimodal, lora = checked
        model_key = self.core.model_key
        if multimodal is not None and multimodal.model_key != model_key:
            raise ValueError(
                "the model changed (weights or adapters) while this request's images were encoded, so their "
                "embeddings are the old model's; submit the request again"
            )
        block_size = self.config.block_size if self.config.enable_prefix_caching else None
        if isinstance(params, BeamSearchParams):
            search = BeamSearch(
                request_id,
                prompt_ids,
                params,
                self.eos_token_ids,
                self.max_model_len,
                block_size,
                multimodal,
                model_key,
                lora,
            )
            group = search.group
        else:
            group = SampleGroup.of(request_id, prompt_ids, params, block_size, multimodal, model_key, lora)
        # More samples than max_num_seqs run in parts that queue as requests of their own (a beam runs as a whole).
        parts = [group] if group.beam is not None else group.parts(self.config.max_num_seqs)
        grammar = None
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
        state = self.outputs.add(parts, prompt_text, grammar)
        if self.core.speculates(params):
            for member in state.members:  # proposed for after each step (`EngineCore.propose`)
                member.speculates = True
        if not all([self.core.add_request(part) for part in parts]):
            self.outputs.unreported.append(state)
        return request_id

    @exclusive
    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; every block it held, on the device or in swap space, is returned. Its output (None
        for an id that is not running)."""
        return self._abort(request_id)

    @exclusive
    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """vLLM's `LLMEngine.abort_request`: abort one request or several (ids that are not running are passed
        over); their outputs come with the next `step()`."""
        for request_id in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            output = self._abort(request_id)
            if output is not None:
                self.unclaimed.append(output)

    @exclusive
    def abort_all(self) -> list[RequestOutput]:
        """Abort every unfinished request (e.g. after an interrupted loop of your own); returns their outputs."""
        return [self._abort(request_id) for request_id in list(self.outputs.states)]

    def _abort(self, request_id: str) -> RequestOutput | None:
        self.final_only.discard(request_id)
        state = self.outputs.states.get(request_id)
        if state is None:
            return None
        for part in state.parts:
            self.core.finish_group(part, RequestStatus.FINISHED_ABORTED)
        return self.outputs.output(state)

    def sample_request(self, request_id: str) -> Request:
        """The scheduler's request of an unfinished request of one sample (a draft model's, for speculation)."""
        return self.outputs.states[request_id].members[0]

    def continue_from(self, request_id: str, token_ids: Sequence[int], known: int = 0) -> bool:
        """A running request of one sample goes on from `token_ids` instead of its own tokens (a draft model's request
        between two rounds of speculative decoding, hybridkv/engine/speculation.py): its tokens are cut where the two
        part (the first `known` are the same, the caller knows) and the rest of `token_ids` appended, which its next
        step computes over the K/V of the tokens they share. Only where full attention alone holds what it computed
        (`EngineCore.full_attention_only`) and the cut leaves its computed full blocks (which the prefix cache may
        hold) as they are; False otherwise, changing nothing."""
        state = self.outputs.states.get(request_id)
        if not self.core.full_attention_only or state is None or len(state.members) != 1:
            return False
        request = state.members[0]
        if request.status is not RequestStatus.RUNNING or request.num_pending_tokens:
            return False
        own = request.token_ids
        shared = min(known, len(own), len(token_ids))
        while shared < len(own) and shared < len(token_ids) and own[shared] == token_ids[shared]:
            shared += 1
        block_size = self.config.block_size
        if shared < request.num_prompt_tokens or shared < request.num_computed_tokens // block_size * block_size:
            return False
        del own[shared:]
        del request.block_hashes[shared // block_size :]
        completion = self.outputs.samples[request].completion
        del completion.token_ids[shared - request.num_prompt_tokens :]
        request.num_computed_tokens = min(request.num_computed_tokens, shared)
        added = token_ids[shared:]
        request.append_token_ids(added)
        completion.token_ids.extend(added)
        return True

    def release_stream(self, request_id: str) -> None:
        """A stream was closed or dropped before its request finished (`RequestStream.close`): abort the request now
        if no engine call is under way, else when the next call begins (a stream can be collected by the garbage
        collector in the middle of a call, or in another thread)."""
        if self._closed:
            return
        if not self._lock.acquire(blocking=False):
            self._pending_aborts.append(request_id)
            return
        try:
            if self._depth:
                self._pending_aborts.append(request_id)
            else:
                self._abort(request_id)
        finally:
            self._lock.release()

    def _begin_call(self) -> None:
        """Called by `exclusive` when an outermost call begins: a model in training mode is switched to eval for the
        call (a rollout of a policy being trained runs as inference: hybridkv/execution/eval_semantics.py), the aborts
        `release_stream` had to put off are made, and the model, which the caller may have changed since the last
        call, is to be checked again."""
        self._training_modules = eval_modules(self.model)
        self._model_checked = False
        self._layout_checked = False
        while self._pending_aborts:
            self._abort(self._pending_aborts.popleft())

    def _end_call(self) -> None:
        """Called by `exclusive` when an outermost call ends, however: the model's modules back in their modes."""
        restore_training(self._training_modules)
        self._training_modules = []

    # ---- the model it serves ------------------------------------------------------------------------

    def model_check_due(self) -> bool:
        """Whether the step about to be planned must check the model first (`follow_model`): a request may be
        admitted (and hit the prefix cache), or a graph replayed, and the model was not checked in this call."""
        return self.core.model_check_due(self._model_checked)

    def check_layout(self) -> None:
        """Refuse a model whose attention implementation or attention-shaping config changed since it was patched
        (`EngineCore.check_layout`: `ModelReshaped`, naming the fix), once in this call, at its first step, whether
        or not the step admits a request: a running request's next token would be computed with the old layout. A
        step in flight is finished first (its reports wait for the next `step()`)."""
        self._layout_checked = True
        try:
            self.core.check_layout()
        except ModelReshaped:
            if self.async_steps is not None:
                self.unclaimed.extend(self.async_steps.drain())
            raise

    def outdated(self) -> str | None:
        """Why this engine no longer fits its model, which `hybridkv.patch` then builds a new one for: its attention
        implementation or attention-shaping config changed (`check_layout`), or its vocabulary did
        (`resize_token_embeddings`). None while it fits."""
        reason = self.core.layout_watch.changed()
        if reason is None and self.inputs.vocab_changed():
            inputs = self.inputs
            reason = f"its vocabulary has {inputs.model_vocab_size()} tokens, {inputs.vocab_size} when it was patched"
        return reason

    def follow_model(self) -> None:
        """Check the model once in this call (`EngineCore.follow_model`), with nothing in flight; after a change the
        encoder cache drops other models' embeddings."""
        if self.async_steps is not None:  # a model change acts on nothing in flight
            self.unclaimed.extend(self.async_steps.drain())
        self._model_checked = True
        change = self.core.follow_model()
        if change is not None and self.images is not None:
            self.images.keep_only(change.key)

    @exclusive
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_disk: bool = False) -> bool:
        """Make every cached block unreachable (vLLM's name), for a change to the model that no check sees (weights
        written outside torch's view, a non-tensor attribute edited; changes through torch are followed without
        it): the pool's and the host tier's. With `reset_running_requests`, running and swapped-out requests are
        also sent back to compute their tokens again (their blocks were computed before). The disk tier
        (`prefix_cache_dir`) is not read or written again by this engine (the model it names may no longer be this
        one); with `reset_disk` (hybridkv's), its files of this model are removed too. Returns True: the reset never
        waits for requests."""
        check_bool("reset_running_requests", reset_running_requests)
        check_bool("reset_disk", reset_disk)
        if self.async_steps is not None:
            self.unclaimed.extend(self.async_steps.drain())
        change = self.core.reset_prefix_cache(reset_running_requests, reset_disk)
        if self.images is not None:
            self.images.keep_only(change.key)
        return True

    def own_weights(self, reload: Reload | None) -> None:
        """The engine loaded this model itself (`LLM(model=path)`, `from_engine_args`, `hybridkv serve`): `sleep`
        gives its weights back too (hybridkv/execution/weight_memory.py), and level 2's wake-up loads them again with
        `reload` (None: they cannot be loaded again, and level 2 keeps them as level 1 does)."""
        self.core.own_weights(reload)

    @property
    def weights(self) -> WeightMemory | None:
        """The weights `sleep` gives back (`own_weights`); None for a model the caller holds."""
        return self.core.weights

    @exclusive
    def sleep(self, level: int = 1) -> None:
        """vLLM's `LLM.sleep`: give the device memory of the KV pages, the state slots and the captured CUDA graphs
        back until `wake_up` (an optimizer step between two batches of rollouts can use it). The prefix cache's
        contents go with them, as in vLLM. The weights of a model the engine loaded itself (`LLM(model=path)`) go
        too: level 1 copies them to host memory (weights already there, on the CPU, stay as they are), level 2
        discards them and `wake_up` loads the checkpoint again. A model the caller holds keeps its weights at either
        level (said once, at the call). Unfinished requests must end first (an error names the fix); a sleeping
        engine refuses new requests, `is_sleeping()` says so."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2 (vLLM's sleep levels), got {level!r}")
        if not self.core.asleep:
            if self.outputs.states:
                raise RuntimeError(
                    f"{len(self.outputs.states)} requests are unfinished and hold pages; finish them (generate, step) "
                    "or abort them (abort_all()) before sleep()"
                )
            if self.async_steps is not None:
                self.unclaimed.extend(self.async_steps.drain())
            if self.images is not None:
                self.images.clear()
            self.core.sleep()
        if self.weights is None:
            why = (
                "they are the tensors of a model the caller holds (hybridkv gives back only the weights of a model "
                "it loaded itself, in one process: LLM(model=path))"
            )
        else:
            why = self.weights.sleep(level)
        if why and not self._said_weights_stay:  # vLLM's level 1 offloads the weights and level 2 drops them
            self._said_weights_stay = True
            warnings.warn(
                f"sleep(level={level}) gives back the KV pages, state slots and graphs; the weights stay where they "
                f"are: {why}",
                stacklevel=3,
            )

    @exclusive
    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's `LLM.wake_up`: allocate what `sleep` gave back (pages zeroed, graphs captured again, the weights
        copied back or loaded again) and take requests again once everything is awake. `tags`: vLLM's "weights" and
        "kv_cache" (None: both), to wake one before the other (the weights first: no KV cache beside a weight
        update)."""
        if tags is not None:
            unknown = set(tags) - {"weights", "kv_cache"}
            if unknown:
                raise ValueError(f"wake_up tags are vLLM's 'weights' and 'kv_cache', got {sorted(unknown)}")
        woken = {"weights", "kv_cache"} if tags is None else set(tags)
        weights_asleep = self.weights is not None and self.weights.asleep
        if "weights" in woken and weights_asleep:
            self.weights.wake_up()
            weights_asleep, self._weights_moved = False, True
        if "kv_cache" in woken:  # graphs wait for weights still asleep, or just woken (`weights_woken` captures)
            self.core.wake_up(capture=not weights_asleep and not self._weights_moved)
        if self._weights_moved and not self.core.asleep:  # a forward may run now (compile, graph capture)
            self._weights_moved = False
            self.core.weights_woken()

    def is_sleeping(self) -> bool:
        """vLLM's: whether `sleep` gave the pages or the weights back (and no `wake_up` has taken both again)."""
        return self.core.asleep or self._weights_moved or (self.weights is not None and self.weights.asleep)

    def close(self) -> None:
        """Release the pool's blocks, the runner's memory and the draft's engine now (`EngineCore.close`)."""
        if self.async_steps is not None:
            self.async_steps.in_flight = None  # its tokens would go to no one
        self.core.close()
        self._closed = True

    @exclusive
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """vLLM's `collective_rpc`: `method` (a method name of the worker, or a function called with the worker first)
        run on every rank's worker, between two steps; the results in rank order (one in one process). The worker
        holds `model_runner` (its `.model`), `model`, `rank`, `world_size` and `device`, and the methods of
        `worker_extension_cls` (hybridkv/engine/worker.py). `timeout` is checked, not enforced: the call runs on this
        thread."""
        return self.core.collective_rpc(method, timeout, args, kwargs)

    def run_worker(self) -> None:
        """On a worker rank of a tensor-parallel engine (hybridkv/execution/distributed.py): run the steps rank 0 sends
        until it closes its engine (`hybridkv.unpatch` there). Rank 0 serves; it has no worker loop."""
        if self.core.worker_rank is None:
            raise RuntimeError("run_worker() is for the ranks other than 0 of a tensor-parallel model")
        if self._closed:
            raise RuntimeError(CLOSED_MESSAGE)
        self.core.run_worker()

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.states)

    def stats(self) -> dict[str, Any]:
        """KV usage, prefix-cache use, preemptions and throughput since the engine was built (engine/stats.py)."""
        return engine_stats(
            self.core,
            self.grammars,
            self.images,
            self.async_steps,
            self.step_seconds,
            self.update_seconds,
            self.outputs,
        )

    def get_metrics(self) -> list[Metric]:
        """vLLM's `get_metrics()`: the engine's counters and gauges as `vllm.v1.metrics.reader`'s objects, under vLLM's
        names where vLLM has the series (hybridkv/engine/metrics.py)."""
        return engine_metrics(self.stats())

    # ---- the step -----------------------------------------------------------------------------

    @exclusive
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step. Returns the state of every request that produced tokens or
        finished in it (finished ones for the last time): each request's live record, updated in place
        by later steps; a request added with output_kind FINAL_ONLY only when it finished."""
        with self.core.step_threads:
            start = time.perf_counter()
            if not self._layout_checked:
                self.check_layout()
            if self.async_steps is not None:  # step N+1 launched before step N's tokens are read
                reports = self.async_steps.step()
            else:
                if self.model_check_due():
                    self.follow_model()
                touched = self.outputs.take_unreported()
                reports = self._run(self.core.schedule(), touched)
            self.step_seconds += time.perf_counter() - start
            if self.core.disk_store is not None and not self.has_unfinished_requests():
                self.core.disk_store.flush()  # idle: the last step's blocks to disk now, not at the next request
            if self.core.kv_events is not None:
                self.core.publish_kv_events()
        unclaimed, self.unclaimed = self.unclaimed, []
        reports = unclaimed + reports
        if self.final_only:  # reported once, finished
            reports = [output for output in reports if output.finished or output.request_id not in self.final_only]
            self.final_only.difference_update(output.request_id for output in reports if output.finished)
        return reports

    def run_plan(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Run a plan synchronously (one that async scheduling cannot launch ahead): its reports."""
        return self._run(plan, self.outputs.take_unreported())

    def _run(self, plan: SchedulerOutput, touched: dict[str, RequestState]) -> list[RequestOutput]:
        """Run a plan and update its requests (the synchronous step, after scheduling): the step's reports."""
        core = self.core
        alone = plan.greedy_alone and not touched and not plan.spec_tokens
        try:
            output = core.execute(plan)
            if output.prompt_logprobs:
                self.record_prompt_logprobs(output.prompt_logprobs)
            sampled = core.sample(plan, output.logits, alone)
        except Exception as exc:  # the model, a kernel or another rank failed: fail this step's requests (and
            # those its swap copies touched: they may not have run), keep serving.
            core.fail_step(plan, f"the step failed: {type(exc).__name__}: {exc}")
            sampled = NOTHING_SAMPLED
        except BaseException as exc:  # interrupted (Ctrl-C): the step's copies and tokens may be half done,
            # so its requests fail, and so do those whose swap copies it made.
            core.fail_step(plan, f"the step was interrupted ({type(exc).__name__})")
            self.outputs.unreported.extend(touched.values())
            self.outputs.unreported.extend(self.outputs.state_of(request) for request in plan.failed)
            raise
        update_start = time.perf_counter()
        if alone and not plan.failed:
            reports = self._finish_alone(plan, sampled.tokens)
        else:
            reports = self.finish_step(plan, sampled, touched)
        self.update_seconds += time.perf_counter() - update_start
        return reports

    def record_prompt_logprobs(self, prompt_logprobs: list[PromptLogprobs]) -> None:
        """Record what a step computed of its requests' prompt logprobs in their outputs."""
        for request, first_position, entries in prompt_logprobs:
            self.outputs.record_prompt_logprobs(request, first_position, entries)

    def finish_step(
        self, plan: SchedulerOutput, sampled: SampledTokens, touched: dict[str, RequestState]
    ) -> list[RequestOutput]:
        """After the step ran: the core advances its requests by their tokens (`EngineCore.update`), the outputs
        record them and decide which stop (`OutputProcessor.process`), the core ends those; then the kept proposals
        and the next ones. The reports of every request it touched (the step's, the failed, and `touched`: the
        earlier ones not reported yet)."""
        core = self.core
        sampled = core.update(plan, sampled)
        for request, status, error in self.outputs.process(*sampled):
            core.finish(request, status, error)
        if core.speculator is not None:  # the kept tokens after each request's first, then the next proposals
            core.finish_speculation(self._record_kept)
            core.propose()
        return self.outputs.reports(plan, touched)

    def _record_kept(self, request: Request, token: int, entry: SampledLogprobs | None) -> None:
        for stopped, status, error in self.outputs.process([request], [token], [entry]):
            self.core.finish(stopped, status, error)

    def _finish_alone(self, plan: SchedulerOutput, tokens: list[int]) -> list[RequestOutput]:
        """`finish_step` in one pass over the step's requests, for a step whose every request is `greedy_alone` and
        nothing earlier waits to be reported (`OutputProcessor.record_alone`); then the step's blocks are updated
        and the stopped requests finished."""
        reports, stopped = self.outputs.record_alone(plan, tokens, advance=True)
        self.core.update_blocks(plan)
        for request, status, state in stopped:
            self.core.finish(request, status)
            self.outputs.output(state)
        if self.core.speculator is not None:  # a step that checked no proposal: the next one's
            self.core.propose()
        return reports

    # ---- loops over steps: generate, chat, beam_search, stream ---------------------------------------

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
        `lora_request`: one LoRARequest for every prompt, or one (or None) per prompt. `priority` changes nothing here
        (accepted as vLLM's)."""
        prompts = prompt_list(prompts)
        params = _params_for(sampling_params, len(prompts), "prompts")
        loras = _loras_for(lora_request, len(prompts), "prompts")
        checked = [
            self.check_request(prompt, p, None, lora_request=lora)
            for prompt, p, lora in zip(prompts, params, loras, strict=True)
        ]
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
        given to patch renders and processes that conversation. `lora_request` as in `generate`."""
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
        loras = _loras_for(lora_request, len(rendered), "conversations")
        checked = []
        for (text, prompt), p, lora in zip(rendered, params, loras, strict=True):
            checked.append(self.check_request(prompt, p, None, lora_request=lora)._replace(prompt_text=text))
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
        the batch. `lora_request` as in `generate`."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a hybridkv.BeamSearchParams, got {type(params).__name__}")
        prompts = prompt_list(prompts)
        loras = _loras_for(lora_request, len(prompts), "prompts")
        checked = [
            self.check_request(prompt, params, None, lora_request=lora)
            for prompt, lora in zip(prompts, loras, strict=True)
        ]
        outputs = self._run_to_completion(checked, use_tqdm)
        for output in outputs:
            if output.error:
                raise RuntimeError(f"beam search of request {output.request_id!r} failed: {output.error}")
        return [BeamSearchOutput.of(output, params, self.tokenizer) for output in outputs]

    def _run_to_completion(self, checked: list[CheckedRequest], use_tqdm: bool) -> list[RequestOutput]:
        """Queue checked requests and step until all finish; if that fails or is interrupted, abort them."""
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        progress = progress_bar(len(checked), use_tqdm)
        try:
            ids.extend(self.enqueue(request) for request in checked)
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
        request_id = self.enqueue(self.check_request(prompt, sampling_params, request_id))
        return RequestStream(self, self.outputs.states[request_id])

    @exclusive
    def advance_stream(self, state: RequestState) -> tuple[list[StreamDelta], bool]:
        """Step until the stream's request has news (unless it ended elsewhere, e.g. aborted); its deltas
        and whether it finished (`RequestStream.__next__`)."""
        if not state.output.finished:
            self._step_claiming({state.group.request_id})
        return self.outputs.stream_deltas(state), state.output.finished

    def _step_claiming(self, wanted: set[str]) -> list[RequestOutput]:
        """One step; finished outputs of requests not in `wanted` are kept for the caller of step()."""
        outputs = self.step()
        mine = [o for o in outputs if o.request_id in wanted]
        self.unclaimed.extend(o for o in outputs if o.request_id not in wanted and o.finished)
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


def _loras_for(lora_request: Any, count: int, what: str) -> list[Any]:
    """One `lora_request` per prompt: the same for all (None: no adapter), or a list of one (or None) each (vLLM's)."""
    if lora_request is None or not isinstance(lora_request, (list, tuple)):
        return [lora_request] * count
    if len(lora_request) != count:
        raise ValueError(f"got {count} {what} but {len(lora_request)} lora_requests; give one or one each")
    return list(lora_request)
