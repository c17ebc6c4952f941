"""The engine: the public API (`add_request`, `step`, `abort`, `generate`, `stream`, `stats`) and the
step loop: schedule -> swap copies -> one forward -> sample -> update -> outputs.

What comes before and after a step lives beside it: `inputs.py` (prompts into checked ids),
`output_processor.py` (text, logprobs, stop decisions, outputs), `sizing.py` (the pool's size).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hybridkv.config import EngineConfig
from hybridkv.coordinator import KVCacheCoordinator
from hybridkv.inputs import InputProcessor, Prompt, eos_token_ids
from hybridkv.model_runner import ModelRunner
from hybridkv.output_processor import OutputProcessor, RequestState
from hybridkv.outputs import RequestOutput, StreamDelta, TokenLogprobs
from hybridkv.request import Request, RequestStatus, SampleGroup
from hybridkv.sampler import sample
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from hybridkv.sizing import kv_layout, min_num_blocks, num_kv_blocks
from hybridkv.stopping import StopRules

__all__ = ["EngineConfig", "LLMEngine", "Prompt", "min_num_blocks"]


class LLMEngine:
    """A continuous-batching engine bound to one Hugging Face model (see `hybridkv.patch`)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        kv_dtype, layout, self.kv_config, self.max_model_len = kv_layout(model, config)
        self.bytes_per_block = self.kv_config.block_bytes
        num_blocks = num_kv_blocks(model, config, self.kv_config, self.max_model_len)
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
        self.inputs = InputProcessor(model, tokenizer)
        stop_rules = StopRules(eos_token_ids(model, tokenizer), self.max_model_len)
        self.outputs = OutputProcessor(tokenizer, stop_rules, self.runner.input_device)
        self._rejected: list[RequestState] = []
        self._unclaimed: list[RequestOutput] = []
        self._ids = itertools.count()
        self._closed = False
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.step_seconds = 0.0
        self.schedule_seconds = 0.0
        self.update_seconds = 0.0

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request (text needs the tokenizer given to patch); returns its id. A request that
        can never run finishes at once with an error, reported by the next step."""
        if self._closed:
            raise RuntimeError("this engine was closed by hybridkv.unpatch(model); call hybridkv.patch(model) again")
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.states:
            raise ValueError(f"request id {request_id!r} is already in use; give each request its own id")
        prompt_text, prompt_ids = self.inputs.tokenize(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to hybridkv.patch, or use stop_token_ids")
        block_size = self.config.block_size if self.config.enable_prefix_caching else None
        group = SampleGroup.of(request_id, prompt_ids, params, block_size)
        state = self.outputs.add(group, prompt_text)
        if not self.scheduler.add_request(group.leader):
            self._rejected.append(state)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; every block it held, on the device or in swap space, is returned."""
        state = self.outputs.states.get(request_id)
        if state is None:
            return None
        self.scheduler.finish_group(state.group, RequestStatus.FINISHED_ABORTED)
        return self.outputs.output(state)

    def close(self) -> None:
        """Release the pool's blocks now: they link each other, so only the cycle collector would
        free them otherwise, in a pause of its own choosing (measured 250 ms for ~24k blocks)."""
        self.coordinator.pool.close()
        self._closed = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.states)

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step. Returns the state of every request that produced tokens or
        finished in it (finished ones for the last time)."""
        start = time.perf_counter()
        touched = {state.group.request_id: state for state in self._rejected}
        self._rejected = []
        plan = self.scheduler.schedule()
        self.schedule_seconds += time.perf_counter() - start
        sampling = plan.sampling
        try:
            tokens, logprobs = self._execute(plan, sampling)
        except Exception as exc:  # the model or a kernel failed: fail this step's requests, keep serving
            error = f"the step failed: {type(exc).__name__}: {exc}"
            for scheduled in plan.scheduled:
                plan.failed.extend(
                    self.scheduler.finish_group(scheduled.request.group, RequestStatus.FINISHED_ERROR, error)
                )
            plan.scheduled, sampling, tokens, logprobs = [], [], [], []
        update_start = time.perf_counter()
        self.scheduler.update(plan, tokens)
        for request, status in self.outputs.process(sampling, tokens, logprobs):
            self.scheduler.finish(request, status)
        for request in itertools.chain((s.request for s in plan.scheduled), plan.failed):
            state = self.outputs.state_of(request)
            touched.setdefault(state.group.request_id, state)
        end = time.perf_counter()
        self.update_seconds += end - update_start
        self.step_seconds += end - start
        unclaimed, self._unclaimed = self._unclaimed, []
        return unclaimed + [self.outputs.output(state) for state in touched.values()]

    def _execute(
        self, plan: SchedulerOutput, sampling: list[Request]
    ) -> tuple[list[int], Sequence[TokenLogprobs | None]]:
        """Swap copies, the forward and sampling: the sampled tokens align with `sampling`."""
        self.runner.swap(plan.swap_out, plan.swap_in)
        if not plan.scheduled:
            return [], []
        logits = self.runner.execute(plan)
        self.num_steps += 1
        if not sampling:
            return [], []
        tokens, logprobs = sample(logits, self.outputs.sampling_rows(sampling))
        self.num_generated_tokens += len(tokens)
        return tokens, logprobs

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
        state = self.outputs.states[request_id]
        while True:
            if any(o.request_id == request_id for o in self._step_claiming({request_id})):
                yield from self.outputs.stream_deltas(state)
                if state.output.finished:
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
