"""The engine: the step loop (schedule -> one forward -> sample -> update) and the public API."""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.coordinator import KVCacheCoordinator, blocks_for_request
from hybridkv.detokenizer import IncrementalDetokenizer
from hybridkv.grouping import KVCacheConfig, group_layers
from hybridkv.kernels import num_blocks_for_budget, num_blocks_for_memory_utilization
from hybridkv.model_runner import ModelRunner
from hybridkv.outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta
from hybridkv.patches.inspection import ModelLayout, inspect_model
from hybridkv.request import Request, RequestStatus
from hybridkv.sampler import SamplingRow, TokenLogprobs, sample
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class EngineConfig:
    """Everything `hybridkv.patch(model, **config)` accepts (names follow vLLM).

    KV memory: `num_blocks` if given, else `kv_cache_memory` bytes, else on CUDA
    `gpu_memory_utilization` of the device, else 1 GiB on the CPU. `swap_space` bytes of CPU memory
    hold requests preempted with `preemption_mode="swap"` (never more blocks than the device pool).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: torch.dtype | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: int = 0
    attention_backend: str | None = None


class _Tracked:
    """One user request: its samples (scheduler requests), their text, logprobs and generators."""

    def __init__(self, request_id: str, prompt: str | None, members: list[Request]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.members = members
        self.detokenizers: list[IncrementalDetokenizer | None] = []
        self.logprobs: list[list[TokenLogprobs] | None] = []
        self.generators: list[torch.Generator | None] = []
        self.streamed = [0] * len(members)
        self.metrics = RequestMetrics(arrival_time=time.monotonic())

    @property
    def finished(self) -> bool:
        return all(m.status.is_finished for m in self.members)


class LLMEngine:
    """A continuous-batching engine bound to one Hugging Face model (see `hybridkv.patch`)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        kv_dtype, layout, self.kv_config, self.max_model_len = _kv_layout(model, config)
        self.vocab_size = model.config.get_text_config().vocab_size
        self.media_token_ids = _media_token_ids(model.config)
        self.bytes_per_block = self.kv_config.block_bytes
        num_blocks = self._num_blocks()
        num_swap_blocks = min(config.swap_space // self.bytes_per_block, num_blocks - 1)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            preemption_mode=config.preemption_mode,
            num_swap_blocks=num_swap_blocks,
        )
        self.coordinator = KVCacheCoordinator(self.kv_config, num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.coordinator)
        self.runner = ModelRunner(
            model, self.kv_config, layout.module_names, num_blocks, kv_dtype, config.attention_backend
        )
        self.runner.allocate_swap_space(num_swap_blocks)
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self._tracked: dict[str, _Tracked] = {}
        self._rejected: list[_Tracked] = []
        self._unclaimed: list[RequestOutput] = []
        self._ids = itertools.count()
        self._closed = False
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.step_seconds = 0.0
        self.schedule_seconds = 0.0
        self.update_seconds = 0.0

    # ---- sizing -------------------------------------------------------------------------------

    def _min_blocks(self) -> int:
        """The null block plus one request at max_model_len."""
        return _blocks_for_requests(self.kv_config, self.config, self.max_model_len, 1)

    def _num_blocks(self) -> int:
        config = self.config
        min_blocks = self._min_blocks()
        if config.num_blocks is not None:
            if config.num_blocks < min_blocks:
                raise ValueError(
                    f"num_blocks={config.num_blocks} cannot hold one request at max_model_len="
                    f"{self.max_model_len} ({min_blocks} blocks with the null block); raise num_blocks "
                    "or lower max_model_len"
                )
            return config.num_blocks
        if config.kv_cache_memory is not None:
            return num_blocks_for_budget(config.kv_cache_memory, self.bytes_per_block, min_blocks)
        device = next(self.model.parameters()).device
        if device.type == "cuda":
            activation_peak = self._profile_forward(device)
            free_bytes, total_bytes = torch.cuda.mem_get_info(device)
            return num_blocks_for_memory_utilization(
                config.gpu_memory_utilization,
                free_bytes - activation_peak,
                total_bytes,
                self.bytes_per_block,
                min_blocks,
            )
        # On the CPU: 1 GiB, but no more than max_num_seqs requests at max_model_len can use.
        most = _blocks_for_requests(self.kv_config, config, self.max_model_len, config.max_num_seqs)
        budget = min(DEFAULT_CPU_KV_CACHE_BYTES, most * self.bytes_per_block)
        return num_blocks_for_budget(budget, self.bytes_per_block, min_blocks)

    def _profile_forward(self, device: torch.device) -> int:
        """Bytes a forward of the largest step needs beyond what stays allocated (its activations),
        measured with the model's own attention before the KV cache exists, as vLLM profiles."""
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        with torch.inference_mode():
            self.model(input_ids=torch.zeros((1, num_tokens), dtype=torch.long, device=device), use_cache=False)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - baseline
        torch.cuda.empty_cache()
        return peak

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request (text needs the tokenizer given to patch); returns its id. A request that
        can never run finishes at once with an error, reported by the next step."""
        if self._closed:
            raise RuntimeError("this engine was closed by hybridkv.unpatch(model); call hybridkv.patch(model) again")
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use; give each request its own id")
        prompt_text, prompt_ids = self._tokenize(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to hybridkv.patch, or use stop_token_ids")
        block_size = self.config.block_size if self.config.enable_prefix_caching else None
        members = [Request(f"{request_id}#{i}", prompt_ids, params, block_size) for i in range(params.n)]
        if params.n > 1:
            for member in members:
                member.group = members
        tracked = _Tracked(request_id, prompt_text, members)
        device = self.runner.input_device
        for i in range(params.n):
            if self.tokenizer is not None:
                tracked.detokenizers.append(IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop))
            else:
                tracked.detokenizers.append(None)
            tracked.logprobs.append([] if params.logprobs is not None else None)
            seeded = params.seed is not None
            tracked.generators.append(torch.Generator(device).manual_seed(params.seed + i) if seeded else None)
        self._tracked[request_id] = tracked
        if not self.scheduler.add_request(members[0]):
            self._rejected.append(tracked)
        return request_id

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: pass tokenizer= to hybridkv.patch or give token ids")
            text, ids = prompt, list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}); check the tokenizer")
        media = self.media_token_ids.keys() & set(ids)
        if media:
            token = min(media)
            raise ValueError(
                f"the prompt holds token {token}, the model's {self.media_token_ids[token]}; hybridkv serves "
                "text prompts only (image, video and audio inputs are not supported yet): remove it"
            )
        return text, ids

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; every block it held, on the device or in swap space, is returned."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        for member in tracked.members:
            if not member.status.is_finished:
                self.scheduler.finish(member, RequestStatus.FINISHED_ABORTED)
        return self._output(tracked)

    def close(self) -> None:
        """Release the pool's blocks now: they link each other, so only the cycle collector would
        free them otherwise, in a pause of its own choosing (measured 250 ms for ~24k blocks)."""
        self.coordinator.pool.close()
        self._closed = True

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step. Returns the state of every request that produced tokens or
        finished in it (finished ones for the last time)."""
        start = time.perf_counter()
        touched: dict[str, _Tracked] = {t.request_id: t for t in self._rejected}
        self._rejected = []
        out = self.scheduler.schedule()
        self.schedule_seconds += time.perf_counter() - start
        try:
            sampled = self._execute(out)
        except Exception as exc:  # the model or a kernel failed: fail this step's requests, keep serving
            error = f"the step failed: {type(exc).__name__}: {exc}"
            for request, _ in out.scheduled:
                owner = self._owner(request)
                touched.setdefault(owner.request_id, owner)
                for member in owner.members:
                    if not member.status.is_finished:
                        self.scheduler.finish(member, RequestStatus.FINISHED_ERROR, error)
            sampled = {}
            out.scheduled = []
        update_start = time.perf_counter()
        for request in self.scheduler.update(out, sampled, self.eos_token_ids):
            owner = self._owner(request)
            touched.setdefault(owner.request_id, owner)
        now = time.monotonic()
        for request, _ in out.scheduled:
            owner = self._owner(request)
            touched.setdefault(owner.request_id, owner)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            index = owner.members.index(request)
            if owner.metrics.first_token_time is None:
                owner.metrics.first_token_time = now
            detokenizer = owner.detokenizers[index]
            if detokenizer is not None and detokenizer.add_token(token):
                request.stop_reason = detokenizer.stop_reason
                if request.status.is_finished:
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        for tracked in touched.values():
            if tracked.finished:
                tracked.metrics.finished_time = now
        end = time.perf_counter()
        self.update_seconds += end - update_start
        self.step_seconds += end - start
        unclaimed, self._unclaimed = self._unclaimed, []
        return unclaimed + [self._output(t) for t in touched.values()]

    def _execute(self, out: SchedulerOutput) -> dict[str, int]:
        self.runner.swap(out.swap_out, out.swap_in)
        if not out.scheduled:
            return {}
        rows, sampling = [], []
        offset = 0
        for request, num_new in out.scheduled:
            offset += num_new
            if request.num_computed_tokens + num_new == request.num_tokens:
                rows.append(offset - 1)
                sampling.append(request)
        logits = self.runner.execute(out.scheduled, self.coordinator, rows)
        self.num_steps += 1
        if not sampling:
            return {}
        sampling_rows = []
        for request in sampling:
            owner = self._owner(request)
            index = owner.members.index(request)
            sampling_rows.append(
                SamplingRow(request.params, owner.generators[index], request.token_ids, request.num_prompt_tokens)
            )
        tokens, logprobs = sample(logits, sampling_rows)
        for request, token_logprobs in zip(sampling, logprobs, strict=True):
            owner = self._owner(request)
            record = owner.logprobs[owner.members.index(request)]
            if record is not None and token_logprobs is not None:
                record.append(token_logprobs)
        self.num_generated_tokens += len(tokens)
        return {request.request_id: token for request, token in zip(sampling, tokens, strict=True)}

    def _owner(self, request: Request) -> _Tracked:
        return self._tracked[request.request_id.rpartition("#")[0]]

    def _output(self, tracked: _Tracked) -> RequestOutput:
        finished = tracked.finished
        if finished:
            self._tracked.pop(tracked.request_id, None)
        completions = []
        for index, member in enumerate(tracked.members):
            detokenizer = tracked.detokenizers[index]
            if detokenizer is not None and member.status.is_finished:
                detokenizer.flush()
            completions.append(
                CompletionOutput(
                    index=index,
                    text=detokenizer.text if detokenizer is not None else "",
                    token_ids=list(member.output_token_ids),
                    finish_reason=member.status.value if member.status.is_finished else None,
                    stop_reason=member.stop_reason,
                    logprobs=tracked.logprobs[index],
                )
            )
        tracked.metrics.num_cached_tokens = tracked.members[0].num_cached_tokens
        errors = [m.error for m in tracked.members if m.error]
        return RequestOutput(
            request_id=tracked.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=tracked.members[0].token_ids[: tracked.members[0].num_prompt_tokens],
            outputs=completions,
            finished=finished,
            metrics=tracked.metrics,
            error=errors[0] if errors else None,
        )

    # ---- convenience loops --------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to completion; outputs come back in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; give one or one each")
        ids = [self.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        progress = _progress(len(ids), use_tqdm)
        while len(done) < len(ids):
            for output in self._step_claiming(wanted):
                if output.finished:
                    done[output.request_id] = output
                    progress.update(1)
        progress.close()
        return [done[request_id] for request_id in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield each sample's new tokens and text as the engine produces them, until the request ends.
        Other queued requests keep running meanwhile; their results wait for the next step() call."""
        request_id = self.add_request(prompt, params)
        tracked = self._tracked[request_id]
        while True:
            mine = [o for o in self._step_claiming({request_id}) if o.request_id == request_id]
            for output in mine:
                for index, completion in enumerate(output.outputs):
                    new_tokens = completion.token_ids[tracked.streamed[index] :]
                    tracked.streamed[index] = len(completion.token_ids)
                    detokenizer = tracked.detokenizers[index]
                    text = detokenizer.stream_delta(completion.finished) if detokenizer is not None else ""
                    if new_tokens or text or completion.finished:
                        yield StreamDelta(index, new_tokens, text, completion.finish_reason)
                if output.finished:
                    return

    def _step_claiming(self, wanted: set[str]) -> list[RequestOutput]:
        """One step; finished outputs of requests not in `wanted` are kept for the caller of step()."""
        outputs = self.step()
        mine = [o for o in outputs if o.request_id in wanted]
        self._unclaimed.extend(o for o in outputs if o.request_id not in wanted and o.finished)
        return mine

    # ---- stats --------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """KV usage, prefix-cache use, preemptions and throughput since the engine was built."""
        kv = self.coordinator.stats()
        return {
            "num_blocks": kv.num_blocks,
            "block_size": self.config.block_size,
            "blocks_in_use": kv.blocks_in_use,
            "blocks_in_use_per_group": kv.blocks_in_use_per_group,
            "kv_cache_bytes": self.runner.kv_cache_bytes,
            "kv_bytes_in_use": kv.blocks_in_use * self.bytes_per_block,
            "num_groups": len(self.kv_config.groups),
            "group_size": kv.group_size,
            # Tokens per block in each group: a kind of fewer K/V bytes per token gets larger blocks
            # (hybridkv/grouping.py); prefix-cache hits are multiples of every one.
            "group_block_sizes": kv.group_block_sizes,
            "padding_layers": kv.padding_layers,
            # Share of the pages' bytes no layer writes (padding slots and page tails).
            "padding_fraction": kv.padding_fraction,
            # K and V bytes a token costs across the layers that hold pages; KV-sharing layers hold none.
            "kv_bytes_per_token": self.kv_config.kv_bytes_per_token,
            "shared_kv_layers": self.kv_config.shared_layers,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "prefix_cache_hit_rate": kv.prefix_cache_hit_rate,
            "num_evictions": kv.num_evictions,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swaps": self.scheduler.num_swaps,
            "num_running": len(self.scheduler.running),
            "max_num_running": self.scheduler.max_num_running,
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "tokens_per_second": self.num_generated_tokens / self.step_seconds if self.step_seconds else 0.0,
            "step_seconds": self.step_seconds,
            "forward_seconds": self.runner.forward_seconds,
            # Host work around the forward: scheduling, inputs and metadata, sampling, update.
            "overhead_seconds": self.step_seconds - self.runner.forward_seconds,
            "schedule_seconds": self.schedule_seconds,
            "prepare_seconds": self.runner.prepare_seconds,
            "update_seconds": self.update_seconds,
        }


def _blocks_for_requests(kv_config: KVCacheConfig, config: EngineConfig, max_model_len: int, count: int) -> int:
    """The null block plus `count` requests at max_model_len, prefilled in chunks of the token budget."""
    chunk = min(max_model_len, config.max_num_batched_tokens)
    return 1 + count * blocks_for_request(kv_config, max_model_len, chunk)


def _kv_layout(model: torch.nn.Module, config: EngineConfig) -> tuple[torch.dtype, ModelLayout, KVCacheConfig, int]:
    """The KV dtype, the model's attention layout (measured by a probe forward), its KV cache groups and
    max_model_len that `config` gives for `model`."""
    kv_dtype = config.kv_cache_dtype or next(model.parameters()).dtype
    layout = inspect_model(model, kv_dtype)
    kv_config = group_layers(layout.specs, config.block_size)
    max_model_len = config.max_model_len or model.config.get_text_config().max_position_embeddings
    limit = layout.max_exact_tokens
    if limit is not None and max_model_len > limit:
        if config.max_model_len:
            raise ValueError(
                f"max_model_len={max_model_len} is beyond what hybridkv serves exactly for this "
                f"{type(model).__name__}: {layout.limit_reason}. Pass max_model_len <= {limit}"
            )
        warnings.warn(
            f"hybridkv serves this {type(model).__name__} up to {limit} tokens ({layout.limit_reason}); "
            f"max_model_len is {limit}, not max_position_embeddings={max_model_len}",
            stacklevel=3,
        )
        max_model_len = limit
    if limit is not None and config.max_num_batched_tokens > limit:
        # The model counts a step's rows as positions there, so the rows must stay below the limit too.
        raise ValueError(
            f"max_num_batched_tokens={config.max_num_batched_tokens} is beyond what hybridkv serves exactly for "
            f"this {type(model).__name__}: {layout.limit_reason}, and a step's rows count as positions there. "
            f"Pass max_num_batched_tokens <= {limit}"
        )
    return kv_dtype, layout, kv_config, max_model_len


def min_num_blocks(model: torch.nn.Module, **config: Any) -> int:
    """The fewest KV blocks `hybridkv.patch(model, **config)` accepts: one request at max_model_len."""
    engine_config = EngineConfig(**config)
    _, _, kv_config, max_model_len = _kv_layout(model, engine_config)
    return _blocks_for_requests(kv_config, engine_config, max_model_len, 1)


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    from tqdm.auto import tqdm  # only when asked: in Jupyter without ipywidgets tqdm.auto warns on import

    return tqdm(total=total, desc="hybridkv", unit="req")


def _media_token_ids(config: Any) -> dict[int, str]:
    """The placeholder ids a multimodal config reserves for image, video and audio inputs, each with
    the config field that names it."""
    found = {}
    for kind in ("image", "video", "audio"):
        for field in (f"{kind}_token_id", f"{kind}_token_index"):
            token = getattr(config, field, None)
            if isinstance(token, int):
                found[token] = f"{kind} placeholder (config.{field})"
    return found


def _eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(eos)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
