"""`LLMEngine.stats()`: one flat dict of the engine's counters, for people and dashboards."""

from __future__ import annotations

from typing import Any

from hybridkv.engine.async_steps import AsyncSteps
from hybridkv.engine.core import EngineCore
from hybridkv.engine.output_processor import OutputProcessor
from hybridkv.engine.speculation import speculation_stats
from hybridkv.execution.model_runner import ModelRunner
from hybridkv.execution.multimodal import ImageEncoder
from hybridkv.kernels import cpu_decode
from hybridkv.sampling.structured_outputs import GrammarCompiler


def engine_stats(
    core: EngineCore,
    grammars: GrammarCompiler,
    images: ImageEncoder | None,
    async_steps: AsyncSteps | None,
    step_seconds: float,
    update_seconds: float,
    outputs: OutputProcessor,
) -> dict[str, Any]:
    """KV usage, prefix-cache use, preemptions and throughput since the engine was built: the core's counters and
    its front's (`grammars`, `images`, `async_steps`, the seconds of its steps and of their updates, and the prompt
    tokens and finished samples its `outputs` counted)."""
    coordinator, scheduler, runner = core.coordinator, core.scheduler, core.runner
    kv = coordinator.stats()
    checkpoints = coordinator.state_checkpoints
    swap_states = scheduler.swap_states
    state_bytes = sum(spec.state_bytes for spec in runner.states)
    if async_steps is not None:
        update_seconds += async_steps.update_seconds
    return {
        "num_blocks": kv.num_blocks,
        "block_size": core.config.block_size,
        "blocks_in_use": kv.blocks_in_use,
        "blocks_in_use_per_group": kv.blocks_in_use_per_group,
        "kv_cache_bytes": runner.kv_cache_bytes,
        "kv_bytes_in_use": kv.blocks_in_use * core.bytes_per_block,
        "num_groups": len(core.kv_config.groups),
        "group_size": kv.group_size,
        # Tokens per block in each group: a kind of fewer K/V bytes per token gets larger blocks
        # (hybridkv/memory/grouping.py); prefix-cache hits are multiples of every one.
        "group_block_sizes": kv.group_block_sizes,
        "padding_layers": kv.padding_layers,
        # Share of the pages' bytes no layer writes (padding slots and page tails).
        "padding_fraction": kv.padding_fraction,
        # K and V bytes a token costs across the layers that hold pages; KV-sharing layers hold none.
        "kv_bytes_per_token": core.kv_config.kv_bytes_per_token,
        # Each dtype the pages hold, with its layers (fp8: per-layer scales, hybridkv/execution/kv_dtypes.py).
        "kv_cache_dtypes": core.layer_dtypes.names,
        # State layers (linear attention, SSM, conv): how many, the bytes one request's state takes in all of
        # them (whatever its length), the state pool's bytes (the requests' slots and the checkpoints), and the
        # checkpoints of prefix-cache hits: their interval in tokens, slots, how many are kept and their bytes.
        "state_layers": len(runner.states),
        "state_bytes_per_request": state_bytes,
        "state_pool_bytes": runner.state_pool.nbytes if runner.state_pool is not None else 0,
        "state_checkpoint_interval": checkpoints.interval if checkpoints is not None else 0,
        "state_checkpoints": checkpoints.num_slots if checkpoints is not None else 0,
        "state_checkpoints_kept": checkpoints.num_kept if checkpoints is not None else 0,
        "state_checkpoint_bytes": checkpoints.num_slots * state_bytes if checkpoints is not None else 0,
        # CPU state slots for swapped requests' states (preemption_mode="swap"; taken from swap_space).
        "state_swap_slots": swap_states.num_slots - 1 if swap_states is not None else 0,
        "shared_kv_layers": core.kv_config.shared_layers,
        "prefix_cache_queries": kv.prefix_cache_queries,
        "prefix_cache_hits": kv.prefix_cache_hits,
        "prefix_cache_hit_rate": kv.prefix_cache_hit_rate,
        "num_evictions": kv.num_evictions,
        # Where the prompt tokens found in the cache came from (hybridkv/memory/tiers.py): per tier ("device", and
        # with kv_offloading_size or prefix_cache_dir "host" and "disk"), the tokens it served and its blocks
        # stored, restored and evicted.
        "prefix_cache_tiers": {
            tier: {"hit_tokens": hits, **{k: v for k, v in kv.tiers.get(tier, {}).items() if k != "hit_tokens"}}
            for tier, hits in kv.hit_tokens_by_tier.items()
        },
        # Changes to the model's weights seen since patch (each makes every block computed before unreachable; an
        # adapter switch is not one: hybridkv/execution/model_watch.py), the checks for them and their seconds.
        "model_weight_changes": core.model_watch.generation,
        "model_checks": core.model_watch.num_checks,
        "model_check_seconds": core.model_watch.check_seconds,
        # Structured outputs: next-token grammar masks computed (a constrained row per step) and their
        # seconds (the mask, its unpacking and the logits' masking; hybridkv/sampling/structured_outputs.py).
        "structured_output_masks": grammars.counters.num_masks,
        "structured_output_mask_seconds": grammars.counters.seconds,
        # Images (hybridkv/execution/multimodal.py): through the vision tower, taken from the encoder cache instead,
        # and the bytes of embeddings the cache keeps (at most encoder_cache_bytes).
        # LoRA (enable_lora; hybridkv/execution/lora.py): max_loras, the adapter in each device slot, the adapters
        # read in host memory, adapters copied into a slot and read from their folders; None without LoRA.
        "lora": core.lora.stats() if core.lora is not None else None,
        "images_encoded": images.num_encoded if images is not None else 0,
        "image_cache_hits": images.num_cache_hits if images is not None else 0,
        "encoder_cache_bytes": images.cached_bytes if images is not None else 0,
        "num_preemptions": scheduler.num_preemptions,
        "num_swaps": scheduler.num_swaps,
        "num_running": len(scheduler.running),
        "max_num_running": scheduler.max_num_running,
        "num_waiting": len(scheduler.waiting),
        "num_swapped": len(scheduler.swapped),
        "num_steps": core.num_steps,
        "num_prompt_tokens": outputs.num_prompt_tokens,  # of the requests added
        "finished_samples": dict(outputs.finished_samples),  # by finish reason
        "num_generated_tokens": core.num_generated_tokens,
        # Tokens run through the model (prompts, recomputed tokens and one per decode step).
        "num_forward_tokens": core.num_forward_tokens,
        "tokens_per_second": core.num_generated_tokens / step_seconds if step_seconds else 0.0,
        "step_seconds": step_seconds,
        "forward_seconds": runner.forward_seconds,
        # Host work around the forward: scheduling, inputs and metadata, sampling, update.
        "overhead_seconds": step_seconds - runner.forward_seconds,
        "schedule_seconds": core.schedule_seconds,
        "prepare_seconds": runner.prepare_seconds,
        "update_seconds": update_seconds,
        # The torch threads the last step ran with (None: left to torch), and the CPU cores other
        # processes were measured using (hybridkv/execution/cpu_threads.py).
        "step_threads": core.step_threads.threads if core.step_threads.setting is not None else None,
        "others_busy_cores": core.step_threads.others_busy_cores,
        # Whether decode rows on the CPU take the C decode kernel (else the torch path's own loop); False for
        # an engine on another device, which never builds it.
        # How patch's end-to-end check compared the model's steps with its own forward
        # (hybridkv/execution/step_check.py): "fp32", "fp32 copy" (a 16-bit model) or "bfloat16/float16, gross
        # errors only" (too large for a copy).
        "step_check": core.step_check.mode,
        # Decode steps padded to these sizes (graph mode; empty: eager), those captured as CUDA graphs, why none
        # could be (None: none failed) (hybridkv/execution/graphs.py); whether the forward is compiled, why not when
        # compiling was wanted, and how its program was found ("traced", "disk", "memory") in how many seconds
        # (hybridkv/execution/compiled_forward.py).
        "decode_buckets": list(runner.limits.decode_buckets),
        "cuda_graphs": sorted(runner.graphs.graphs) if runner.graphs is not None else [],
        "cuda_graph_error": runner.graph_error,
        **compile_stats(runner),
        # Async scheduling (hybridkv/engine/async_steps.py): on or off, the steps planned before the one before
        # finished, the host's wait for sampled tokens.
        "async_scheduling": async_steps is not None,
        "num_overlapped_steps": async_steps.num_overlapped if async_steps is not None else 0,
        "token_wait_seconds": async_steps.wait_seconds if async_steps is not None else 0.0,
        "cpu_decode_kernel": all(device.type == "cpu" for device in runner.devices) and cpu_decode.available(),
        # Speculative decoding (hybridkv/engine/speculation.py): proposals checked, kept, and the time proposing.
        **speculation_stats(core.speculator, scheduler.stores_proposals),
    }


def compile_stats(runner: ModelRunner) -> dict[str, Any]:
    compiled = runner.compiled
    return {
        "compiled": compiled is not None,
        "compile_error": runner.compile_error,
        "compiled_from": compiled.origin if compiled is not None else None,
        "compile_trace_seconds": compiled.trace_seconds if compiled is not None else 0.0,
        "compile_seconds": compiled.compile_seconds if compiled is not None else 0.0,
        "compile_load_seconds": compiled.load_seconds if compiled is not None else 0.0,
    }
