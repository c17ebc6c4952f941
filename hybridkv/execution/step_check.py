"""The end-to-end check of `patch`: hybridkv's own step machinery against the model's own forward.

The probe (hybridkv/patches/inspection.py) checks each attention layer; this check catches whatever it cannot
see: a model that derives positions from its cache or its input length instead of `position_ids` (the
learned position embeddings of BART-family decoders), attention that is not causal (PaliGemma's
prefix-LM), rows of one sequence that depend on the others of a step, or anything else. Two prompts run
through a `ModelRunner` over a small pool of their own, in three steps that cover what serving does:

    step 1   A[0:16]  B[0:11]      two first chunks; B's rows sit after A's in the flattened batch
    step 2   A[16:40] B[11]        a later chunk that reads A's pages, and a decode row
    step 3   A[40]    B[12]        a step of decode rows only

and every row's logits are compared with the model's own forward over each whole sequence (its
original attention implementation, no step). A row whose largest logit difference exceeds
`TOLERANCE` x its largest logit is wrong, and the model is refused with the rows that differed and
what that usually means.

The comparison is in fp32: a 16-bit model is checked on an fp32 copy where one fits (half of the
device's free memory, one device, no offload hooks, no tensor parallel; buffers a module derives from its config,
derived again in fp32), since 16-bit rounding, and the
expert choices it flips in MoE models, moves tiny models' logits by up to 0.72 of their scale (mixtral
on the zoo in bf16). A model too large for a copy is checked in its own dtype for gross errors only: a
step of it fails when the median of its rows' differences exceeds `GROSS`. Measured in bf16 on the zoo,
that median is at most 0.20 for every served model (mixtral again) and 0.26-1.22 for the nine types that
gave wrong tokens; `GROSS` = 0.5 catches seven of the nine (not bigbird_pegasus, 0.26, nor plbart, 0.30),
and a served model stays well clear of it. Every model type is checked in fp32 by the zoo and by
`benchmarks/causal_lm_sweep.py`. The verdict is kept per model and weights (`_verdicts`), so patching
the same model again costs nothing.
"""

from __future__ import annotations

import copy
import itertools
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache

from hybridkv.execution.kv_dtypes import resolve_layer_dtypes
from hybridkv.execution.latent_layers import cache_argument
from hybridkv.execution.model_runner import ModelRunner, RunnerLimits
from hybridkv.execution.sizing import blocks_for_requests
from hybridkv.memory.coordinator import KVCacheCoordinator
from hybridkv.memory.grouping import group_layers
from hybridkv.patches.devices import input_device
from hybridkv.patches.inspection import ModelLayout
from hybridkv.patches.layer_kinds import text_config
from hybridkv.patches.probe import attention_installed
from hybridkv.scheduling.output import ScheduledRequest, SchedulerOutput
from hybridkv.scheduling.request import Request
from hybridkv.scheduling.sampling_params import SamplingParams

# Largest |logit difference| / largest |logit| of a row: fp32 rounding gives <= 1e-5 on the zoo, the
# wrong-token types >= 0.2.
TOLERANCE = 1e-3
# Median over a segment's rows of the same ratio, for a 16-bit model checked in its own dtype.
GROSS = 0.5
# (tokens of A, tokens of B) computed by each step.
STEPS = ((16, 11), (24, 1), (1, 1))
BLOCK_SIZE = 8


@dataclass(frozen=True)
class Segment:
    """The rows one sequence computed in one step, and how far they were from the model's own."""

    sequence: str
    first_position: int
    num_rows: int
    first_row: int  # in the step's flattened batch
    step: int
    worst: float  # largest per-row relative difference
    median: float


@dataclass(frozen=True)
class StepCheck:
    """The check's result: each segment, whether it compared in fp32 (else in the model's 16-bit dtype, for
    gross errors only), and how (`mode`, for stats)."""

    segments: tuple[Segment, ...]
    fp32: bool
    mode: str
    has_states: bool = False

    @property
    def failed(self) -> list[Segment]:
        if self.fp32:
            return [s for s in self.segments if s.worst > TOLERANCE]
        return [s for s in self.segments if s.median > GROSS]


# model -> (fingerprint of its weights, its check): patching a model again reuses the check.
_verdicts: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, StepCheck]] = weakref.WeakKeyDictionary()


def check_step_exactness(model: torch.nn.Module, layout: ModelLayout) -> StepCheck:
    """Run the check (or reuse its verdict for the same weights) and raise a ValueError naming the rows that
    differed and the likely cause when hybridkv's step does not compute what the model computes."""
    fingerprint = _fingerprint(model)
    kept = _verdicts.get(model)
    if kept is not None and kept[0] == fingerprint:
        result = kept[1]
    else:
        result = _run_check(model, layout)
        _verdicts[model] = (fingerprint, result)
    if result.failed:
        raise ValueError(_refusal(model, result))
    return result


def _fingerprint(model: torch.nn.Module) -> tuple:
    """The weights' identity: where each lives and how often it was changed in place (inference tensors, e.g.
    accelerate's offloaded weights, keep no count and cannot be changed in place)."""
    return tuple((p.data_ptr(), 0 if p.is_inference() else p._version, p.dtype, p.device) for p in model.parameters())


def _run_check(model: torch.nn.Module, layout: ModelLayout) -> StepCheck:
    clone = _fp32_copy(model)
    clone_made = clone is not None
    try:
        if clone is not None:
            layout = _states_in_fp32(layout, next(model.parameters()).dtype)
        segments = tuple(_segments(model if clone is None else clone, layout))
    finally:
        if clone is not None:
            device = next(clone.parameters()).device
            del clone
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the pool is sized by what the device has free
    dtype = next(model.parameters()).dtype
    has_states = bool(layout.states)
    if clone_made:
        return StepCheck(segments, True, "fp32 copy", has_states)
    if dtype == torch.float32:
        return StepCheck(segments, True, "fp32", has_states)
    return StepCheck(segments, False, f"{str(dtype).removeprefix('torch.')}, gross errors only", has_states)


def _states_in_fp32(layout: ModelLayout, model_dtype: torch.dtype) -> ModelLayout:
    """The layout of the model's fp32 copy: the state the model keeps in its own dtype (conv states) is fp32
    there, as the copy's own forward keeps it; a state kept in 16 bits would round between chunks."""

    def fp32(parts: tuple) -> tuple:
        return tuple((shape, torch.float32 if dtype == model_dtype else dtype) for shape, dtype in parts)

    states = [replace(spec, conv=fp32(spec.conv), recurrent=fp32(spec.recurrent)) for spec in layout.states]
    return replace(layout, states=states)


def _fp32_copy(model: torch.nn.Module) -> torch.nn.Module | None:
    """An fp32 copy of a 16-bit model, where one fits; None for an fp32 model or where none fits."""
    parameters = list(model.parameters())
    devices = {p.device for p in parameters}
    copyable = (
        parameters[0].dtype != torch.float32
        and len(devices) == 1
        and not any(hasattr(m, "_hf_hook") for m in model.modules())
        and (getattr(model, "_tp_size", None) or 1) == 1
    )
    # The copy's 16-bit weights and then their fp32 version, within half of what the device has free.
    copy_bytes = sum(p.numel() * (4 + p.element_size()) for p in parameters)
    if not copyable or copy_bytes > _free_bytes(devices.pop()) // 2:
        return None
    clone = copy.deepcopy(model).float()
    _derive_buffers_in_fp32(clone)
    return clone


def _derive_buffers_in_fp32(clone: torch.nn.Module) -> None:
    """Buffers a module derives from its config with its own methods, derived again in fp32, as the model loaded in
    fp32 has them: MiniMax's lightning attention's decay factors (`get_slope_rate`, `decay_factors`). Cast from 16
    bits instead, its prompt form (blocks) and decode form (token by token) disagree by a relative 4e-3 in one layer,
    rounding the check could not tell from a wrong continuation."""
    with torch.no_grad():
        for module in clone.modules():
            if not all(callable(getattr(module, name, None)) for name in ("get_slope_rate", "decay_factors")):
                continue
            slope_rate = module.get_slope_rate(device=module.slope_rate.device)
            derived = (slope_rate, *module.decay_factors(slope_rate))
            for name, value in zip(("slope_rate", "query_decay", "key_decay", "diagonal_decay"), derived, strict=True):
                getattr(module, name).copy_(value)


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def _prompts(vocab_size: int) -> dict[str, list[int]]:
    """Two prompts of ordinary ids from the middle of the vocabulary (special and multimodal ids sit at its
    ends), long enough for every step of `STEPS`."""
    length_a, length_b = (sum(chunks) for chunks in zip(*STEPS, strict=True))
    return {
        "A": [(vocab_size // 2 + 7 * i) % vocab_size for i in range(length_a)],
        "B": [(vocab_size // 3 + 13 * i) % vocab_size for i in range(length_b)],
    }


def _segments(model: torch.nn.Module, layout: ModelLayout) -> Iterator[Segment]:
    """Run `STEPS` through a runner of the model's own dtype pages, then its own forward, and compare."""
    dtype = next(model.parameters()).dtype
    specs, layer_dtypes = resolve_layer_dtypes(None, layout.specs, dtype, layout.kv_amax)
    kv_config = group_layers(specs, BLOCK_SIZE)
    prompts = _prompts(text_config(model.config).vocab_size)
    num_blocks = blocks_for_requests(kv_config, max(map(len, prompts.values())), len(prompts))
    num_state_slots = len(prompts) + 1 if layout.states else 0
    coordinator = KVCacheCoordinator(kv_config, num_blocks, enable_caching=False, num_state_slots=num_state_slots)
    limits = RunnerLimits(len(prompts), max(map(sum, STEPS)), max(map(len, prompts.values())))
    runner = ModelRunner(
        model,
        kv_config,
        layout.module_names,
        num_blocks,
        layer_dtypes,
        limits,
        states=layout.states,
        num_state_slots=num_state_slots,
        latent=layout.latent,
    )
    try:
        yield from _compare(model, prompts, coordinator, runner)
    finally:
        runner.close()
        coordinator.close()  # its blocks link each other: freed now, not by the cycle collector


def _compare(
    model: torch.nn.Module, prompts: dict[str, list[int]], coordinator: KVCacheCoordinator, runner: ModelRunner
) -> Iterator[Segment]:
    requests = []
    prompt_lengths: dict[str, int] = {}
    for (name, tokens), chunks in zip(prompts.items(), zip(*STEPS, strict=True), strict=True):
        # A sequence's one-token chunks after its first step are decode rows: tokens it generated, after its prompt
        # (a prompt's one-token chunk is computed as its prompt forward does, not as a decode).
        prompt_lengths[name] = chunks[0] + sum(itertools.takewhile(lambda num_new: num_new > 1, chunks[1:]))
        request = Request(name, tokens[: prompt_lengths[name]], SamplingParams(), None)
        request.append_token_ids(tokens[prompt_lengths[name] :])
        requests.append(request)
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in prompts}
    found: list[tuple[str, int, int, int, int]] = []
    with attention_installed(model):
        for step, chunks in enumerate(STEPS, start=1):
            for request, num_new in zip(requests, chunks, strict=True):
                if not coordinator.allocate_slots(request, num_new):
                    raise RuntimeError("the step check's pool is too small")  # sized for exactly these steps
            scheduled = [ScheduledRequest(r, n, ()) for r, n in zip(requests, chunks, strict=True)]
            plan = SchedulerOutput(scheduled, table_updates=coordinator.take_table_updates())
            logits = runner.execute(plan, logits_rows=range(sum(chunks)))
            first_row = 0
            for request, num_new in zip(requests, chunks, strict=True):
                rows[request.request_id].append(logits[first_row : first_row + num_new])
                found.append((request.request_id, request.num_computed_tokens, num_new, first_row, step))
                request.num_computed_tokens += num_new
                coordinator.update_computed(request)
                first_row += num_new
        device = input_device(model)
        with torch.inference_mode():
            # Positions from 0, as generate and every step give them (a model may number them otherwise when
            # given none: RoBERTa-style embeddings from its pad id).
            if runner.states:  # decode rows as generate computes them: a state layer's decode form may differ
                expected = {
                    name: _generated_logits(model, tokens, prompt_lengths[name], device)
                    for name, tokens in prompts.items()
                }
            else:
                expected = {
                    name: model(
                        input_ids=torch.tensor([tokens], device=device),
                        position_ids=torch.arange(len(tokens), device=device)[None],
                    )
                    .logits[0]
                    .float()
                    for name, tokens in prompts.items()
                }
    for name, first_position, num_rows, first_row, step in found:
        reference = expected[name][first_position : first_position + num_rows]
        got = rows[name][step - 1].to(reference.device)
        differences = (got - reference).abs().amax(-1) / reference.abs().amax(-1).clamp_min(1e-6)
        yield Segment(
            name,
            first_position,
            num_rows,
            first_row,
            step,
            differences.max().item(),
            differences.median().item(),
        )


def _generated_logits(
    model: torch.nn.Module, tokens: list[int], prompt_length: int, device: torch.device
) -> torch.Tensor:
    """Every position's logits as generate computes them: the prompt in one forward with the model's own cache, then
    each later token alone. A state layer's decode form is other code than its prompt form, and may compute other
    numbers (Zamba2's skips the time step's floor), so a decode row is judged against the decode form."""
    ids = torch.tensor([tokens], device=device)
    positions = torch.arange(len(tokens), device=device)[None]
    name = cache_argument(model)
    prompt = slice(0, prompt_length)
    output = model(input_ids=ids[:, prompt], position_ids=positions[:, prompt], use_cache=True)
    cache = getattr(output, name, None)
    if cache is None:  # a model that fills the cache it is given and returns none (RecurrentGemma)
        cache = DynamicCache(config=text_config(model.config))
        output = model(input_ids=ids[:, prompt], position_ids=positions[:, prompt], use_cache=True, **{name: cache})
    rows = [output.logits[0].float()]
    for position in range(prompt_length, len(tokens)):
        step = slice(position, position + 1)
        output = model(input_ids=ids[:, step], position_ids=positions[:, step], use_cache=True, **{name: cache})
        rows.append(output.logits[0, -1:].float())
    return torch.cat(rows)


def _refusal(model: torch.nn.Module, result: StepCheck) -> str:
    """The error for a model whose step logits differ from its own forward: which rows, and what that means."""
    failed = result.failed
    lines = [
        f"  step {s.step}, prompt {s.sequence} {_span('position', s.first_position, s.num_rows)} "
        f"({_span('row', s.first_row, s.num_rows)} of the step): logits differ by up to {s.worst:.2g} of their "
        "largest value"
        for s in failed
    ]
    starts_ok = not any(s.sequence == "A" and s.step == 1 for s in failed)
    noncausal = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if getattr(m, "is_causal", True) is False and hasattr(m, "layer_idx")
        }
    )
    if starts_ok and result.has_states:
        cause = (
            "the first chunk of each prompt matches and the rows that continue a prompt from its carried state do "
            "not: a state layer of the model does not continue from the state it is given (a scan that ignores "
            "its initial state over several tokens), so a prompt cannot be computed in chunks"
        )
    elif starts_ok:
        cause = (
            "the first chunk of the prompt that starts the step's batch matches, later rows do not: the model reads "
            "positions from its own cache or from where a token sits in its input (e.g. learned position embeddings "
            "indexed by the cache's length) rather than from position_ids, which a batch of several sequences at "
            "other positions cannot give it"
        )
    elif noncausal:
        cause = (
            f"its attention modules ({', '.join(noncausal)}) have is_causal=False: a prompt token attends to later "
            "prompt tokens (a prefix-LM), which a step that computes a prompt in chunks over causal pages cannot "
            "reproduce"
        )
    else:
        cause = "its forward does something the attention interface does not show (a mask or positions of its own)"
    mode = "" if result.fp32 else " (checked in the model's own dtype: it is too large for an fp32 copy)"
    return (
        f"hybridkv cannot serve this {type(model).__name__} exactly: its paged steps (two prompts in chunks, then "
        f"decode rows) give other logits than the model's own forward{mode}:\n"
        + "\n".join(lines)
        + f"\nLikely cause: {cause}. Served anyway, it would generate other tokens than model.generate, silently."
    )


def _span(name: str, first: int, count: int) -> str:
    return f"{name} {first}" if count == 1 else f"{name}s {first}-{first + count - 1}"
