"""The engine follows the model it serves: after anything that changes what the model computes (an optimizer
step of any implementation, `load_state_dict`, an edit under `no_grad` or through `.data`, a replaced tensor, a
PEFT adapter switched, disabled, merged or unmerged), generating the same prompts again equals transformers'
own `generate` with the model as it now is, and the prefix cache never serves K/V computed before the change.
When nothing changed, the prefix cache still hits; adapters take part in the key, so alternating two keeps both
adapters' hits.

Every update is checked for blindness: transformers' tokens must change with it, else the test proves nothing.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import hybridkv
from hybridkv.memory.integrity import check_coordinator
from hybridkv.scheduling.sampling_params import SamplingParams
from hybridkv.tiny import tiny_model

from model_zoo import slow_except
from tiny_models import FAMILIES, hf_greedy, new_request_id, prompts

MAX_NEW = 8
BLOCK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
# Two prompts that share five blocks: the second generation of the same prompts hits the prefix cache.
BATCH = prompts((13, 30), seed=3, shared_prefix=40)
HYBRID_AND_FULL = ("gemma3_text", "llama")
MODES = {
    "default": dict(max_model_len=128),
    "chunked": dict(max_model_len=128, max_num_batched_tokens=16),
    # Room for the longest request alone (`num_blocks` below): the other waits, and the full-attention model's
    # decodes preempt.
    "tiny_pool": dict(max_model_len=80, max_num_batched_tokens=32),
}


def settings_for(model, mode: str) -> dict:
    settings = dict(block_size=BLOCK, **MODES[mode])
    if mode == "tiny_pool":
        settings["num_blocks"] = hybridkv.min_num_blocks(model, **settings)
    return settings


def references(model, batch=BATCH):
    return [hf_greedy(model, prompt, MAX_NEW) for prompt in batch]


def tokens(outputs):
    return [output.outputs[0].token_ids for output in outputs]


def first_generation(patched, model, mode="default"):
    """Patch the model and generate the batch once (transformers' tokens); the engine and those references."""
    llm = patched(model, **settings_for(model, mode))
    before = references(model)
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == [t for t, _ in before]
    return llm, before


def generate_in_steps(llm, batch=BATCH):
    """`llm.generate(batch)` as a loop of steps: the outputs, and how many steps had requests waiting while others
    ran (a pool too small for all of them at once)."""
    ids = [llm.add_request(new_request_id(), prompt, GREEDY) for prompt in batch]
    done, num_waited = {}, 0
    while llm.has_unfinished_requests():
        for output in llm.step():
            done[output.request_id] = output
        num_waited += bool(llm.core.scheduler.waiting and llm.core.scheduler.running)
    return [done[i] for i in ids], num_waited


def assert_follows(llm, model, before, batch=BATCH, in_steps=False):
    """hybridkv's greedy tokens equal transformers' with the model as it is now, which differ from `before`'s."""
    expected = references(model, batch)
    assert [tokens for tokens, _ in expected] != [tokens for tokens, _ in before], "the update changes nothing: blind"
    if in_steps:
        outputs, num_waited = generate_in_steps(llm, batch)
        assert num_waited > 0
    else:
        outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert tokens(outputs) == [tokens for tokens, _ in expected]
    assert llm.stats()["blocks_in_use"] == 0
    return expected


def _loss_backward(model):
    model.train()
    ids = torch.tensor([BATCH[1]])
    model(input_ids=ids, labels=ids).loss.backward()
    model.eval()


def _optimizer_step(optimizer_class, **options):
    def update(model):
        optimizer = optimizer_class(model.parameters(), **options)
        _loss_backward(model)
        optimizer.step()
        optimizer.zero_grad()

    return update


def _each_weight(edit):
    """An update that edits every floating weight matrix (2-D parameter) with `edit(parameter, noise)`."""

    def update(model):
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for _, parameter in sorted(model.named_parameters()):
                if parameter.dim() == 2:
                    noise = torch.randn(parameter.shape, generator=generator) * parameter.std() * 0.5
                    edit(parameter, noise)

    return update


def _load_state_dict(model):
    generator = torch.Generator().manual_seed(11)
    state = {
        name: (tensor + torch.randn(tensor.shape, generator=generator) * tensor.std() * 0.5)
        if tensor.dim() == 2
        else tensor.clone()
        for name, tensor in model.state_dict().items()
    }
    model.load_state_dict(state)


def _replace_parameters(model):
    generator = torch.Generator().manual_seed(5)
    for module in list(model.modules()):
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter.dim() == 2:
                noise = torch.randn(parameter.shape, generator=generator) * parameter.std() * 0.5
                setattr(module, name, torch.nn.Parameter(parameter.detach() + noise))


def _edit_rotary_buffer(model):
    for name, buffer in model.named_buffers():
        if name.endswith("inv_freq"):
            buffer.mul_(3.0)


UPDATES = {
    "sgd": _optimizer_step(torch.optim.SGD, lr=2.0, foreach=False),
    "sgd_foreach": _optimizer_step(torch.optim.SGD, lr=2.0, foreach=True),
    "adam_foreach": _optimizer_step(torch.optim.Adam, lr=0.05, foreach=True),
    # transformers' Trainer's default optimizer: it moves no version counter.
    "adamw_fused": _optimizer_step(torch.optim.AdamW, lr=0.05, fused=True),
    "load_state_dict": _load_state_dict,
    "no_grad_edit": _each_weight(lambda p, noise: p.add_(noise)),
    "data_edit": _each_weight(lambda p, noise: p.data.add_(noise)),  # bypasses version counters
    "data_copy": _each_weight(lambda p, noise: p.data.copy_(p.data + noise)),
    "data_assigned": _each_weight(lambda p, noise: setattr(p, "data", p.data + noise)),
    "parameter_replaced": _replace_parameters,
    "buffer_edit": _edit_rotary_buffer,
}


@pytest.mark.parametrize("update", sorted(UPDATES))
@pytest.mark.parametrize("family", slow_except(HYBRID_AND_FULL))
def test_generate_follows_the_weights(family, update, patched):
    model = FAMILIES[family]()
    llm, before = first_generation(patched, model)
    UPDATES[update](model)
    assert_follows(llm, model, before)


@pytest.mark.parametrize("mode", ["chunked", "tiny_pool"])
@pytest.mark.parametrize("family", slow_except(HYBRID_AND_FULL))
def test_updates_in_turn_are_followed_with_chunks_and_tiny_pools(family, mode, patched):
    model = FAMILIES[family]()
    llm, before = first_generation(patched, model, mode)
    for update in sorted(UPDATES):
        UPDATES[update](model)
        before = assert_follows(llm, model, before, in_steps=mode == "tiny_pool")
    if mode == "tiny_pool" and family == "llama":
        assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("family", HYBRID_AND_FULL)
def test_nothing_changed_the_prefix_cache_still_hits(family, patched):
    model = FAMILIES[family]()
    llm = patched(model, **settings_for(model, "default"))
    expected = [t for t, _ in references(model)]
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == expected
    hits = llm.stats()["prefix_cache_hits"]
    model.train()  # a mode change (no dropout in these models) and a forward of the model's own change nothing
    model.eval()
    with torch.inference_mode():
        model(torch.tensor([BATCH[0]]))
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == expected
    assert llm.stats()["prefix_cache_hits"] - hits >= 2 * 40 // BLOCK * BLOCK


def test_a_state_layer_model_follows_the_weights(patched):
    """A state-layer hybrid's prefix hits restore state checkpoints, a cache of their own."""
    model = tiny_model("qwen3_5")
    llm, before = first_generation(patched, model)
    hits = llm.stats()["prefix_cache_hits"]
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == [t for t, _ in before]
    assert llm.stats()["prefix_cache_hits"] > hits
    UPDATES["adamw_fused"](model)
    assert_follows(llm, model, before)


# ---- adapters ---------------------------------------------------------------------------------------------


def lora_model(family):
    """A tiny model with two LoRA adapters, "sft" (active) and "dpo", whose weights are not zero."""
    model = FAMILIES[family]()
    targets = ["q_proj", "k_proj", "v_proj"]
    torch.manual_seed(3)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False), "sft")
    peft_model.add_adapter("dpo", LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    peft_model.set_adapter("sft")
    peft_model.eval()
    return peft_model


@pytest.mark.parametrize("family", HYBRID_AND_FULL)
def test_set_adapter_is_followed_and_alternating_adapters_keeps_both_hits(family, patched):
    model = lora_model(family)
    llm, under_sft = first_generation(patched, model)
    model.set_adapter("dpo")
    under_dpo = assert_follows(llm, model, under_sft)
    for adapter, expected in (("sft", under_sft), ("dpo", under_dpo), ("sft", under_sft)):
        model.set_adapter(adapter)
        hits = llm.stats()["prefix_cache_hits"]
        assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == [t for t, _ in expected]
        assert llm.stats()["prefix_cache_hits"] - hits >= 2 * 40 // BLOCK * BLOCK, adapter


@pytest.mark.parametrize("family", HYBRID_AND_FULL)
def test_disabled_adapters_are_followed(family, patched):
    model = lora_model(family)
    llm, under_sft = first_generation(patched, model)
    with model.disable_adapter():
        base = assert_follows(llm, model, under_sft)
    assert_follows(llm, model, base)


@pytest.mark.parametrize("family", HYBRID_AND_FULL)
def test_merged_and_unmerged_adapters_are_followed(family, patched):
    model = lora_model(family)
    llm, under_sft = first_generation(patched, model)
    model.set_adapter("dpo")
    model.merge_adapter()
    merged_dpo = assert_follows(llm, model, under_sft)
    model.unmerge_adapter()
    model.set_adapter("sft")
    assert_follows(llm, model, merged_dpo)


# ---- requests that live across a change ----------------------------------------------------------------------


def assert_admitted_under_the_new_weights(llm, model, before, old, new):
    """`old` ran to its end across a weight change; `new`, admitted after it with the same prompt, has the new model's
    greedy tokens and no prefix-cache hit; every block is back."""
    (expected,) = references(model, BATCH[:1])
    assert expected[0] != before[0][0]
    assert new.outputs[0].token_ids == expected[0]
    assert new.metrics.num_cached_tokens == 0
    assert len(old.outputs[0].token_ids) == MAX_NEW
    assert llm.stats()["blocks_in_use"] == 0


def test_a_request_admitted_after_a_change_never_reuses_blocks_computed_before(patched):
    """A request running when the weights change finishes with the K/V it has (vLLM's behaviour); one admitted
    after the change, with the same prompt, computes with the new weights and hits none of the old blocks."""
    model = FAMILIES["llama"]()
    llm = patched(model, **settings_for(model, "default"))
    before = references(model, BATCH[:1])
    old = llm.add_request(new_request_id(), BATCH[0], GREEDY)
    for _ in range(3):  # the prompt is computed and cached, and decoding has begun
        llm.step()
    UPDATES["no_grad_edit"](model)
    new = llm.add_request(new_request_id(), BATCH[0], GREEDY)
    done = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            done[output.request_id] = output
    assert_admitted_under_the_new_weights(llm, model, before, done[old], done[new])


def test_a_full_batch_checks_the_model_once_a_seat_frees(patched):
    """While max_num_seqs sequences run, a step with requests waiting does not check the model (it can admit none);
    the step after a seat frees checks it before admitting: a request that waited through a weight change computes
    with the new weights and hits none of the blocks computed before."""
    model = FAMILIES["llama"]()
    llm = patched(model, max_num_seqs=1, **settings_for(model, "default"))
    before = references(model, BATCH[:1])
    old = llm.add_request(new_request_id(), BATCH[0], GREEDY)
    llm.step()  # admits it (the model is checked first) and computes its prompt
    new = llm.add_request(new_request_id(), BATCH[0], GREEDY)
    watch = llm.core.model_watch
    checks = watch.num_checks
    UPDATES["no_grad_edit"](model)
    done = {}
    while old not in done:
        assert watch.num_checks == checks and llm.core.scheduler.waiting
        for output in llm.step():
            if output.finished:
                done[output.request_id] = output
    while llm.has_unfinished_requests():
        for output in llm.step():
            done[output.request_id] = output
    assert watch.num_checks == checks + 1
    assert_admitted_under_the_new_weights(llm, model, before, done[old], done[new])


def test_a_request_preempted_by_recompute_recomputes_under_the_new_weights(patched):
    """A request preempted before the change, admitted again after it, recomputes its prompt and outputs with the
    new weights: its next tokens are transformers' greedy continuation of them under the new model."""
    model = FAMILIES["llama"]()
    llm = patched(model, **settings_for(model, "tiny_pool"))
    ids = [llm.add_request(new_request_id(), prompt, SamplingParams(temperature=0, max_tokens=16)) for prompt in BATCH]
    preempted = None
    while preempted is None:
        llm.step()
        preempted = next((r for r in llm.core.scheduler.waiting if r.num_preemptions), None)
    context = list(preempted.token_ids)
    UPDATES["no_grad_edit"](model)
    done = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            done[output.request_id] = output
    assert preempted.model_key == llm.core.coordinator.model_key != b""
    request_id = next(i for i in ids if preempted.request_id.startswith(i))
    continued = done[request_id].outputs[0].token_ids[len(context) - preempted.num_prompt_tokens :]
    expected, _ = hf_greedy(model, context, len(continued))
    assert continued == expected
    assert llm.stats()["blocks_in_use"] == 0


def test_n_samples_and_beams_follow_the_weights(patched):
    model = FAMILIES["gemma3_text"]()
    llm = patched(model, **settings_for(model, "default"))
    two = SamplingParams(temperature=0, max_tokens=MAX_NEW, n=2)
    beams = hybridkv.BeamSearchParams(beam_width=2, max_tokens=4)
    llm.generate(BATCH, two, use_tqdm=False)
    (first_beams,) = llm.beam_search(BATCH[:1], beams, use_tqdm=False)
    UPDATES["sgd"](model)
    expected = [t for t, _ in references(model)]
    outputs = llm.generate(BATCH, two, use_tqdm=False)
    check_coordinator(llm.core.coordinator, [])
    assert [[sample.token_ids for sample in output.outputs] for output in outputs] == [[t, t] for t in expected]
    (beams_now,) = llm.beam_search(BATCH[:1], beams, use_tqdm=False)
    hybridkv.unpatch(model)
    (fresh,) = patched(model, **settings_for(model, "default")).beam_search(BATCH[:1], beams, use_tqdm=False)
    assert [s.tokens for s in beams_now.sequences] == [s.tokens for s in fresh.sequences]
    assert [s.tokens for s in beams_now.sequences] != [s.tokens for s in first_beams.sequences]


def test_the_async_engine_follows_the_weights(patched):
    from hybridkv.async_engine import AsyncLLMEngine

    model = FAMILIES["llama"]()
    llm = patched(model, **settings_for(model, "default"))
    before = references(model)
    with AsyncLLMEngine(llm) as engine:
        assert [engine.submit(p, GREEDY).result(60).outputs[0].token_ids for p in BATCH] == [t for t, _ in before]
        UPDATES["adamw_fused"](model)
        expected = [t for t, _ in references(model)]
        assert [engine.submit(p, GREEDY).result(60).outputs[0].token_ids for p in BATCH] == expected


# ---- reset_prefix_cache ------------------------------------------------------------------------------------


def _double_attention_scaling(model):
    """A change no signal sees: a plain float attribute the attention reads."""
    for module in model.modules():
        if isinstance(getattr(module, "scaling", None), float):
            module.scaling *= 4.0


@pytest.mark.parametrize("weights", ["inference_tensors", "through_data"])
def test_a_partial_column_edit_that_spares_column_0_is_followed(weights, patched):
    """Inference tensors keep no version counter and `.data` edits move none: only the content sample sees such an
    edit, so it must not be aligned with the weight's rows (once it read column 0 of 16 rows, and this edit spares
    column 0)."""
    inference = weights == "inference_tensors"
    with torch.inference_mode(inference):
        model = FAMILIES["llama"]()
    llm, before = first_generation(patched, model)
    hits = llm.stats()["prefix_cache_hits"]
    with torch.inference_mode(inference):  # the only mode that may write an inference tensor
        for layer in model.model.layers:
            weight = layer.self_attn.o_proj.weight
            (weight if inference else weight.data)[:, 16:32].zero_()
    assert_follows(llm, model, before)
    assert llm.stats()["model_weight_changes"] == 1
    assert llm.stats()["prefix_cache_hits"] == hits


def test_reset_prefix_cache_covers_a_change_no_check_sees(patched):
    model = FAMILIES["llama"]()
    llm, before = first_generation(patched, model)
    _double_attention_scaling(model)
    assert llm.core.model_watch.check() is None  # unseen: what reset_prefix_cache is for
    assert llm.reset_prefix_cache() is True
    assert_follows(llm, model, before)


def test_reset_prefix_cache_with_running_requests_recomputes_them(patched):
    model = FAMILIES["llama"]()
    llm = patched(model, **settings_for(model, "default"), preemption_mode="swap", swap_space=1 / 1024)
    ids = [llm.add_request(new_request_id(), prompt, SamplingParams(temperature=0, max_tokens=12)) for prompt in BATCH]
    for _ in range(3):
        llm.step()
    contexts = {r.request_id: list(r.token_ids) for r in llm.core.scheduler.running}
    assert len(contexts) == 2
    _double_attention_scaling(model)
    llm.reset_prefix_cache(reset_running_requests=True)
    assert not llm.core.scheduler.running and len(llm.core.scheduler.waiting) == 2
    assert llm.stats()["blocks_in_use"] == 0
    done = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            done[output.request_id] = output
    for request_id in ids:
        context = contexts[f"{request_id}#0"]
        made = len(context) - len(done[request_id].prompt_token_ids)
        continued = done[request_id].outputs[0].token_ids[made:]
        assert continued == hf_greedy(model, context, len(continued))[0]
        assert done[request_id].metrics.num_cached_tokens == 0
    assert llm.stats()["blocks_in_use"] == 0
    with pytest.raises(TypeError, match="reset_running_requests"):
        llm.reset_prefix_cache(reset_running_requests="yes")


# ---- the watch's signals, one at a time ------------------------------------------------------------------------


def _watch(model):
    from hybridkv.execution.model_watch import ModelWatch

    watch = ModelWatch(model)
    assert watch.check() is None and watch.key == b""
    return watch


def _reasons(watch):
    change = watch.check()
    assert change is not None and change.key == watch.key != b""
    assert watch.check() is None  # seen once
    return " ".join(change.reasons)


def test_each_signal_is_seen_and_named():
    model = FAMILIES["llama"]()
    watch = _watch(model)
    weight = model.model.layers[0].self_attn.q_proj.weight
    torch.optim.AdamW(model.parameters(), lr=0.0, fused=True).step()  # no gradient: nothing moves but the hook
    assert "optimizer" in _reasons(watch)
    with torch.no_grad():
        weight.add_(1.0)
    assert "in place" in _reasons(watch)
    weight.data.add_(1.0)
    assert "contents" in _reasons(watch)
    weight.data = weight.data.clone()
    change = watch.check()
    assert change.moved and "reassigned" in " ".join(change.reasons)
    model.model.layers[0].self_attn.q_proj.weight = torch.nn.Parameter(weight.detach().clone())
    assert "replaced" in _reasons(watch)
    del model.model.layers[1].mlp.up_proj.weight  # no registration hook sees a deletion
    assert "replaced, added or removed" in _reasons(watch)
    watch.close()


def test_a_one_column_edit_through_data_is_seen_in_every_weight_with_short_rows():
    """The content sample reads every column of a tensor whose rows are at most `SAMPLES` long (its step is coprime
    with the row length), whichever column an edit through `.data` (no version counter) touches."""
    from hybridkv.execution.model_watch import SAMPLES

    model = FAMILIES["llama"]()
    watch = _watch(model)
    weights = [p for p in model.parameters() if p.dim() == 2 and p.shape[1] <= SAMPLES]
    assert {tuple(p.shape) for p in weights} == {(64, 64), (32, 64), (128, 64), (256, 64)}
    for weight in weights:
        for column in range(weight.shape[1]):
            weight.data[:, column] += 1.0
            assert "contents" in _reasons(watch)
    watch.close()


def test_no_signal_fires_when_nothing_changed():
    model = FAMILIES["gemma3_text"]()
    watch = _watch(model)
    with torch.inference_mode():
        model(torch.tensor([BATCH[0]]))
    model.train()
    model.eval()
    layer = model.model.layers[0]
    layer.self_attn = layer.self_attn  # a registration of the same module changes nothing
    FAMILIES["llama"]()  # another model built: registrations elsewhere
    torch.optim.SGD(FAMILIES["llama"]().parameters(), lr=1.0).step()  # another model's optimizer
    assert watch.check() is None and watch.generation == 0
    watch.close()


def test_adapters_enter_the_key_and_come_back():
    model = lora_model("llama")
    watch = _watch(model)
    model.set_adapter("dpo")
    assert "active adapters" in _reasons(watch)
    dpo = watch.key
    model.set_adapter("sft")
    assert watch.check() is not None and watch.key == b""  # as patched: the old blocks are hit again
    model.set_adapter("dpo")
    assert watch.check() is not None and watch.key == dpo
    assert watch.generation == 0  # switching adapters changes no weight
    model.base_model.model.model.layers[0].self_attn.q_proj.set_scale("dpo", 2.0)
    assert watch.check() is not None and watch.key not in (b"", dpo)
    model.merge_adapter()
    assert "merged" in _reasons(watch)
    watch.close()


def test_a_dtype_change_is_refused_naming_the_fix(patched):
    model = FAMILIES["llama"]()
    llm = patched(model, **settings_for(model, "default"))
    llm.generate(BATCH[:1], GREEDY, use_tqdm=False)
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match=r"hybridkv.unpatch\(model\), then hybridkv.patch\(model\) again"):
        llm.generate(BATCH[:1], GREEDY, use_tqdm=False)
    assert llm.stats()["blocks_in_use"] == 0 and not llm.has_unfinished_requests()
    model.to(torch.float32)  # moved back: served again, with nothing computed before reused
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == [t for t, _ in references(model)]


def test_inference_tensors_and_meta_tensors_are_watched_without_errors():
    with torch.inference_mode():
        model = FAMILIES["llama"]()
    watch = _watch(model)
    with torch.inference_mode():
        model.model.layers[0].mlp.up_proj.weight.mul_(2.0)
    assert "contents" in _reasons(watch)
    model.model.layers[0].mlp.register_buffer("offloaded", torch.empty(4, device="meta"))
    assert "added" in _reasons(watch)
    watch.close()


def test_unpatch_removes_torchs_hooks(patched):
    from hybridkv.execution import model_watch

    model = FAMILIES["llama"]()
    patched(model)
    assert model_watch._HOOKS
    hybridkv.unpatch(model)
    assert not model_watch._HOOKS and not model_watch._WATCHES
