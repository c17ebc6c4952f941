"""The engine: requests in (`add_request`, `abort`, `abort_all`), the step loop (schedule -> swap copies ->
one forward -> sample -> update -> outputs) and `stats`.

What comes before and after a step lives beside it: `hybridkv/execution/inputs.py` (prompts into checked ids),
`hybridkv/engine/output_processor.py` (text, logprobs, stop decisions, outputs), `hybridkv/engine/run_loops.py`
(`generate`, `chat`, `stream`: loops over steps), `hybridkv/engine/stream.py` (a streamed request),
`hybridkv/execution/sizing.py` (the pool's size).

Every public call is `exclusive` (one thread at a time; none after `unpatch`). Nothing is lost on the
way out: a request whose call fails or is interrupted (KeyboardInterrupt) is aborted, and every block it
held returns to the pool.

The engine follows the model (`hybridkv/execution/model_watch.py`): the first step of a call that may admit a request
(or replay a CUDA graph) checks whether the model changed since the last call, and a request admitted after a change is
hashed under the new model's key, so the prefix cache never serves it K/V of the old one.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from hybridkv.engine.async_steps import AsyncSteps
from hybridkv.engine.call_guard import CLOSED_MESSAGE, exclusive
from hybridkv.engine.output_processor import OutputProcessor, RequestState
from hybridkv.engine.run_loops import RunLoops
from hybridkv.engine.speculation import Speculator, check_draft
from hybridkv.engine.stats import EngineStats
from hybridkv.execution.config import EngineConfig
from hybridkv.execution.cpu_threads import StepThreads
from hybridkv.execution.distributed import TensorParallel, tensor_parallel_size
from hybridkv.execution.eval_semantics import eval_modules, restore_training
from hybridkv.execution.graphs import captures_graphs, decode_buckets, graph_mode
from hybridkv.execution.inputs import InputProcessor, Prompt, eos_token_ids, plain_prompt, refuse_lora_request
from hybridkv.execution.model_runner import ModelRunner, RunnerLimits
from hybridkv.execution.model_watch import ModelChange, ModelWatch
from hybridkv.execution.multimodal import ImageEncoder, MultiModalInputs
from hybridkv.execution.sizing import kv_layout, min_num_blocks, num_kv_blocks
from hybridkv.execution.state_layers import scan_chunk
from hybridkv.execution.step_check import check_step_exactness
from hybridkv.kernels.quant import is_fp8
from hybridkv.memory.coordinator import KVCacheCoordinator
from hybridkv.outputs import RequestOutput
from hybridkv.patches import attention
from hybridkv.patches.probe import attention_installed, image_attention_layers
from hybridkv.sampling import sampler
from hybridkv.sampling.beam_search import BeamSearch, BeamSearchParams
from hybridkv.sampling.sampler import SampledLogprobs, sample_each, token_logprobs
from hybridkv.sampling.structured_outputs import GrammarCompiler
from hybridkv.scheduling.request import Request, RequestStatus, SampleGroup
from hybridkv.scheduling.sampling_params import SamplingParams, generation_config_defaults
from hybridkv.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from hybridkv.scheduling.stopping import StopRules
from hybridkv.scheduling.validation import check_bool

__all__ = ["EngineConfig", "LLMEngine", "Prompt", "min_num_blocks"]


class CheckedRequest(NamedTuple):
    """A request as `_checked_request` passed it, what `_enqueue` takes."""

    request_id: str
    prompt_text: str | None
    prompt_ids: list[int]
    params: SamplingParams | BeamSearchParams
    multimodal: MultiModalInputs | None = None


logger = logging.getLogger("hybridkv")


class MemoryPlan(NamedTuple):
    """What `LLMEngine._plan_memory` gives the engine to build: the pool's blocks and swap blocks, state slots (one
    per request that may run, and the scratch slot), state checkpoints and their interval, CPU state slots for
    swapped requests."""

    num_blocks: int
    num_swap_blocks: int
    num_state_slots: int
    num_checkpoints: int
    checkpoint_interval: int
    num_swap_state_slots: int


def compiles_by_default(captures: bool) -> bool:
    """compile=None: compiled where CUDA graphs are captured (one GPU), eager elsewhere: on the CPU compiling costs
    more set-up than its steps save (benchmarks/RESULTS.md, "The compiled forward")."""
    return captures


class LLMEngine(RunLoops, EngineStats):
    """A continuous-batching engine bound to one Hugging Face model (see `hybridkv.patch`); `generate`,
    `chat` and `stream` come from `RunLoops` (hybridkv/engine/run_loops.py)."""

    def __init__(
        self, model: torch.nn.Module, tokenizer: Any = None, config: EngineConfig | None = None, processor: Any = None
    ) -> None:
        config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.processor = processor
        self.config = config
        layout = self._probe()
        buckets, captures, compiled = self._plan_steps(layout)
        memory = self._plan_memory(layout, max(buckets, default=0))
        self._wire_memory(memory)
        self._wire_runner(layout, memory, buckets, captures, compiled)
        self._wire_requests(layout)
        # Whether only full attention holds what a request computed: no state layer (it cannot go back) and no window
        # or attention chunk (a block behind one may have gone back to the pool). A speculative step's proposals
        # then store their K/V, and a request can go on from other tokens (`_continue_from`).
        self.full_attention_only = not layout.states and all(
            group.sliding_window is None and group.attention_chunk_size is None for group in self.kv_config.groups
        )
        self.speculator = self._speculator(layout)
        # Requests that ended outside a step's outputs (rejected at add, failed by an interrupted step):
        # the next step reports them.
        self._unreported: list[RequestState] = []
        self._unclaimed: list[RequestOutput] = []
        # Streams dropped while an engine call was under way: aborted when the next call begins.
        self._pending_aborts: deque[str] = deque()
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._depth = 0  # engine calls under way in the owning thread (they nest)
        self._training_modules: list[torch.nn.Module] = []  # switched to eval for the call under way (`_begin_call`)
        self._closed = False
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_forward_tokens = 0
        self.step_seconds = 0.0
        self.schedule_seconds = 0.0
        self.update_seconds = 0.0
        # Requests (their leaders) whose prompt logprobs are not all computed yet (`_prompt_logprob_rows`).
        self._prompt_logprobs_pending: set[str] = set()
        # The model as the caches know it: checked at most once per engine call (`_follow_model`).
        self.model_watch = ModelWatch(model)
        self._model_checked = True
        on_cuda = self.tp is None and [device.type for device in self.runner.devices] == ["cuda"]
        ahead = config.async_scheduling if config.async_scheduling is not None else on_cuda and not self.speculator
        self.async_steps = AsyncSteps(self) if ahead else None

    def _probe(self) -> Any:
        """The model's layers as the probe finds them (their kinds, KV groups, dtypes) and the end-to-end check of
        its steps against its own forward; the layout (`ModelLayout`) the plans are made from."""
        start = time.perf_counter()
        self.layer_dtypes, layout, self.kv_config, self.max_model_len = kv_layout(self.model, self.config)
        probed = time.perf_counter()
        self.step_check = check_step_exactness(self.model, layout)
        logger.info(
            "hybridkv: %s probed in %.1f s, its steps checked against its forward in %.1f s",
            type(self.model).__name__,
            probed - start,
            time.perf_counter() - probed,
        )
        self.bytes_per_block = self.kv_config.block_bytes
        return layout

    def _plan_steps(self, layout: Any) -> tuple[tuple[int, ...], bool, bool]:
        """How steps run: the decode buckets (graph mode), whether CUDA graphs are captured over them, whether the
        forward is compiled; and the tensor-parallel group, if any. Refuses what cannot be served so."""
        config, model = self.config, self.model
        if layout.states and config.compile:
            raise ValueError(
                "compile=True does not compile models with state layers yet (each layer runs per request segment); "
                "patch with compile=False"
            )
        # State layers run per request segment, which no graph captures yet: their models' steps are not padded to
        # buckets. Latent attention's decode steps are captured where its decode rows take the Triton latent kernel,
        # over the step buffers alone; over fp8 pages they take the torch path, built per step: not padded either
        # (hybridkv/kernels/contexts.py). A latent model compiles when asked to, compile=True.
        latent_fp8 = any(is_fp8(self.layer_dtypes.dtypes[layer_idx]) for layer_idx in layout.latent)
        graphs_wanted = graph_mode(model, config.enforce_eager) and not layout.states and not latent_fp8
        buckets = decode_buckets(config.max_num_seqs) if graphs_wanted else ()
        captures = bool(buckets) and captures_graphs(model)
        compiled = config.compile if config.compile is not None else compiles_by_default(captures)
        compiled = compiled and (config.compile is True or not layout.latent)
        # Tensor parallel: every rank holds its own KV heads in a pool of the same block count.
        self.tp = TensorParallel(model) if tensor_parallel_size(model) > 1 else None
        if config.async_scheduling and self.tp is not None:
            raise ValueError(
                "async_scheduling=True is not supported for a tensor-parallel model (every rank runs each step as "
                "rank 0 plans it); patch with async_scheduling=False"
            )
        return buckets, captures, compiled

    def _wire_memory(self, memory: MemoryPlan) -> None:
        """The memory manager (the coordinator over the pool's blocks and state slots) and the scheduler over it."""
        config = self.config
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            preemption_mode=config.preemption_mode,
            num_swap_blocks=memory.num_swap_blocks,
            num_swap_state_slots=memory.num_swap_state_slots,
        )
        self.coordinator = KVCacheCoordinator(
            self.kv_config,
            memory.num_blocks,
            config.enable_prefix_caching,
            num_state_slots=memory.num_state_slots,
            num_state_checkpoints=memory.num_checkpoints,
            state_checkpoint_interval=memory.checkpoint_interval,
        )
        self.scheduler = Scheduler(self.scheduler_config, self.coordinator)

    def _wire_runner(
        self, layout: Any, memory: MemoryPlan, buckets: tuple[int, ...], captures: bool, compiled: bool
    ) -> None:
        """The model runner over the planned pages, state slots and swap space, warmed up (the compiled forward
        found, CUDA graphs captured) at patch time rather than in a user's first step; the CPU's step threads."""
        config = self.config
        limits = RunnerLimits(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            buckets,
            compile=compiled,
            compile_required=config.compile is True,
            use_tqdm=config.use_tqdm,
        )
        self.runner = ModelRunner(
            self.model,
            self.kv_config,
            layout.module_names,
            memory.num_blocks,
            self.layer_dtypes,
            limits,
            config.attention_backend,
            states=layout.states,
            num_state_slots=memory.num_state_slots + memory.num_checkpoints,
            latent=layout.latent,
        )
        self.runner.allocate_swap_space(memory.num_swap_blocks)
        self.runner.allocate_state_swap_space(memory.num_swap_state_slots)
        if compiled or captures:
            with attention_installed(self.model):
                self.runner.warm_up(capture=captures)
        on_cpu = all(device.type == "cpu" for device in self.runner.devices)
        self.step_threads = StepThreads(config.cpu_threads if on_cpu else None)

    def _wire_requests(self, layout: Any) -> None:
        """What a request goes through besides the step: its prompt checked into ids, its images encoded, its
        grammar compiled, its outputs and stop rules, and the defaults of a request without sampling settings."""
        model, tokenizer = self.model, self.tokenizer
        self.inputs = InputProcessor(model, tokenizer)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        stop_rules = StopRules(self.eos_token_ids, self.max_model_len)
        self.outputs = OutputProcessor(tokenizer, stop_rules, self.runner.input_device)
        self.grammars = GrammarCompiler(tokenizer, self.inputs.vocab_size, self.eos_token_ids)
        self.images_refused: str | None = None  # why a model that takes images cannot get them here
        self.images = self._image_encoder(model, self.processor, layout)
        # What a request without sampling settings of its own takes (`get_default_sampling_params`).
        self.default_sampling = (
            generation_config_defaults(getattr(model, "generation_config", None))
            if self.config.generation_config == "auto"
            else {}
        )

    def _speculator(self, layout: Any) -> Speculator | None:
        """Speculative decoding's proposer and check (hybridkv/engine/speculation.py), where `speculative_config` asks
        for it; a draft model gets an engine of its own, with as many blocks as this one. Refuses what it cannot run."""
        config = self.config
        speculative = config.speculative_config
        if speculative is None:
            return None
        # Full-attention groups only: a kept proposal's K/V can stay where its row stored them (vLLM's way).
        stores_proposals = self.full_attention_only
        if layout.latent and not stores_proposals:
            raise ValueError(
                "speculative_config: latent attention layers read a step's own rows back from their pages, and a "
                "proposal's row is stored there only on a model whose layers are all full attention (this one has "
                "state layers or windows); patch this model without speculative_config"
            )
        if config.async_scheduling:
            raise ValueError(
                "speculative_config needs each step's kept tokens before the next is planned: patch with "
                "async_scheduling=False (or None)"
            )

        def draft_engine(draft: torch.nn.Module) -> LLMEngine:
            draft_vocab = getattr(getattr(draft, "config", None), "get_text_config", lambda: None)()
            check_draft(draft, self.model, self.inputs.vocab_size, getattr(draft_vocab, "vocab_size", None))
            draft_config = EngineConfig(
                block_size=config.block_size,
                num_blocks=self.coordinator.pool.num_blocks,
                kv_cache_dtype=config.kv_cache_dtype,
                max_model_len=self.max_model_len,
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
            engine = LLMEngine(draft, None, draft_config)
            attention.install(draft)
            return engine

        # Under tensor parallelism the driver proposes and checks; a worker runs the rows it is sent (no draft).
        worker = self.tp is not None and not self.tp.driver
        speculator = Speculator(speculative, None if worker else draft_engine)
        self.scheduler.speculative = True
        self.scheduler.stores_proposals = stores_proposals
        return speculator

    def _plan_memory(self, layout: Any, largest_bucket: int) -> MemoryPlan:
        """How much of each kind of memory the engine takes (planned before anything is built): KV blocks sized to
        the budget (`num_kv_blocks`), state slots and checkpoints for state layers, the swap space's blocks and
        state slots, the smallest counts every rank of a tensor-parallel model agrees on."""
        model, config = self.model, self.config
        # One state slot per request that may run at once, and the scratch slot; with prefix caching, the states
        # at block boundaries that hits restore (hybridkv/memory/state_slots.py).
        num_state_slots = config.max_num_seqs + 1 if layout.states else 0
        num_checkpoints = checkpoint_interval = 0
        if layout.states and config.enable_prefix_caching:
            num_checkpoints = config.num_state_checkpoints
            if num_checkpoints is None:
                num_checkpoints = config.max_num_seqs
            named = dict(model.named_modules())
            chunk = scan_chunk(named[spec.module_name] for spec in layout.states)
            checkpoint_interval = config.state_checkpoint_interval or math.lcm(self.kv_config.hit_alignment, chunk)
        start = time.perf_counter()
        num_blocks = num_kv_blocks(model, config, self.kv_config, self.max_model_len, largest_bucket)
        logger.info("hybridkv: %d KV blocks sized in %.1f s", num_blocks, time.perf_counter() - start)
        # Swap space: with state layers, up to half of it for swapped requests' states (a CPU slot each, at most
        # max_num_seqs: a request without one is preempted by recompute), the rest for blocks.
        swap_space, num_swap_state_slots = config.swap_space_bytes, 0
        if layout.states and swap_space:
            state_bytes = sum(spec.state_bytes for spec in layout.states)
            num_swap_state_slots = min(config.max_num_seqs, swap_space // 2 // state_bytes)
            swap_space -= num_swap_state_slots * state_bytes
        num_swap_blocks = min(swap_space // self.bytes_per_block, num_blocks - 1)
        if self.tp is not None:
            num_blocks, num_swap_blocks = self.tp.smallest(num_blocks), self.tp.smallest(num_swap_blocks)
        return MemoryPlan(
            num_blocks, num_swap_blocks, num_state_slots, num_checkpoints, checkpoint_interval, num_swap_state_slots
        )

    def _image_encoder(self, model: torch.nn.Module, processor: Any, layout: Any) -> ImageEncoder | None:
        """Images for a model that takes them (a placeholder id and `get_image_features`): which layers let an
        image's tokens attend both ways is read from the model's own masks (hybridkv/patches/probe.py). A model that
        cannot say, or whose images would need what hybridkv does not run with them (state layers,
        chunked local attention, tensor parallelism), gets None: a prompt with images is then refused."""
        encoder = ImageEncoder(model, processor, bidirectional=False, cache_bytes=self.config.encoder_cache_bytes)
        if not encoder.serves_images:
            return None
        if layout.states or self.tp is not None:
            self.images_refused = "images are not served with state layers or tensor parallelism yet"
            return None
        try:
            layers = image_attention_layers(model)
        except ValueError as error:
            self.images_refused = str(error)
            return None
        if layers and any(self.runner.layers[i].attention_chunk_size for i in layers if i in self.runner.layers):
            self.images_refused = "images that attend both ways are not served with chunked local attention"
            return None
        self.runner.context.image_layers = layers
        encoder.bidirectional = bool(layers)
        return encoder

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
        search: its output, once finished, lists the beam_width best sequences. `arrival_time` and `priority` change
        nothing here (accepted as vLLM's); a `lora_request` is refused (switch the model's own PEFT adapters)."""
        if not isinstance(request_id, str) or isinstance(prompt, (SamplingParams, BeamSearchParams)):
            raise TypeError(
                f"add_request takes (request_id, prompt, params), vLLM's order: request_id must be a str, got "
                f"{type(request_id).__name__} {request_id!r}, and prompt a prompt, got {type(prompt).__name__}"
            )
        refuse_lora_request(lora_request)
        return self._enqueue(*self._checked_request(prompt, params, request_id))

    def get_tokenizer(self) -> Any:
        """The tokenizer given to patch (None without one), vLLM's name."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling settings a request without its own takes. With `generation_config="auto"` (the
        default) the model's generation config sets those it changes from transformers' defaults among
        temperature, top_k, top_p, min_p, repetition_penalty and max_new_tokens (as max_tokens); with "vllm",
        SamplingParams' own defaults. A new object each call: change it freely."""
        return SamplingParams(**self.default_sampling)

    def _checked_request(
        self,
        prompt: Prompt | dict[str, Any],
        params: SamplingParams | BeamSearchParams | None,
        request_id: str | None,
        follow_model: bool = True,
    ) -> CheckedRequest:
        """Everything add_request checks, before anything is queued: a ValueError or TypeError naming the fix. The
        request keeps a checked copy of its SamplingParams (`clone`), the model's defaults when it gives none.
        A dict prompt with images has them through the vision tower here (hybridkv/execution/multimodal.py), after the
        model is checked for changes (`follow_model`: False from a thread other than the engine's, which only reads the
        key; a request whose images another model encoded is refused when it is queued)."""
        if self.runner.asleep:
            raise RuntimeError("this engine is asleep (llm.sleep() gave its pages back): call llm.wake_up() first")
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
                self._follow_model()
            prompt_text, prompt_ids, multimodal = self._multimodal_prompt(prompt)
        else:
            prompt_text, prompt_ids = self.inputs.tokenize(prompt)
        if isinstance(params, BeamSearchParams):
            return CheckedRequest(request_id, prompt_text, prompt_ids, params, multimodal)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to hybridkv.patch, or use stop_token_ids")
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # checked now; kept for _enqueue
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
        return CheckedRequest(request_id, prompt_text, prompt_ids, params, multimodal)

    def _multimodal_prompt(self, prompt: dict[str, Any]) -> tuple[str | None, list[int], MultiModalInputs | None]:
        if self.images is None:
            if self.images_refused and (prompt.get("multi_modal_data") or {}):
                raise ValueError(f"this model's prompts cannot hold images here: {self.images_refused}")
            encoder = ImageEncoder(self.model, self.processor, bidirectional=False)
        else:
            encoder = self.images
        text, ids, multimodal = encoder.inputs(prompt, self.coordinator.model_key)
        placeholder = encoder.image_token_id if multimodal is not None else None
        self.inputs.check(ids, allowed=placeholder)
        if multimodal is not None and multimodal.bidirectional:
            longest = max(end - start for start, end in multimodal.spans)
            cap = self.scheduler.chunk_cap()
            if longest > cap:
                raise ValueError(
                    f"an image of {longest} tokens attends both ways and must be computed in one prefill chunk, "
                    f"but chunks hold at most {cap} tokens: raise max_num_batched_tokens (and "
                    "long_prefill_token_threshold)"
                )
        return text, ids, multimodal

    def _enqueue(
        self,
        request_id: str,
        prompt_text: str | None,
        prompt_ids: list[int],
        params: SamplingParams | BeamSearchParams,
        multimodal: MultiModalInputs | None = None,
    ) -> str:
        model_key = self.coordinator.model_key
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
            )
            group = search.group
        else:
            group = SampleGroup.of(request_id, prompt_ids, params, block_size, multimodal, model_key)
        # More samples than max_num_seqs run in parts that queue as requests of their own (a beam runs as a whole).
        parts = [group] if group.beam is not None else group.parts(self.config.max_num_seqs)
        grammar = None
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
        state = self.outputs.add(parts, prompt_text, grammar)
        if self.speculator is not None and self.speculator.speculates(params):
            for member in state.members:  # proposed for after each step (`_update`, `_update_alone`)
                member.speculates = True
        if not all([self.scheduler.add_request(part.leader) for part in parts]):
            self._unreported.append(state)
        elif isinstance(params, SamplingParams) and params.prompt_logprobs is not None:
            self._prompt_logprobs_pending.add(group.leader.request_id)
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
                self._unclaimed.append(output)

    @exclusive
    def abort_all(self) -> list[RequestOutput]:
        """Abort every unfinished request (e.g. after an interrupted loop of your own); returns their outputs."""
        return [self._abort(request_id) for request_id in list(self.outputs.states)]

    def _abort(self, request_id: str) -> RequestOutput | None:
        state = self.outputs.states.get(request_id)
        if state is None:
            return None
        for part in state.parts:
            self.scheduler.finish_group(part, RequestStatus.FINISHED_ABORTED)
        return self.outputs.output(state)

    def _continue_from(self, request_id: str, token_ids: Sequence[int], known: int = 0) -> bool:
        """A running request of one sample goes on from `token_ids` instead of its own tokens (a draft model's request
        between two rounds of speculative decoding, hybridkv/engine/speculation.py): its tokens are cut where the two
        part (the first `known` are the same, the caller knows) and the rest of `token_ids` appended, which its next
        step computes over the K/V of the tokens they share. Only where full attention alone holds what it computed
        (`full_attention_only`) and the cut leaves its computed full blocks (which the prefix cache may hold) as they
        are; False otherwise, changing nothing."""
        state = self.outputs.states.get(request_id)
        if not self.full_attention_only or state is None or len(state.members) != 1:
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
        del request.sample_state.completion.token_ids[shared - request.num_prompt_tokens :]
        request.num_computed_tokens = min(request.num_computed_tokens, shared)
        added = token_ids[shared:]
        request.append_token_ids(added)
        request.sample_state.completion.token_ids.extend(added)
        return True

    def _release_stream(self, request_id: str) -> None:
        """A stream was closed or dropped before its request finished: abort the request now if no engine
        call is under way, else when the next call begins (a stream can be collected by the garbage
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
        `_release_stream` had to put off are made, and the model, which the caller may have changed since the last
        call, is to be checked again."""
        self._training_modules = eval_modules(self.model)
        self._model_checked = False
        while self._pending_aborts:
            self._abort(self._pending_aborts.popleft())

    def _end_call(self) -> None:
        """Called by `exclusive` when an outermost call ends, however: the model's modules back in their modes."""
        restore_training(self._training_modules)
        self._training_modules = []

    # ---- the model it serves ------------------------------------------------------------------------

    def _follow_model(self) -> None:
        """Check the model once in this call (`ModelWatch.check`); after a change, requests admitted from now on
        are hashed under its new key, the encoder cache drops other models' embeddings, and CUDA graphs are
        captured again when a weight moved (they would read its old address). A dtype or device change raises
        `ModelMoved`, naming the fix."""
        if self.async_steps is not None:  # a model change acts on nothing in flight
            self.async_steps.drain()
        self._model_checked = True
        change = self.model_watch.check()
        if change is not None:
            self._take_model_change(change)

    def _take_model_change(self, change: ModelChange) -> None:
        self.coordinator.model_key = change.key
        if self.images is not None:
            self.images.keep_only(change.key)
        self._follow_compiled(change.reasons, change.moved)

    def _follow_compiled(self, reasons: tuple[str, ...], moved: bool) -> None:
        """The compiled forward for the model as it is now, then CUDA graphs captured again when what they replay
        changed: a weight's address, or the compiled program (another adapter, another mode)."""
        replaced = self.runner.follow_model()
        if (moved or replaced) and self.runner.graphs is not None:
            warnings.warn(
                f"hybridkv captures the decode steps' CUDA graphs again: {'; '.join(reasons)}, and the "
                "captured graphs replay what the model computed before",
                stacklevel=5,
            )
            self.runner.capture_graphs()

    @exclusive
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Make every cached block unreachable (vLLM's name), for a change to the model that no check sees (weights
        written outside torch's view, a non-tensor attribute edited; changes through torch are followed without
        it). With `reset_running_requests`, running and swapped-out requests are also sent back to compute their
        tokens again (their blocks were computed before). Returns True: the reset never waits for requests."""
        check_bool("reset_running_requests", reset_running_requests)
        if self.async_steps is not None:
            self.async_steps.drain()
        if reset_running_requests:
            self.scheduler.recompute_all()
        self._take_model_change(self.model_watch.invalidate("reset_prefix_cache() was called"))
        return True

    @exclusive
    def sleep(self, level: int = 1) -> None:
        """vLLM's `LLM.sleep`: give the device memory of the KV pages, the state slots and the captured CUDA graphs
        back until `wake_up` (an optimizer step between two batches of rollouts can use it). The prefix cache's
        contents go with them, as in vLLM. The weights are the live model's and stay, at either level (vLLM's level 1
        offloads its copy of them, level 2 discards it; hybridkv keeps none). Unfinished requests must end first (an
        error names the fix); a sleeping engine refuses new requests, `is_sleeping()` says so."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2 (vLLM's sleep levels), got {level!r}")
        if self.runner.asleep:
            return
        if self.outputs.states:
            raise RuntimeError(
                f"{len(self.outputs.states)} requests are unfinished and hold pages; finish them (generate, step) or "
                "abort them (abort_all()) before sleep()"
            )
        if self.async_steps is not None:
            self.async_steps.drain()
        self.coordinator.forget_cached()
        if self.images is not None:
            self.images.clear()
        self.runner.sleep()

    @exclusive
    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's `LLM.wake_up`: allocate what `sleep` gave back (pages zeroed, graphs captured again) and take
        requests again. `tags`: vLLM's "weights" and "kv_cache" (None: both); the weights never left, so a wake-up
        with "weights" alone changes nothing."""
        if tags is not None:
            unknown = set(tags) - {"weights", "kv_cache"}
            if unknown:
                raise ValueError(f"wake_up tags are vLLM's 'weights' and 'kv_cache', got {sorted(unknown)}")
            if "kv_cache" not in tags:
                return
        if self.runner.asleep:
            self.runner.wake_up()

    def is_sleeping(self) -> bool:
        """vLLM's: whether `sleep` gave the pages back (and no `wake_up` has taken them again)."""
        return self.runner.asleep

    def close(self) -> None:
        """Release the pool's blocks now: they link each other, so only the cycle collector would
        free them otherwise, in a pause of its own choosing (benchmarks/RESULTS.md, choices in the code)."""
        if self.async_steps is not None:
            self.async_steps.in_flight = None  # its tokens would go to no one
        if self.tp is not None:
            self.tp.stop()
        self.coordinator.pool.close()
        self.runner.close()
        if self.speculator is not None:
            self.speculator.close()
        self.model_watch.close()
        self._closed = True

    def run_worker(self) -> None:
        """On a worker rank of a tensor-parallel engine (hybridkv/execution/distributed.py): run the steps rank 0 sends
        until it closes its engine (`hybridkv.unpatch` there). Rank 0 serves; it has no worker loop."""
        if self.tp is None or self.tp.driver:
            raise RuntimeError("run_worker() is for the ranks other than 0 of a tensor-parallel model")
        if self._closed:
            raise RuntimeError(CLOSED_MESSAGE)
        self.tp.run_worker(self.runner)

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.states)

    # ---- the step -----------------------------------------------------------------------------

    @exclusive
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step. Returns the state of every request that produced tokens or
        finished in it (finished ones for the last time): each request's live record, updated in place
        by later steps."""
        with self.step_threads.for_step():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        if (
            self.async_steps is not None
        ):  # step N+1 launched before step N's tokens are read (hybridkv/engine/async_steps.py)
            reports = self.async_steps.step()
        else:
            if self._model_check_due():
                self._follow_model()
            touched = self._take_touched()
            plan = self.scheduler.schedule()
            self.schedule_seconds += time.perf_counter() - start
            reports = self._run(plan, touched)
        self.step_seconds += time.perf_counter() - start
        unclaimed, self._unclaimed = self._unclaimed, []
        return unclaimed + reports

    def _model_check_due(self) -> bool:
        """Whether the step about to be planned must check the model first (`_follow_model`): a request may be
        admitted (and hit the prefix cache), or a graph replayed, and the model was not checked in this call."""
        scheduler = self.scheduler
        return not self._model_checked and bool(
            scheduler.waiting or (self.runner.graphs is not None and (scheduler.running or scheduler.swapped))
        )

    def _take_touched(self) -> dict[str, RequestState]:
        """The requests that ended outside a step (`_unreported`), by id: the next step's update reports them."""
        touched = {state.group.request_id: state for state in self._unreported}
        self._unreported = []
        return touched

    def _run(self, plan: SchedulerOutput, touched: dict[str, RequestState]) -> list[RequestOutput]:
        """Run a plan and update its requests (the synchronous step, after scheduling): the step's reports."""
        alone = plan.greedy_alone and not touched and not plan.spec_tokens
        try:
            sampling, tokens, logprobs = self._execute(plan, alone)
        except Exception as exc:  # the model, a kernel or another rank failed: fail this step's requests (and
            # those its swap copies touched: they may not have run), keep serving.
            self._fail_step(plan, f"the step failed: {type(exc).__name__}: {exc}")
            sampling, tokens, logprobs = [], [], []
        except BaseException as exc:  # interrupted (Ctrl-C): the step's copies and tokens may be half done,
            # so its requests fail, and so do those whose swap copies it made.
            self._fail_step(plan, f"the step was interrupted ({type(exc).__name__})")
            self._unreported.extend(touched.values())
            self._unreported.extend(self.outputs.state_of(request) for request in plan.failed)
            raise
        update_start = time.perf_counter()
        if alone and not plan.failed:
            reports = self._update_alone(plan, tokens)
        else:
            reports = self._update(plan, sampling, tokens, logprobs, touched)
        self.update_seconds += time.perf_counter() - update_start
        return reports

    def _fail_step(self, plan: SchedulerOutput, error: str) -> None:
        """A step that failed or was interrupted: its state checkpoints are dropped, and its requests fail with
        those its swap copies touched."""
        self._discard_checkpoints()
        if self.speculator is not None:
            self.speculator.drop()
        self._fail(plan, self._touched_by(plan), error)

    def _update(
        self,
        plan: SchedulerOutput,
        sampling: list[Request],
        tokens: list[int | None],
        logprobs: Sequence[SampledLogprobs | None],
        touched: dict[str, RequestState],
    ) -> list[RequestOutput]:
        """After the step ran: advance its requests by their tokens, record and stop them, and report each request
        it touched (the step's, the failed, and `touched`: the earlier ones not reported yet)."""
        self.scheduler.update(plan, tokens)
        if None in tokens:  # beams: their search chooses their tokens, the output processor never sees them
            self._advance_beam_searches(sampling)
            sampled = [i for i, token in enumerate(tokens) if token is not None]
            sampling, tokens, logprobs = ([values[i] for i in sampled] for values in (sampling, tokens, logprobs))
        for request, status, error in self.outputs.process(sampling, tokens, logprobs):
            self.scheduler.finish(request, status, error)
        if self.speculator is not None:  # the kept tokens after each request's first, then the next proposals
            self.num_generated_tokens += self.speculator.finish(self.scheduler, self.outputs)
            self.speculator.propose(self.scheduler.running)
        states = self.outputs.states
        for request in [s.request for s in plan.scheduled] + plan.failed:
            request_id = request.group.request_id
            if request_id not in touched:
                touched[request_id] = states[request_id]
        # A request reported finished already (e.g. aborted while waiting to be reported) is not reported again.
        return [self.outputs.output(state) for state in touched.values() if not state.output.finished]

    def _update_alone(self, plan: SchedulerOutput, tokens: list[int]) -> list[RequestOutput]:
        """`_update` in one pass over the step's requests, for a step whose every request is `greedy_alone` (no
        beam, fork, grammar or logprobs to record; each is its group's only sample, so its report is its own) and
        nothing earlier waits to be reported: each request advances, takes and records its token and is checked
        for a stop as `Scheduler.update` and `OutputProcessor.process` would (`_record_alone`); then the step's
        blocks are updated (`Scheduler.update_blocks`) and the stopped requests finished. Most decode steps take
        it: one pass instead of four, each of which met every request's records cold after the forward."""
        reports, stopped = self._record_alone(plan, tokens, advance=True)
        self.scheduler.update_blocks(plan)
        for request, status, state in stopped:
            self.scheduler.finish(request, status)
            self.outputs.output(state)
        if self.speculator is not None:  # a step that checked no proposal: the next one's
            self.speculator.propose(self.scheduler.running)
        return reports

    def _record_alone(
        self, plan: SchedulerOutput, tokens: list[int], advance: bool
    ) -> tuple[list[RequestOutput], list[tuple[Request, RequestStatus, RequestState]]]:
        """The one pass of `_update_alone` (and of an async step's finish, `advance` False: its requests advanced
        at launch, and each token it appends was pending): the reports (live records) and the requests that
        stopped, with their states, not finished yet. With `advance` False a request that finished since the
        step's launch (aborted) is passed over, its token dropped."""
        check = self.outputs.stop_rules.check
        now = time.monotonic()
        next_token = iter(tokens).__next__
        reports: list[RequestOutput] = []
        stopped: list[tuple[Request, RequestStatus, RequestState]] = []
        for request, num_new, samples in plan.scheduled:
            if advance:
                request.num_computed_tokens += num_new
            elif request.status.is_finished:
                if samples:
                    next_token()
                continue
            sample = request.sample_state
            state = sample.state
            reports.append(state.output)  # the live record: a stopped request's is finished by the caller, in place
            if samples:
                token = next_token()
                if not advance:
                    request.num_pending_tokens -= 1
                request.append_token(token)
                sample.completion.token_ids.append(token)
                if sample.metrics.first_token_time is None:
                    sample.metrics.first_token_time = now
                status = check(request, token, sample.detokenizer)
                if status is not None:
                    stopped.append((request, status, state))
                    continue
            if sample.detokenizer is not None:  # what `OutputProcessor.output` reads into an unfinished record
                sample.completion.text = sample.detokenizer.text
            sample.metrics.num_cached_tokens = request.num_cached_tokens
        return reports, stopped

    def _execute(
        self, plan: SchedulerOutput, greedy_alone: bool = False
    ) -> tuple[list[Request], list[int | None], Sequence[SampledLogprobs | None]]:
        """Swap and copy-on-write copies, the forward (on every rank of a tensor-parallel model) and sampling:
        the requests that sampled (`plan.sampling` after the step: a request whose sampling fails is failed and
        leaves the plan), their tokens and logprobs. With `greedy_alone` (every request of the plan is), only the
        tokens: each logits row's argmax, in `plan.scheduled`'s order of the requests that sample."""
        logits = self._compute(plan)
        if logits is None:
            return [], [], []
        if plan.spec_tokens:
            return self._verify(plan, logits)
        if greedy_alone:  # the sampler's greedy_tokens, looked up there (benchmarks/host_overhead.py times it)
            tokens = sampler.greedy_tokens(logits).tolist()
            self.num_generated_tokens += len(tokens)
            return [], tokens, []
        sampling = plan.sampling
        if not sampling:
            return [], [], []
        sampling, tokens, logprobs = self._sample(logits, plan, sampling)
        self.num_generated_tokens += len(tokens)
        return sampling, tokens, logprobs

    def _verify(
        self, plan: SchedulerOutput, logits: torch.Tensor
    ) -> tuple[list[Request], list[int | None], Sequence[SampledLogprobs | None]]:
        """`_execute`'s sampling for a step that checked proposals (hybridkv/engine/speculation.py): each such request
        takes the first token it keeps (`_update` appends the rest), every other request samples its rows as usual."""
        rows, kept = self.speculator.verify(plan, logits)
        for request, error in self.speculator.errors.items():
            self._fail(plan, [request], f"sampling failed: {type(error).__name__}: {error}")
        others = [request for request in plan.sampling if request not in kept and request not in self.speculator.errors]
        drawn: dict[Request, tuple[int | None, SampledLogprobs | None]] = {}
        if others:
            sampled, tokens, logprobs = self._sample(logits[rows], plan, others)
            drawn = {request: (token, entry) for request, token, entry in zip(sampled, tokens, logprobs, strict=True)}
        sampling: list[Request] = []
        tokens, logprobs = [], []
        for request in plan.sampling:
            if request in kept:
                token, entry = kept[request][0]
            elif request in drawn:
                token, entry = drawn[request]
            else:  # its sampling failed: it left the plan
                continue
            sampling.append(request)
            tokens.append(token)
            logprobs.append(entry)
        self.num_generated_tokens += len(tokens)
        return sampling, tokens, logprobs

    def _compute(self, plan: SchedulerOutput) -> torch.Tensor | None:
        """A plan's copies and forward, with the prompt logprobs it gives recorded: the logits of the rows that
        sample (`plan.sampling`'s), or None where it computes no token."""
        if not (plan.scheduled or plan.swap_out or plan.swap_in):
            return None
        prompt_rows = self._prompt_logprob_rows(plan) if self._prompt_logprobs_pending else []
        extra_rows = [row for _, _, rows in prompt_rows for row in rows]
        if self.tp is None:
            logits = self.runner.execute(plan, extra_rows=extra_rows)
        else:
            logits = self.tp.execute(self.runner, plan, extra_rows)
        if not plan.scheduled:
            return None
        if extra_rows:  # after the sampling rows
            self._record_prompt_logprobs(prompt_rows, logits[len(logits) - len(extra_rows) :])
            logits = logits[: len(logits) - len(extra_rows)]
        self.num_steps += 1
        self.num_forward_tokens += plan.num_tokens
        return logits

    def _prompt_logprob_rows(self, plan: SchedulerOutput) -> list[tuple[Request, int, range]]:
        """For each request of the step that asks for prompt logprobs and computes prompt tokens: (the request, the
        first prompt position the step gives logprobs for, the step's rows whose logits give them). A row's logits
        give the next position's logprob, so a chunk of positions [start, end) gives those of [start + 1, end + 1)
        within the prompt; position 0 has none. A request leaves `_prompt_logprobs_pending` once its step reaches the
        prompt's last position (or it has ended)."""
        wanted = []
        offset = 0
        pending = self._prompt_logprobs_pending
        for request, num_new, _ in plan.scheduled:
            if request.request_id in pending:
                start = request.num_computed_tokens
                count = min(num_new, request.num_prompt_tokens - 1 - start)
                if count > 0:
                    wanted.append((request, start + 1, range(offset, offset + count)))
                if start + num_new >= request.num_prompt_tokens - 1:
                    pending.discard(request.request_id)
            offset += num_new + len(plan.spec_tokens.get(request.request_id, ()))
        pending.intersection_update(r.request_id for r in (*self.scheduler.waiting, *self.scheduler.running))
        return wanted

    def _record_prompt_logprobs(self, wanted: list[tuple[Request, int, range]], logits: torch.Tensor) -> None:
        raw = torch.log_softmax(logits, dim=-1)
        row = 0
        for request, first_position, rows in wanted:
            count = request.params.prompt_logprobs
            entries = []
            for position in range(first_position, first_position + len(rows)):
                entries.append(token_logprobs(raw[row], request.token_ids[position], count))
                row += 1
            self.outputs.record_prompt_logprobs(request, first_position, entries)

    @staticmethod
    def _touched_by(plan: SchedulerOutput) -> list[Request]:
        """The requests a step computes for or copies blocks of: a failed step fails them."""
        swapped_out = [r for r in plan.preempted if r.status is RequestStatus.SWAPPED]
        return [*(s.request for s in plan.scheduled), *plan.swapped_in, *swapped_out]

    def _sample(
        self, logits: torch.Tensor, plan: SchedulerOutput, sampling: list[Request]
    ) -> tuple[list[Request], list[int | None], Sequence[SampledLogprobs | None]]:
        """The requests still in `sampling` afterwards, with their tokens (None for a beam: its row goes to its
        beam search) and logprobs; one request's parameters never fail the others: a request whose row fails is
        failed with its samples and leaves the plan, and so do the tokens its samples drew."""
        rows = [request.sampling_row for request in sampling]  # None for a beam (OutputProcessor.add)
        if None in rows:
            tokens: list[int | None] = [None] * len(sampling)
            logprobs: list[SampledLogprobs | None] = [None] * len(sampling)
            errors: list[Exception | None] = [None] * len(sampling)
            for i, request in enumerate(sampling):
                if request.group.beam is not None:
                    request.group.beam.deposit(request, logits[i])
            sampled = [i for i, request in enumerate(sampling) if request.group.beam is None]
            if sampled:
                drawn = sample_each(logits[sampled], [rows[i] for i in sampled])
                for i, token, token_logprobs, error in zip(sampled, *drawn, strict=True):
                    tokens[i], logprobs[i], errors[i] = token, token_logprobs, error
        else:
            tokens, logprobs, errors = sample_each(logits, rows)
        if not any(errors):
            return sampling, tokens, logprobs
        for request, error in zip(sampling, errors, strict=True):
            if error is not None and not request.status.is_finished:
                self._fail(plan, [request], f"sampling failed: {type(error).__name__}: {error}")
        kept = [i for i, request in enumerate(sampling) if not request.status.is_finished]
        return [sampling[i] for i in kept], [tokens[i] for i in kept], [logprobs[i] for i in kept]

    def _advance_beam_searches(self, sampling: list[Request]) -> None:
        """Take the step of each beam search whose every beam has deposited its row
        (hybridkv/sampling/beam_search.py)."""
        searches = {id(r.group): r.group.beam for r in sampling if r.group.beam is not None}
        for search in searches.values():
            if search.ready:
                search.advance(self.scheduler)

    def _discard_checkpoints(self) -> None:
        """A failed step's state checkpoints were not (all) written: none of them may be hit."""
        if self.coordinator.state_checkpoints is not None:
            self.coordinator.state_checkpoints.discard()

    def _fail(self, plan: SchedulerOutput, requests: Sequence[Request], error: str) -> None:
        """Fail the requests with every sample of their groups, and take them out of the plan."""
        failed = []
        for request in requests:
            failed.extend(self.scheduler.finish_group(request.group, RequestStatus.FINISHED_ERROR, error))
        plan.failed.extend(failed)
        plan.drop(failed)

    # ---- stats --------------------------------------------------------------------------------
