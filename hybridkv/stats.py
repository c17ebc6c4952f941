"""`LLMEngine.stats()`: one flat dict of the engine's counters, for people and dashboards."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridkv.kernels import cpu_decode

if TYPE_CHECKING:
    from hybridkv.engine import LLMEngine


def engine_stats(engine: LLMEngine) -> dict[str, Any]:
    """KV usage, prefix-cache use, preemptions and throughput since the engine was built."""
    kv = engine.coordinator.stats()
    checkpoints = engine.coordinator.state_checkpoints
    swap_states = engine.scheduler.swap_states
    state_bytes = sum(spec.state_bytes for spec in engine.runner.states)
    return {
        "num_blocks": kv.num_blocks,
        "block_size": engine.config.block_size,
        "blocks_in_use": kv.blocks_in_use,
        "blocks_in_use_per_group": kv.blocks_in_use_per_group,
        "kv_cache_bytes": engine.runner.kv_cache_bytes,
        "kv_bytes_in_use": kv.blocks_in_use * engine.bytes_per_block,
        "num_groups": len(engine.kv_config.groups),
        "group_size": kv.group_size,
        # Tokens per block in each group: a kind of fewer K/V bytes per token gets larger blocks
        # (hybridkv/grouping.py); prefix-cache hits are multiples of every one.
        "group_block_sizes": kv.group_block_sizes,
        "padding_layers": kv.padding_layers,
        # Share of the pages' bytes no layer writes (padding slots and page tails).
        "padding_fraction": kv.padding_fraction,
        # K and V bytes a token costs across the layers that hold pages; KV-sharing layers hold none.
        "kv_bytes_per_token": engine.kv_config.kv_bytes_per_token,
        # Each dtype the pages hold, with its layers (fp8: per-layer scales, hybridkv/kv_dtypes.py).
        "kv_cache_dtypes": engine.layer_dtypes.names,
        # State layers (linear attention, SSM, conv): how many, the bytes one request's state takes in all of
        # them (whatever its length), the state pool's bytes (the requests' slots and the checkpoints), and the
        # checkpoints of prefix-cache hits: their interval in tokens, slots, how many are kept and their bytes.
        "state_layers": len(engine.runner.states),
        "state_bytes_per_request": state_bytes,
        "state_pool_bytes": engine.runner.state_pool.nbytes if engine.runner.state_pool is not None else 0,
        "state_checkpoint_interval": checkpoints.interval if checkpoints is not None else 0,
        "state_checkpoints": checkpoints.num_slots if checkpoints is not None else 0,
        "state_checkpoints_kept": checkpoints.num_kept if checkpoints is not None else 0,
        "state_checkpoint_bytes": checkpoints.num_slots * state_bytes if checkpoints is not None else 0,
        # CPU state slots for swapped requests' states (preemption_mode="swap"; taken from swap_space).
        "state_swap_slots": swap_states.num_slots - 1 if swap_states is not None else 0,
        "shared_kv_layers": engine.kv_config.shared_layers,
        "prefix_cache_queries": kv.prefix_cache_queries,
        "prefix_cache_hits": kv.prefix_cache_hits,
        "prefix_cache_hit_rate": kv.prefix_cache_hit_rate,
        "num_evictions": kv.num_evictions,
        # Changes to the model's weights seen since patch (each makes every block computed before unreachable; an
        # adapter switch is not one: hybridkv/model_watch.py), the checks for them and their seconds.
        "model_weight_changes": engine.model_watch.generation,
        "model_checks": engine.model_watch.num_checks,
        "model_check_seconds": engine.model_watch.check_seconds,
        # Structured outputs: next-token grammar masks computed (a constrained row per step) and their
        # seconds (the mask, its unpacking and the logits' masking; hybridkv/structured_outputs.py).
        "structured_output_masks": engine.grammars.counters.num_masks,
        "structured_output_mask_seconds": engine.grammars.counters.seconds,
        # Images (hybridkv/multimodal.py): through the vision tower, taken from the encoder cache instead, and
        # the bytes of embeddings the cache keeps (at most encoder_cache_bytes).
        "images_encoded": engine.images.num_encoded if engine.images is not None else 0,
        "image_cache_hits": engine.images.num_cache_hits if engine.images is not None else 0,
        "encoder_cache_bytes": engine.images.cached_bytes if engine.images is not None else 0,
        "num_preemptions": engine.scheduler.num_preemptions,
        "num_swaps": engine.scheduler.num_swaps,
        "num_running": len(engine.scheduler.running),
        "max_num_running": engine.scheduler.max_num_running,
        "num_waiting": len(engine.scheduler.waiting),
        "num_swapped": len(engine.scheduler.swapped),
        "num_steps": engine.num_steps,
        "num_generated_tokens": engine.num_generated_tokens,
        # Tokens run through the model (prompts, recomputed tokens and one per decode step).
        "num_forward_tokens": engine.num_forward_tokens,
        "tokens_per_second": engine.num_generated_tokens / engine.step_seconds if engine.step_seconds else 0.0,
        "step_seconds": engine.step_seconds,
        "forward_seconds": engine.runner.forward_seconds,
        # Host work around the forward: scheduling, inputs and metadata, sampling, update.
        "overhead_seconds": engine.step_seconds - engine.runner.forward_seconds,
        "schedule_seconds": engine.schedule_seconds,
        "prepare_seconds": engine.runner.prepare_seconds,
        "update_seconds": engine.update_seconds,
        # The torch threads the last step ran with (None: left to torch), and the CPU cores other
        # processes were measured using (hybridkv/threads.py).
        "step_threads": engine.step_threads.threads if engine.step_threads.setting is not None else None,
        "others_busy_cores": engine.step_threads.others_busy_cores,
        # Whether decode rows on the CPU take the C decode kernel (else the torch path's own loop); False for
        # an engine on another device, which never builds it.
        # How patch's end-to-end check compared the model's steps with its own forward (hybridkv/step_check.py):
        # "fp32", "fp32 copy" (a 16-bit model) or "bfloat16/float16, gross errors only" (too large for a copy).
        "step_check": engine.step_check.mode,
        # Decode steps padded to these sizes (graph mode; empty: eager), those captured as CUDA graphs, why none
        # could be (None: none failed) (hybridkv/graphs.py); whether the forward is compiled, why not when
        # compiling was wanted, and how its program was found ("traced", "disk", "memory") in how many seconds
        # (hybridkv/compiled_forward.py).
        "decode_buckets": list(engine.runner.limits.decode_buckets),
        "cuda_graphs": sorted(engine.runner.graphs.graphs) if engine.runner.graphs is not None else [],
        "cuda_graph_error": engine.runner.graph_error,
        **compile_stats(engine.runner),
        # Async scheduling (hybridkv/async_steps.py): on or off, and the steps planned before the one before finished.
        "async_scheduling": engine.async_steps is not None,
        "num_overlapped_steps": engine.async_steps.num_overlapped if engine.async_steps is not None else 0,
        "token_wait_seconds": engine.async_steps.wait_seconds if engine.async_steps is not None else 0.0,
        "cpu_decode_kernel": all(device.type == "cpu" for device in engine.runner.devices) and cpu_decode.available(),
    }


def compile_stats(runner: Any) -> dict[str, Any]:
    compiled = runner.compiled
    return {
        "compiled": compiled is not None,
        "compile_error": runner.compile_error,
        "compiled_from": compiled.origin if compiled is not None else None,
        "compile_trace_seconds": compiled.trace_seconds if compiled is not None else 0.0,
        "compile_seconds": compiled.compile_seconds if compiled is not None else 0.0,
        "compile_load_seconds": compiled.load_seconds if compiled is not None else 0.0,
    }
