"""`EngineCore`: the model's side of the engine, one step as public methods over plain data.

    schedule()            -> SchedulerOutput        which requests run, their tokens, block copies
    execute(plan)         -> ModelOutput            copies, one forward: the sampling rows' logits, prompt logprobs
    sample(plan, logits)  -> SampledTokens          the next token of each request that samples (or of its proposals)
    update(plan, sampled) -> SampledTokens          requests advanced, blocks cached and returned, beams stepped

The front (`hybridkv/engine/llm_engine.py`: prompts in, `RequestOutput`s out) records each sampled token, decides
which requests stop (`OutputProcessor.process`) and tells the core (`finish`); async scheduling
(`hybridkv/engine/async_steps.py`) and speculative decoding (`hybridkv/engine/speculation.py`) compose the same steps.
The core imports nothing of the front: its inputs are requests (`hybridkv/scheduling/request.py`) and its outputs the
named tuples below.

Built once per model: the probe (layer kinds, KV groups), how steps run (decode buckets, CUDA graphs, compile,
tensor parallelism), the memory plan (KV blocks, state slots, swap space), then the scheduler over the memory manager
and the model runner over the pages.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from hybridkv.engine.kv_events import ZmqEventPublisher
from hybridkv.engine.speculation import DraftEngine, RecordToken, Speculator
from hybridkv.engine.worker import check_call, run_call, worker_class
from hybridkv.execution.config import GIB, EngineConfig
from hybridkv.execution.cpu_threads import StepThreads
from hybridkv.execution.distributed import TensorParallel, tensor_parallel_size
from hybridkv.execution.graphs import captures_graphs, decode_buckets, graph_mode
from hybridkv.execution.kv_tiers import DiskBlockStore, model_fingerprint
from hybridkv.execution.layout_watch import LayoutWatch
from hybridkv.execution.lora import LoRASlots
from hybridkv.execution.model_runner import ModelRunner, RunnerLimits
from hybridkv.execution.model_watch import ModelChange, ModelWatch
from hybridkv.execution.sizing import kv_layout, num_kv_blocks
from hybridkv.execution.state_continuations import decode_form_differs
from hybridkv.execution.state_layers import scan_chunk
from hybridkv.execution.step_check import check_step_exactness
from hybridkv.execution.weight_memory import Reload, WeightMemory
from hybridkv.kernels.quant import is_fp8
from hybridkv.lora.request import AdapterRef, as_lora_request
from hybridkv.memory.block_pool import cdiv
from hybridkv.memory.coordinator import KVCacheCoordinator
from hybridkv.memory.kv_events import DISK
from hybridkv.memory.state_slots import STATE_GROUP
from hybridkv.memory.tiers import BlockTiers
from hybridkv.patches.inspection import ModelLayout
from hybridkv.patches.probe import attention_installed
from hybridkv.sampling import sampler
from hybridkv.sampling.sampler import SampledLogprobs, SamplingRow, sample_each, token_logprobs
from hybridkv.scheduling.output import SchedulerOutput
from hybridkv.scheduling.request import Request, RequestStatus, SampleGroup
from hybridkv.scheduling.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger("hybridkv")

# Makes a draft model's engine for speculative decoding, the core it drafts for given (its block count, its length).
DraftFactory = Callable[[torch.nn.Module, "EngineCore"], DraftEngine]
# What the sampler reads for each request (its front's records: `OutputProcessor.rows`); None for a beam.
RowsOf = Callable[[Sequence[Request]], list[SamplingRow | None]]


class MemoryPlan(NamedTuple):
    """What `EngineCore._plan_memory` gives the core to build: the pool's blocks and swap blocks, state slots (one
    per request that may run, and the scratch slot), state checkpoints and their interval, CPU state slots for
    swapped requests."""

    num_blocks: int
    num_swap_blocks: int
    num_state_slots: int
    num_checkpoints: int
    checkpoint_interval: int
    num_swap_state_slots: int


class PromptLogprobs(NamedTuple):
    """A request's prompt logprobs that one step computed: positions `first_position`, `first_position + 1`, ...
    (a row's logits give the next position's logprob; position 0 has none)."""

    request: Request
    first_position: int
    entries: list[SampledLogprobs]


class ModelOutput(NamedTuple):
    """`EngineCore.execute`'s result: the logits of the rows that sample (`plan.sampling`'s, a speculating request's
    proposals' rows after its own; None where the plan computed no token) and the prompt logprobs it gave."""

    logits: torch.Tensor | None
    prompt_logprobs: list[PromptLogprobs]


class SampledTokens(NamedTuple):
    """The requests that sampled in a step (a request whose sampling failed was failed and left the plan), their
    tokens (None for a beam: its search chooses) and logprobs (None where not asked for; empty for a step of
    `greedy_alone` requests, whose tokens are `plan.scheduled`'s sampling rows' argmax, `requests` empty too)."""

    requests: list[Request]
    tokens: list[int | None]
    logprobs: Sequence[SampledLogprobs | None]


NOTHING_SAMPLED = SampledTokens([], [], [])


def compiles_by_default(captures: bool) -> bool:
    """compile=None: compiled where CUDA graphs are captured (one GPU), eager elsewhere: on the CPU compiling costs
    more set-up than its steps save (benchmarks/RESULTS.md, "The compiled forward")."""
    return captures


class EngineCore:
    """The scheduler, the memory manager and the model runner of one model, stepped through public methods (module
    docstring). Not thread-safe: its front serialises calls (`hybridkv/engine/call_guard.py`). `rows_of` gives what
    the sampler reads for each request; `draft_engine` makes a draft model's engine for speculative decoding."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        rows_of: RowsOf,
        draft_engine: DraftFactory | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.rows_of = rows_of
        self._worker_type = worker_class(config.worker_extension_cls)  # a name that does not import fails first
        self.layout = self._probe()
        # The config and attention implementation the layout was built for.
        named = dict(model.named_modules())
        self.layout_watch = LayoutWatch(model, [named[name] for name in self.layout.module_names.values()])
        buckets, captures, compiled = self._plan_steps(self.layout)
        # LoRA adapters' slots, allocated before the KV pool is sized from the memory left.
        self.lora = self._build_lora()
        memory = self._plan_memory(self.layout, max(buckets, default=0))
        self._build_memory(memory)
        self._build_runner(self.layout, memory, buckets, captures, compiled)
        self.disk_store = self._build_tiers()
        self.kv_events = self._build_kv_events()
        # Whether only full attention holds what a request computed: no state layer (it cannot go back) and no window
        # or attention chunk (a block behind one may have gone back to the pool). A speculative step's proposals
        # then store their K/V, and a request can go on from other tokens (`LLMEngine.continue_from`).
        self.full_attention_only = not self.layout.states and all(
            group.sliding_window is None and group.attention_chunk_size is None for group in self.kv_config.groups
        )
        self.speculator = self._speculator(draft_engine)
        self.model_watch = ModelWatch(model)
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_forward_tokens = 0
        self.schedule_seconds = 0.0
        # Requests (their leaders) whose prompt logprobs are not all computed yet (`_prompt_logprob_rows`).
        self.prompt_logprobs_pending: set[str] = set()

    # ---- built once -----------------------------------------------------------------------------

    def _probe(self) -> ModelLayout:
        """The model's layers as the probe finds them (their kinds, KV groups, dtypes) and the end-to-end check of
        its steps against its own forward; the layout the plans are made from."""
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

    def _plan_steps(self, layout: ModelLayout) -> tuple[tuple[int, ...], bool, bool]:
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
        # (hybridkv/kernels/latent_attention.py). A latent model compiles when asked to, compile=True.
        latent_fp8 = any(is_fp8(self.layer_dtypes.dtypes[layer_idx]) for layer_idx in layout.latent)
        # LoRA's hooks read each step's rows per adapter from host lists: eager steps, never padded or compiled yet.
        if config.enable_lora and config.compile:
            raise ValueError("compile=True does not compile LoRA's per-request layers yet; patch with compile=False")
        graphs_wanted = (
            graph_mode(model, config.enforce_eager) and not layout.states and not latent_fp8 and not config.enable_lora
        )
        buckets = decode_buckets(config.max_num_seqs) if graphs_wanted else ()
        captures = bool(buckets) and captures_graphs(model)
        compiled = config.compile if config.compile is not None else compiles_by_default(captures)
        compiled = compiled and (config.compile is True or not layout.latent) and not config.enable_lora
        # Tensor parallel: every rank holds its own KV heads in a pool of the same block count.
        self.tp = TensorParallel(model) if tensor_parallel_size(model) > 1 else None
        # The rank of a tensor-parallel worker (every rank but 0), which runs the steps rank 0 sends; else None.
        self.worker_rank = None if self.tp is None or self.tp.driver else self.tp.rank
        if config.enable_lora and self.tp is not None:
            raise ValueError(
                "enable_lora=True is not supported for a tensor-parallel model yet (each rank would need its shard of "
                "every adapter); patch without it"
            )
        if config.async_scheduling and self.tp is not None:
            raise ValueError(
                "async_scheduling=True is not supported for a tensor-parallel model (every rank runs each step as "
                "rank 0 plans it); patch with async_scheduling=False"
            )
        return buckets, captures, compiled

    def _build_lora(self) -> LoRASlots | None:
        """The LoRA adapters' slots and hooks (`enable_lora`)."""
        config = self.config
        if not config.enable_lora:
            return None
        return LoRASlots(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras)

    def _plan_memory(self, layout: ModelLayout, largest_bucket: int) -> MemoryPlan:
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

    def _build_memory(self, memory: MemoryPlan) -> None:
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
            max_loras=config.max_loras if config.enable_lora else 0,
        )
        self.coordinator = KVCacheCoordinator(
            self.kv_config,
            memory.num_blocks,
            config.enable_prefix_caching,
            num_state_slots=memory.num_state_slots,
            num_state_checkpoints=memory.num_checkpoints,
            state_checkpoint_interval=memory.checkpoint_interval,
            checkpoints_in_prompts_only=decode_form_differs(self.model, self.layout.states),
        )
        self.scheduler = Scheduler(self.scheduler_config, self.coordinator)

    def _build_runner(
        self, layout: ModelLayout, memory: MemoryPlan, buckets: tuple[int, ...], captures: bool, compiled: bool
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
        self.runner.lora = self.lora
        rank, size = (self.tp.rank, self.tp.size) if self.tp is not None else (0, 1)
        self.worker = self._worker_type(self.runner, rank, size)
        self.weights: WeightMemory | None = None  # the model's weights, where the engine loaded it (`own_weights`)
        if self.lora is not None:
            # State layers' segments and latent layers' per-sequence up-projections tell the hooks whose rows they see.
            if self.runner.state_cache is not None:
                self.runner.state_cache.lora = self.lora
            self.runner.context.sequence_scope = self.lora.sequence
        self.runner.allocate_swap_space(memory.num_swap_blocks)
        self.runner.allocate_state_swap_space(memory.num_swap_state_slots)
        if compiled or captures:
            with attention_installed(self.model):
                self.runner.warm_up(capture=captures)
        on_cpu = all(device.type == "cpu" for device in self.runner.devices)
        self.step_threads = StepThreads(config.cpu_threads if on_cpu else None)

    def _build_tiers(self) -> DiskBlockStore | None:
        """The tiers beyond the pool, where `kv_offloading_size` or `prefix_cache_dir` asks for them: the host tier's
        slots in the runner (a model with state checkpoints splits its bytes between blocks and checkpoints so that
        both hold prefixes of the same length), the disk store over the model's fingerprint; the disk store, if any."""
        config, runner, coordinator = self.config, self.runner, self.coordinator
        if not config.kv_offloading_size and config.prefix_cache_dir is None:
            return None
        if self.tp is not None:
            raise ValueError(
                "kv_offloading_size and prefix_cache_dir are not supported for a tensor-parallel model yet (each rank "
                "would keep its own shard of every block); patch without them"
            )
        checkpoints = coordinator.state_checkpoints
        state_bytes = sum(spec.state_bytes for spec in self.layout.states)
        host_bytes = config.kv_offloading_bytes
        state_host_bytes = 0
        if checkpoints is not None:
            # Split so that both hold the same prefixes: a token of prefix costs a block's bytes per block size in
            # every group, and a checkpoint's bytes per checkpoint interval.
            per_token_blocks = sum(self.bytes_per_block / group.block_size for group in self.kv_config.groups)
            per_token_states = state_bytes / checkpoints.interval
            state_host_bytes = int(host_bytes * per_token_states / (per_token_states + per_token_blocks))
        num_host_slots = (host_bytes - state_host_bytes) // self.bytes_per_block
        if config.kv_offloading_size and num_host_slots == 0:
            raise ValueError(
                f"kv_offloading_size={config.kv_offloading_size:g} GiB holds no block of this model "
                f"({self.bytes_per_block:,} bytes each); give at least {self.bytes_per_block / GIB:.6f} GiB"
            )
        disk = None
        if config.prefix_cache_dir is not None:
            start = time.perf_counter()
            fingerprint = model_fingerprint(self.model, repr(self.kv_config), repr(self.layer_dtypes))

            def read_rows(group_id: int, ids: list[int]) -> list[torch.Tensor]:
                return runner.read_states(ids) if group_id == STATE_GROUP else runner.read_pages(ids)

            def write_slot(group_id: int, slot: int, payload: bytes) -> bool:
                write = runner.write_host_state if group_id == STATE_GROUP else runner.write_host_slot
                return write(slot, payload)

            disk = DiskBlockStore(
                config.prefix_cache_dir, int(config.prefix_cache_dir_size * GIB), fingerprint, read_rows, write_slot
            )
            logger.info(
                "hybridkv: prefix_cache_dir %s: model fingerprinted in %.1f s, %d blocks of it found",
                disk.folder,
                time.perf_counter() - start,
                disk.num_files,
            )
        # Without a host tier of its own, the slots only stage what a step reads from disk: a whole prompt's blocks,
        # a checkpoint per request.
        host_keeps = num_host_slots > 0
        if not host_keeps:
            num_host_slots = cdiv(self.max_model_len, self.kv_config.block_size) * len(self.kv_config.groups)
        if disk is not None:  # a process that ends without unpatch still writes what its last step cached
            atexit.register(_flush_at_exit, weakref.ref(disk))
        runner.allocate_host_tier(num_host_slots)
        state_tiers = None
        if checkpoints is not None:
            num_state_slots = state_host_bytes // state_bytes if host_keeps else config.max_num_seqs
            if num_state_slots:
                runner.allocate_host_state_tier(num_state_slots)
                state_tiers = BlockTiers(num_state_slots, disk, host_keeps)
        coordinator.attach_tiers(BlockTiers(num_host_slots, disk, host_keeps), state_tiers)
        return disk

    def _build_kv_events(self) -> ZmqEventPublisher | None:
        """vLLM's KV events, where `kv_events_config` enables them: recorded by the memory manager (its pool, state
        checkpoints and tiers, the disk store's removals too), sent by a publisher thread."""
        config = self.config.kv_events_config
        if config is None or not config.publishes or self.worker_rank is not None:  # rank 0 alone schedules and caches
            return None
        recorder = self.coordinator.record_events(config.hybrid_groups)
        if self.disk_store is not None:
            self.disk_store.on_remove = lambda key: recorder.removed(*key, DISK)
        return ZmqEventPublisher(config)

    @property
    def kv_event_block_size(self) -> int:
        """The block size of the KV events' group 0 (`LLMEngine.kv_event_block_size`)."""
        events = self.coordinator.events
        return events.block_size if events is not None else self.coordinator.block_size

    def publish_kv_events(self) -> None:
        """Send the KV events recorded since the last call as one batch (after each step, and after what changes the
        cache outside one)."""
        if self.kv_events is not None:
            self.kv_events.publish(self.coordinator.events.take())

    def _speculator(self, draft_engine: DraftFactory | None) -> Speculator | None:
        """Speculative decoding's proposer and check (hybridkv/engine/speculation.py), where `speculative_config` asks
        for it; `draft_engine` makes a draft model's engine. Refuses what it cannot run."""
        config = self.config
        speculative = config.speculative_config
        if speculative is None:
            return None
        # Full-attention groups only: a kept proposal's K/V can stay where its row stored them (vLLM's way).
        stores_proposals = self.full_attention_only
        if self.layout.latent and not stores_proposals:
            raise ValueError(
                "speculative_config: latent attention layers read a step's own rows back from their pages, and a "
                "proposal's row is stored there only on a model whose layers are all full attention (this one has "
                "state layers or windows); patch this model without speculative_config"
            )
        if config.async_scheduling:
            raise ValueError(
                "speculative_config with async_scheduling=True is not supported yet: async scheduling plans each step "
                "before the last one's tokens are read, and a speculating request's next step depends on how many of "
                "its proposals the last one kept (its tokens, its next proposals); patch with async_scheduling=False "
                "(or None)"
            )
        # Under tensor parallelism the driver proposes and checks; a worker runs the rows it is sent (no draft).
        worker = self.tp is not None and not self.tp.driver
        drafts = None if worker or draft_engine is None else functools.partial(draft_engine, core=self)
        speculator = Speculator(speculative, self.rows_of, drafts)
        if speculator.draft is not None:  # a request's end ends its draft's request
            self.scheduler.on_finish = speculator.end_draft
        self.scheduler.speculative = True
        self.scheduler.stores_proposals = stores_proposals
        return speculator

    # ---- what the front reads ------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """The pool's block count (the null block included)."""
        return self.coordinator.pool.num_blocks

    @property
    def model_key(self) -> bytes:
        """The key of the model as it computes now (hybridkv/execution/model_watch.py): new requests are hashed under
        it, and images encoded under another are refused."""
        return self.coordinator.model_key

    @property
    def input_device(self) -> torch.device:
        """The device the model's inputs go to (where a seeded request's generator draws)."""
        return self.runner.input_device

    @property
    def on_one_gpu(self) -> bool:
        """Whether the model runs on one CUDA device (no tensor parallelism): where async scheduling is the default."""
        return self.tp is None and [device.type for device in self.runner.devices] == ["cuda"]

    @property
    def asleep(self) -> bool:
        """Whether `sleep` gave the pages back (until `wake_up`)."""
        return self.runner.asleep

    def chunk_cap(self) -> int:
        """The most tokens one prefill chunk computes (`Scheduler.chunk_cap`)."""
        return self.scheduler.chunk_cap()

    def speculates(self, params: object) -> bool:
        """Whether a request of these settings has its tokens proposed (speculative decoding on, and the request's
        tokens depend on its logits alone: `Speculator.speculates`)."""
        return self.speculator is not None and self.speculator.speculates(params)

    def images_refused(self, layers: frozenset[int] | None = None) -> str | None:
        """Why this model's images cannot be served here; None where they can. With `layers` (those in which an
        image's tokens attend both ways), the attention of those layers is told which they are."""
        if self.layout.states or self.tp is not None:
            return "images are not served with state layers or tensor parallelism yet"
        if layers is None:
            return None
        if layers and any(self.runner.layers[i].attention_chunk_size for i in layers if i in self.runner.layers):
            return "images that attend both ways are not served with chunked local attention"
        self.runner.context.image_layers = layers
        return None

    # ---- requests ---------------------------------------------------------------------------------

    def adapter(self, lora_request: Any) -> AdapterRef | None:
        """A request's LoRA adapter as read now (None for none): vLLM's `LoRARequest` (or an object with its
        `lora_name`, `lora_int_id` and `lora_path`), its folder read unless cached. A ValueError where the engine was
        patched without enable_lora or the adapter cannot be served (hybridkv/execution/lora_weights.py)."""
        if lora_request is None:
            return None
        request = as_lora_request(lora_request)
        if self.lora is None:
            raise ValueError(
                "lora_request needs an engine patched with enable_lora=True (hybridkv.patch(model, enable_lora=True, "
                "max_loras=..., max_lora_rank=...)), as vLLM's LLM(enable_lora=True)"
            )
        return AdapterRef(request, self.lora.adapter(request).key)

    def add_request(self, group: SampleGroup) -> bool:
        """Queue a request's group (or one part of its samples); False where it can never run (it finished at once
        with an error, which its front reports). A request that asks for prompt logprobs has them computed."""
        leader = group.leader
        if not self.scheduler.add_request(leader):
            return False
        # The first part's leader computes the prompt logprobs (another part's prompt is a prefix-cache hit).
        if group.beam is None and leader.params.prompt_logprobs is not None and leader.sample_index == 0:
            self.prompt_logprobs_pending.add(leader.request_id)
        return True

    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """End one request (a stop the front decided): every block and state slot it held is returned."""
        self.scheduler.finish(request, status, error)

    def finish_group(self, group: SampleGroup, status: RequestStatus, error: str | None = None) -> list[Request]:
        """End every unfinished sample of a group (an abort, a failure); the requests it ended."""
        return self.scheduler.finish_group(group, status, error)

    # ---- the model it serves ----------------------------------------------------------------------

    def model_check_due(self, checked: bool) -> bool:
        """Whether the step about to be planned must check the model first (`follow_model`): it was not `checked`
        in this call, and a request may be admitted (and hit the prefix cache: `Scheduler.may_admit`) or a graph
        replayed. A full batch with requests waiting is not checked until a seat frees: a check reads every tensor
        of the model, which such a step would pay for an admission it cannot make (benchmarks/RESULTS.md, "Host
        work in a loaded step loop")."""
        scheduler = self.scheduler
        return not checked and (
            scheduler.may_admit() or (self.runner.graphs is not None and bool(scheduler.running or scheduler.swapped))
        )

    def check_layout(self) -> None:
        """Raise `ModelReshaped`, naming the fix, if the model's attention implementation or a config value that
        shapes its attention changed since the engine was built (`LayoutWatch`): nothing here follows such a change.
        """
        self.layout_watch.check()

    def follow_model(self) -> ModelChange | None:
        """Check the model (`ModelWatch.check`); after a change, requests admitted from now on are hashed under its
        new key, and CUDA graphs are captured again where they replay what changed. The change, for the front's
        own caches (images). A dtype or device change raises `ModelMoved`, naming the fix."""
        change = self.model_watch.check()
        if change is not None:
            self.take_model_change(change)
        return change

    def take_model_change(self, change: ModelChange) -> None:
        """Blocks computed before `change` are never hit again; the compiled forward and CUDA graphs follow it."""
        if self.disk_store is not None:  # what the model as it was computed goes to disk first
            self.disk_store.flush()
        self.coordinator.model_changed(change.key)
        replaced = self.runner.follow_model()
        if (change.moved or replaced) and self.runner.graphs is not None:
            warnings.warn(
                f"hybridkv captures the decode steps' CUDA graphs again: {'; '.join(change.reasons)}, and the "
                "captured graphs replay what the model computed before",
                stacklevel=5,
            )
            self.runner.capture_graphs()

    # ---- the step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step's plan (`Scheduler.schedule`)."""
        start = time.perf_counter()
        if self.disk_store is not None:  # the blocks cached since the last plan, before any can be evicted
            self.disk_store.flush()
        plan = self.scheduler.schedule()
        self.schedule_seconds += time.perf_counter() - start
        return plan

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        """A plan's copies and forward (on every rank of a tensor-parallel model): the logits of the rows that sample
        and the prompt logprobs the step gives."""
        if not (plan.scheduled or plan.swap_out or plan.swap_in):
            return ModelOutput(None, [])
        wanted = self._prompt_logprob_rows(plan) if self.prompt_logprobs_pending else ()
        extra_rows = [row for _, _, rows in wanted for row in rows] if wanted else ()
        if self.tp is None:
            logits = self.runner.execute(plan, extra_rows=extra_rows)
        else:
            logits = self.tp.execute(self.runner, plan, extra_rows)
        if not plan.scheduled:
            return ModelOutput(None, [])
        prompt_logprobs = []
        if extra_rows:  # after the sampling rows
            prompt_logprobs = _prompt_logprobs(wanted, logits[len(logits) - len(extra_rows) :])
            logits = logits[: len(logits) - len(extra_rows)]
        self.num_steps += 1
        self.num_forward_tokens += plan.num_tokens
        return ModelOutput(logits, prompt_logprobs)

    def sample(self, plan: SchedulerOutput, logits: torch.Tensor | None, greedy_alone: bool = False) -> SampledTokens:
        """The step's tokens from its logits. With `greedy_alone` (every request of the plan is), only the tokens:
        each row's argmax, in `plan.scheduled`'s order of the requests that sample. A step that checked proposals
        keeps what its check accepts (`Speculator.verify`). A request whose row fails is failed alone."""
        if logits is None:
            return NOTHING_SAMPLED
        if plan.spec_tokens:
            return self._verify(plan, logits)
        if greedy_alone:  # the sampler's greedy_tokens, looked up there (benchmarks/host_overhead.py times it)
            tokens = sampler.greedy_tokens(logits).tolist()
            self.num_generated_tokens += len(tokens)
            return SampledTokens([], tokens, [])
        sampling = plan.sampling
        if not sampling:
            return NOTHING_SAMPLED
        sampled = self.sample_rows(logits, plan, sampling)
        self.num_generated_tokens += len(sampled.tokens)
        return sampled

    def sample_rows(self, logits: torch.Tensor, plan: SchedulerOutput, sampling: list[Request]) -> SampledTokens:
        """Each request's token from its row of `logits` (None for a beam: its row goes to its beam search); one
        request's parameters never fail the others: a request whose row fails is failed with its samples and leaves
        the plan, and so do the tokens its samples drew."""
        rows = self.rows_of(sampling)  # None for a beam
        if None in rows:
            tokens: list[int | None] = [None] * len(sampling)
            logprobs: list[SampledLogprobs | None] = [None] * len(sampling)
            errors: list[Exception | None] = [None] * len(sampling)
            for i, request in enumerate(sampling):
                if request.group.beam is not None:
                    request.group.beam.deposit(request, logits[i])
            drawn_rows = [i for i, request in enumerate(sampling) if request.group.beam is None]
            if drawn_rows:
                drawn = sample_each(logits[drawn_rows], [rows[i] for i in drawn_rows])
                for i, token, entry, error in zip(drawn_rows, *drawn, strict=True):
                    tokens[i], logprobs[i], errors[i] = token, entry, error
        else:
            tokens, logprobs, errors = sample_each(logits, rows)
        if not any(errors):
            return SampledTokens(sampling, tokens, logprobs)
        for request, error in zip(sampling, errors, strict=True):
            if error is not None and not request.status.is_finished:
                self.fail(plan, [request], f"sampling failed: {type(error).__name__}: {error}")
        kept = [i for i, request in enumerate(sampling) if not request.status.is_finished]
        return SampledTokens([sampling[i] for i in kept], [tokens[i] for i in kept], [logprobs[i] for i in kept])

    def _verify(self, plan: SchedulerOutput, logits: torch.Tensor) -> SampledTokens:
        """`sample` for a step that checked proposals (hybridkv/engine/speculation.py): each such request takes the
        first token it keeps (`Speculator.finish` appends the rest), every other request samples its rows as usual."""
        speculator = self.speculator
        rows, kept = speculator.verify(plan, logits)
        for request, error in speculator.errors.items():
            self.fail(plan, [request], f"sampling failed: {type(error).__name__}: {error}")
        others = [request for request in plan.sampling if request not in kept and request not in speculator.errors]
        drawn: dict[Request, tuple[int | None, SampledLogprobs | None]] = {}
        if others:
            sampled = self.sample_rows(logits[rows], plan, others)
            drawn = {request: (token, entry) for request, token, entry in zip(*sampled, strict=True)}
        sampling: list[Request] = []
        tokens: list[int | None] = []
        logprobs: list[SampledLogprobs | None] = []
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
        return SampledTokens(sampling, tokens, logprobs)

    def update(self, plan: SchedulerOutput, sampled: SampledTokens) -> SampledTokens:
        """After the step ran: advance its requests by their tokens, cache the blocks that filled and return those
        that left a window (`Scheduler.update`), and take each beam search's step whose beams all scored. The
        tokens the front records: `sampled` without the beams' (their search chose theirs)."""
        self.scheduler.update(plan, sampled.tokens)
        if None not in sampled.tokens:
            return sampled
        searches = {id(r.group): r.group.beam for r in sampled.requests if r.group.beam is not None}
        for search in searches.values():
            if search.ready:
                search.advance(self.scheduler)
        kept = [i for i, token in enumerate(sampled.tokens) if token is not None]
        return SampledTokens(*([values[i] for i in kept] for values in sampled))

    def update_blocks(self, plan: SchedulerOutput) -> None:
        """The KV side of a step's update alone, for requests the caller advanced (`Scheduler.update_blocks`)."""
        self.scheduler.update_blocks(plan)

    def finish_speculation(self, record: RecordToken) -> None:
        """Speculative decoding, after a step's update: each request's kept tokens after its first, each recorded
        and checked for a stop by the front (`record`), as a sampled token is (`Speculator.finish`)."""
        self.num_generated_tokens += self.speculator.finish(self.scheduler, record)

    def propose(self) -> None:
        """Speculative decoding: the next proposals of every running request that speculates."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)

    def fail(self, plan: SchedulerOutput, requests: Sequence[Request], error: str) -> None:
        """Fail the requests with every sample of their groups, and take them out of the plan."""
        failed = []
        for request in requests:
            failed.extend(self.scheduler.finish_group(request.group, RequestStatus.FINISHED_ERROR, error))
        plan.failed.extend(failed)
        plan.drop(failed)

    def fail_step(self, plan: SchedulerOutput, error: str) -> None:
        """A step that failed or was interrupted: its state checkpoints are dropped (not all of them were written),
        its kept proposals too, and its requests fail with those its swap copies touched."""
        if self.coordinator.state_checkpoints is not None:
            self.coordinator.state_checkpoints.discard()
        if self.speculator is not None:
            self.speculator.drop()
        swapped_out = [r for r in plan.preempted if r.status is RequestStatus.SWAPPED]
        self.fail(plan, [*(s.request for s in plan.scheduled), *plan.swapped_in, *swapped_out], error)

    def _prompt_logprob_rows(self, plan: SchedulerOutput) -> list[tuple[Request, int, range]]:
        """For each request of the step that asks for prompt logprobs and computes prompt tokens: (the request, the
        first prompt position the step gives logprobs for, the step's rows whose logits give them). A row's logits
        give the next position's logprob, so a chunk of positions [start, end) gives those of [start + 1, end + 1)
        within the prompt; position 0 has none. A request leaves `prompt_logprobs_pending` once its step reaches the
        prompt's last position (or it has ended)."""
        wanted = []
        offset = 0
        pending = self.prompt_logprobs_pending
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

    # ---- memory -----------------------------------------------------------------------------------

    def reset_prefix_cache(self, reset_running_requests: bool, reset_disk: bool = False) -> ModelChange:
        """Make every cached block unreachable; with `reset_running_requests`, running and swapped-out requests
        compute their tokens again; with `reset_disk`, the disk tier's files of this model go too. The change taken
        (for the front's caches)."""
        if reset_running_requests:
            self.scheduler.recompute_all()
        if reset_disk and self.disk_store is not None:
            self.disk_store.clear()
        change = self.model_watch.invalidate("reset_prefix_cache() was called")
        self.take_model_change(change)
        self.publish_kv_events()
        return change

    def sleep(self) -> None:
        """Give back the pages, state slots and graphs (the prefix cache's contents go with them), and a draft model's
        engine its own (`Speculator.sleep`)."""
        if self.disk_store is not None:
            self.disk_store.flush()
        self.coordinator.forget_cached()
        self.publish_kv_events()
        self.runner.sleep()
        if self.speculator is not None:
            self.speculator.sleep()

    def wake_up(self, capture: bool = True) -> None:
        """Allocate what `sleep` gave back (pages zeroed, graphs captured again), a draft model's engine's too.
        `capture=False` while the model's weights are still asleep: the graphs wait for `weights_woken`."""
        if self.runner.asleep:
            self.runner.wake_up(capture)
            if self.speculator is not None:
                self.speculator.wake_up()

    def own_weights(self, reload: Reload | None) -> None:
        """The engine loaded the model itself: `weights` may give its weights back at sleep, and the worker's
        `reload_weights` loads them again with `reload` (`LLMEngine.own_weights`)."""
        self.weights = self.worker.weights = WeightMemory(self.model, reload)

    def weights_woken(self) -> None:
        """The model's weights are back (`WeightMemory.wake_up`), at new addresses: the model watch takes them as a
        change (what was cached before is not hit again), and graphs waiting for them are captured."""
        self.follow_model()
        self.runner.capture_pending_graphs()

    def collective_rpc(
        self, method: str | Callable[..., Any], timeout: float | None, args: tuple, kwargs: dict[str, Any]
    ) -> list[Any]:
        """vLLM's `collective_rpc`: `method` run on every rank's `Worker`, the results in rank order
        (hybridkv/engine/worker.py)."""
        args, kwargs = check_call(timeout, args, kwargs)
        message = (method, args, kwargs)
        if self.tp is None:
            return [self._run_call(message)]
        return self.tp.call(self._run_call, message)

    def _run_call(self, message: tuple[Any, tuple, dict[str, Any]]) -> Any:
        return run_call(self.worker, *message)

    def run_worker(self) -> None:
        """On a tensor-parallel worker rank: run the steps and calls rank 0 sends until it closes its engine."""
        self.tp.run_worker(self.runner, self._run_call)

    def close(self) -> None:
        """Release the pool's blocks now: they link each other, so only the cycle collector would free them otherwise,
        in a pause of its own choosing (benchmarks/RESULTS.md, choices in the code)."""
        if self.tp is not None:
            self.tp.stop()
        if self.disk_store is not None:
            self.disk_store.flush()
        if self.kv_events is not None:
            self.publish_kv_events()
            self.kv_events.shutdown()
        self.coordinator.close()
        self.runner.close()
        if self.lora is not None:
            self.lora.close()
        if self.speculator is not None:
            self.speculator.close()
        self.model_watch.close()


def _flush_at_exit(disk: weakref.ref[DiskBlockStore]) -> None:
    """At the interpreter's exit: the disk store's queued blocks written, if the store is still there."""
    store = disk()
    if store is not None:
        try:
            store.flush()
        except Exception:  # pages already gone (a closed runner): nothing to write
            logger.debug("hybridkv: the disk tier's last blocks could not be written at exit", exc_info=True)


def _prompt_logprobs(wanted: list[tuple[Request, int, range]], logits: torch.Tensor) -> list[PromptLogprobs]:
    raw = torch.log_softmax(logits, dim=-1)
    found = []
    row = 0
    for request, first_position, rows in wanted:
        count = request.params.prompt_logprobs
        entries = []
        for position in range(first_position, first_position + len(rows)):
            entries.append(token_logprobs(raw[row], request.token_ids[position], count))
            row += 1
        found.append(PromptLogprobs(request, first_position, entries))
    return found
