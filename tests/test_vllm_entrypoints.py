"""vLLM's entry points under vLLM's names (issue 63): `LLM`, `EngineArgs` and its flags, `RequestOutputKind` on the
async engine and on `step()`, `get_metrics()` and the mirrored module paths. tests/test_vllm_scripts.py runs vLLM's own
scripts over them; these tests pin each piece's rules."""

from __future__ import annotations

import asyncio
import importlib
import time

import pytest
import torch

import hybridkv
from hybridkv import LLM, AsyncEngineArgs, EngineArgs, RequestOutputKind, SamplingParams
from hybridkv.async_engine import AsyncLLM
from hybridkv.tiny import tiny_model
from hybridkv.utils import FlexibleArgumentParser
from hybridkv.v1.metrics.reader import Counter, Gauge, Vector

from tiny_models import hf_greedy, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def gemma3():
    model = tiny_model("gemma3")
    batch = prompts((9, 30, 41))
    return model, batch, [hf_greedy(model, p, 8)[0] for p in batch]


def test_vllms_module_paths_import_the_same_objects():
    paths = {
        "hybridkv.sampling_params": ["SamplingParams", "RequestOutputKind", "BeamSearchParams"],
        "hybridkv.engine.arg_utils": ["EngineArgs", "AsyncEngineArgs"],
        "hybridkv.utils": ["FlexibleArgumentParser"],
        "hybridkv.utils.argparse_utils": ["FlexibleArgumentParser"],
        "hybridkv.v1.engine.async_llm": ["AsyncLLM"],
        "hybridkv.v1.metrics.reader": ["Counter", "Gauge", "Histogram", "Vector"],
        "hybridkv.distributed": ["cleanup_dist_env_and_memory"],
        "hybridkv.entrypoints.llm": ["LLM"],
        "hybridkv.lora.request": ["LoRARequest"],
        "hybridkv.outputs": ["RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "PoolingRequestOutput"],
        "hybridkv.pooling_params": ["PoolingParams"],
        "hybridkv.inputs": ["TextPrompt", "TokensPrompt"],
        "hybridkv.benchmarks.datasets": ["add_dataset_parser", "get_samples", "SampleRequest"],
    }
    for path, names in paths.items():
        module = importlib.import_module(path)
        for name in names:
            assert getattr(module, name) is getattr(hybridkv, name, getattr(module, name)), f"{path}.{name}"
    assert hybridkv.sampling_params.SamplingParams is hybridkv.SamplingParams


def test_engine_args_flags_take_vllms_spellings_and_refuse_what_would_change_results(monkeypatch):
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    flags = ["--model", "m", "--max_model_len=64", "--disable-log-stats", "--tensor-parallel-size", "1"]
    args = parser.parse_args(flags)
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.model == "m" and engine_args.settings == {"max_model_len": 64}
    assert engine_args.disable_log_stats is True  # ignored: it changes no result
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 is not served here.*torchrun"):
        EngineArgs(model="m", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization='awq'"):
        AsyncEngineArgs(model="m", quantization="awq")
    with pytest.raises(TypeError, match="did you mean max_model_len"):
        EngineArgs(model="m", max_modle_len=64)
    with pytest.raises(ValueError, match="max_model_len"):  # a setting is checked where it is given
        EngineArgs(model="m", max_model_len=0)
    # Unset on the command line: under torchrun the process count is the tensor-parallel size taken.
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert EngineArgs.from_cli_args(parser.parse_args(["--model", "m"])).model == "m"
    with pytest.raises(ValueError, match="tensor_parallel_size=1 is not served here, only 2"):
        EngineArgs(model="m", tensor_parallel_size=1)


def test_llm_over_a_model_in_hand_is_the_patched_engine(gemma3, patched):
    model, batch, expected = gemma3
    llm = LLM(model, max_model_len=128, disable_log_stats=True, enable_sleep_mode=True, seed=None)
    try:
        assert llm.llm_engine is hybridkv.patch(model, max_model_len=128)  # the same settings: the same engine
        outputs = llm.generate(batch, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert "generate" in dir(llm) and llm.max_model_len == 128
        with pytest.raises(TypeError, match="already loaded"):
            LLM(model, dtype="bfloat16")
        with pytest.raises(TypeError, match="trust_remote_code name how a checkpoint loads"):
            LLM(model, trust_remote_code=True)
    finally:
        llm.shutdown()
    assert not hybridkv.is_patched(model)


def test_llm_loads_a_checkpoint_with_random_weights_from_load_format_dummy(tmp_path):
    from tiny_tokenizer import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    tiny_model("llama", vocab_size=len(tokenizer)).config.save_pretrained(tmp_path)  # the config alone
    llm = LLM(model=str(tmp_path), load_format="dummy", dtype="float32", max_model_len=64)
    try:
        assert llm.model.dtype == torch.float32 and type(llm.model).__name__ == "LlamaForCausalLM"
        assert len(llm.generate("The quick", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
    finally:
        llm.shutdown()
    # A torch dtype, as vLLM takes it, is its name; one vLLM does not take is refused with the choices.
    llm = LLM(model=str(tmp_path), load_format="dummy", dtype=torch.bfloat16, max_model_len=64)
    try:
        assert llm.model.dtype == torch.bfloat16
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match=r"dtype must be one of 'auto', 'half'.*got 'int8'"):
        LLM(model=str(tmp_path), load_format="dummy", dtype=torch.int8)


def test_async_outputs_follow_each_requests_output_kind(gemma3, patched):
    model, batch, expected = gemma3
    llm = patched(model, max_model_len=128)
    step = llm.step

    def slow_step():  # a reader sees every step's news (a tiny model's steps outrun the event loop)
        time.sleep(0.02)
        return step()

    llm.step = slow_step
    engine = AsyncLLM(llm)

    async def collect(prompt, kind, n=1):
        params = SamplingParams(temperature=0, max_tokens=8, n=n, output_kind=kind)
        return [output async for output in engine.generate(prompt, params)]

    async def main():
        return await asyncio.gather(
            collect(batch[0], RequestOutputKind.DELTA),
            collect(batch[1], RequestOutputKind.CUMULATIVE),
            collect(batch[2], RequestOutputKind.FINAL_ONLY),
            collect(batch[0], RequestOutputKind.DELTA, n=2),
        )

    try:
        delta, cumulative, final_only, delta_n2 = asyncio.run(main())
    finally:
        engine.shutdown()
    # DELTA: each output holds only its new tokens; together they are the whole completion, the last one finished.
    assert len(delta) > 1 and [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]
    assert [t for o in delta for t in o.outputs[0].token_ids] == expected[0]
    assert delta[-1].outputs[0].finish_reason == "length"
    assert delta[0].prompt_token_ids == batch[0] and all(o.prompt_logprobs is None for o in delta)
    # CUMULATIVE: each holds everything so far.
    assert cumulative[-1].outputs[0].token_ids == expected[1]
    assert all(expected[1][: len(o.outputs[0].token_ids)] == o.outputs[0].token_ids for o in cumulative)
    # FINAL_ONLY: the finished output alone.
    assert len(final_only) == 1 and final_only[0].finished and final_only[0].outputs[0].token_ids == expected[2]
    # n=2: each sample's deltas by its index.
    for index in (0, 1):
        tokens = [t for o in delta_n2 for c in o.outputs if c.index == index for t in c.token_ids]
        assert tokens == expected[0]
    assert asyncio.run(engine.abort(["a", "b"])) is None  # vLLM's coroutine, one id or several


def test_deltas_of_best_of_above_n_are_refused(gemma3, patched):
    model, batch, _ = gemma3
    engine = AsyncLLM(patched(model, max_model_len=128))
    try:
        params = SamplingParams(n=1, best_of=2, output_kind=RequestOutputKind.DELTA)
        with pytest.raises(ValueError, match="best_of=2 > n=1 has no deltas"):
            engine.submit(batch[0], params)
    finally:
        engine.shutdown()


def test_step_reports_a_final_only_request_once_finished_and_refuses_delta(gemma3, patched):
    model, batch, _ = gemma3
    llm = patched(model, max_model_len=128)
    with pytest.raises(ValueError, match="stream it"):
        llm.add_request("d", batch[0], SamplingParams(output_kind=RequestOutputKind.DELTA))
    assert not llm.has_unfinished_requests()
    final = SamplingParams(temperature=0, max_tokens=8, output_kind=RequestOutputKind.FINAL_ONLY)
    llm.add_request("f", batch[0], final)
    llm.add_request("c", batch[1], GREEDY)
    reports = []
    while llm.has_unfinished_requests():
        reports.append([(o.request_id, o.finished) for o in llm.step()])
    assert [r for step in reports for r in step if r[0] == "f"] == [("f", True)]
    assert sum(1 for step in reports for r in step if r[0] == "c") > 1  # cumulative: reported every step
    assert not llm.final_only
    with pytest.raises(TypeError, match="RequestOutputKind"):
        SamplingParams(output_kind="delta")


def test_get_metrics_reads_the_engines_counters_under_vllms_names(gemma3, patched):
    model, batch, _ = gemma3
    llm = patched(model, max_model_len=128)
    llm.generate(batch, GREEDY, use_tqdm=False)
    metrics = {metric.name: metric for metric in llm.get_metrics()}
    stats = llm.stats()
    assert isinstance(metrics["vllm:num_requests_running"], Gauge) and metrics["vllm:num_requests_running"].value == 0
    assert isinstance(metrics["vllm:generation_tokens"], Counter)
    assert metrics["vllm:generation_tokens"].value == stats["num_generated_tokens"] == 24
    assert metrics["vllm:prefix_cache_queries"].value == stats["prefix_cache_queries"]
    assert metrics["vllm:kv_cache_usage_perc"].value == 0.0
    assert isinstance(metrics["hybridkv_kv_blocks_in_use_per_group"], Vector)
    assert metrics["vllm:prompt_tokens"].value == stats["num_prompt_tokens"] == sum(map(len, batch))
    success = [m for m in llm.get_metrics() if m.name == "vllm:request_success"]
    assert [(m.tags, m.value) for m in success] == [({"finished_reason": "length"}, 3)]
    llm.add_request("aborted", batch[0], GREEDY)
    llm.abort("aborted")
    assert llm.stats()["finished_samples"] == {"length": 3, "abort": 1}


def test_get_metrics_has_vllms_spec_decode_series_only_with_a_speculative_config(gemma3, patched):
    model, batch, _ = gemma3
    assert not any(m.name.startswith("vllm:spec_decode") for m in patched(model, max_model_len=128).get_metrics())
    hybridkv.unpatch(model)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    llm = patched(model, max_model_len=128, speculative_config=spec)
    repeated = [prompt * 3 for prompt in batch]  # proposals to check: n-grams that repeat
    llm.generate(repeated, GREEDY, use_tqdm=False)
    metrics = {metric.name: metric for metric in llm.get_metrics()}
    stats = llm.stats()
    assert stats["spec_num_drafts"] > 0
    for name, key in (("num_drafts", "spec_num_drafts"), ("num_draft_tokens", "spec_num_draft_tokens")):
        assert (
            isinstance(metrics[f"vllm:spec_decode_{name}"], Counter)
            and metrics[f"vllm:spec_decode_{name}"].value == stats[key]
        )
    assert metrics["vllm:spec_decode_num_accepted_tokens"].value == stats["spec_num_accepted_tokens"]
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_position, Vector) and len(per_position.values) == 3
    assert sum(per_position.values) == stats["spec_num_accepted_tokens"]
    # The server's /metrics writes the same series as vLLM's server does (counters with Prometheus' _total).
    from prometheus_client.parser import text_string_to_metric_families

    from hybridkv.serving.metrics import ServerMetrics

    text = ServerMetrics(llm.stats).exposition().decode()
    samples = {
        (sample.name, tuple(sample.labels.values())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("vllm:spec_decode_num_drafts_total", ())] == stats["spec_num_drafts"]
    assert samples[("vllm:spec_decode_num_draft_tokens_total", ())] == stats["spec_num_draft_tokens"]
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", ())] == stats["spec_num_accepted_tokens"]
    assert [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (str(p),))] for p in range(3)] == (
        per_position.values
    )


def test_cleanup_dist_env_and_memory_runs_without_a_process_group():
    from hybridkv.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory(shutdown_ray=True)


def test_sleep_says_once_that_the_weights_stay(gemma3, patched):
    import warnings

    model, batch, expected = gemma3
    llm = patched(model, max_model_len=128)
    with pytest.warns(UserWarning, match="the weights stay where they are"):
        llm.sleep(level=2)
    llm.wake_up()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm.sleep(level=1)  # said once per engine
    llm.wake_up(tags=["weights"])
    llm.wake_up(tags=["kv_cache"])
    assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == expected


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama checkpoint on disk (fp32) with its tokenizer, and two prompts."""
    from tiny_tokenizer import tiny_tokenizer

    path = tmp_path_factory.mktemp("checkpoint")
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(path)
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(path)
    return str(path), prompts((11, 27))


def weight_bytes(model):
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def greedy(llm, batch):
    return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """Make `LLM(model=path, ...)` treat its weights in host memory as a GPU's: the model watch samples them through
    torch views (as on a GPU: numpy would fix the storages' size) and sleep gives them back. Loaded in bf16 from the
    fp32 checkpoint, so that they are the process's own memory, not mapped from the file."""
    from hybridkv.execution import model_watch

    monkeypatch.setattr(model_watch, "_sample_view", model_watch._sample_tensor)

    def load(path):
        llm = LLM(model=path, dtype="bfloat16", max_model_len=64, enable_sleep_mode=True)
        llm.llm_engine.weights.include_host = True
        return llm

    return load


def test_sleep_level_2_discards_a_loaded_models_weights_and_wake_up_loads_them_again(checkpoint, as_on_a_gpu):
    path, batch = checkpoint
    llm = as_on_a_gpu(path)
    try:
        expected = greedy(llm, batch)
        loaded = weight_bytes(llm.model)
        llm.sleep(level=2)
        assert llm.is_sleeping() and weight_bytes(llm.model) == 0
        assert llm.llm_engine.weights.nbytes_asleep() == loaded
        llm.wake_up(tags=["weights"])  # vLLM's order: weights first, then the KV cache
        assert weight_bytes(llm.model) == loaded
        assert llm.is_sleeping()  # the KV cache still sleeps
        with pytest.raises(RuntimeError, match=r"asleep.*wake_up\(\)"):
            llm.generate(batch, GREEDY, use_tqdm=False)
        llm.wake_up(tags=["kv_cache"])
        assert not llm.is_sleeping()
        assert greedy(llm, batch) == expected
    finally:
        llm.shutdown()


def test_waking_the_kv_cache_before_the_weights_serves_nothing_until_both_are_awake(checkpoint, as_on_a_gpu):
    path, batch = checkpoint
    llm = as_on_a_gpu(path)
    try:
        expected = greedy(llm, batch)  # and a cached prefix that must not outlive the weights
        llm.sleep(level=2)
        llm.wake_up(tags=["kv_cache"])
        assert llm.is_sleeping() and weight_bytes(llm.model) == 0
        with pytest.raises(RuntimeError, match="asleep"):
            llm.generate(batch, GREEDY, use_tqdm=False)
        llm.wake_up(tags=["weights"])
        assert not llm.is_sleeping()
        assert greedy(llm, batch) == expected
    finally:
        llm.shutdown()


def test_reload_weights_undoes_a_change_and_the_prefix_cache_follows(checkpoint, as_on_a_gpu):
    path, batch = checkpoint
    llm = as_on_a_gpu(path)
    try:
        expected = greedy(llm, batch)
        with torch.no_grad():
            llm.model.lm_head.weight.mul_(-1)
        changed = greedy(llm, batch)
        assert changed != expected
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights")  # vLLM's step after a level-2 wake-up: the checkpoint's weights
        llm.wake_up(tags=["kv_cache"])
        assert greedy(llm, batch) == expected
        with torch.no_grad():
            llm.model.lm_head.weight.mul_(-1)
        assert greedy(llm, batch) == changed
        llm.collective_rpc("reload_weights")  # awake: loads them in place, and cached blocks are not hit again
        assert greedy(llm, batch) == expected
    finally:
        llm.shutdown()


def test_level_1_offloads_the_weights_to_host_memory_and_restores_them_exactly(checkpoint, as_on_a_gpu):
    path, batch = checkpoint
    llm = as_on_a_gpu(path)
    try:
        expected = greedy(llm, batch)
        before = {name: p.clone() for name, p in llm.model.named_parameters()}
        llm.sleep(level=1)
        assert weight_bytes(llm.model) == 0
        llm.wake_up()
        assert all(torch.equal(p, before[name]) for name, p in llm.model.named_parameters())
        assert greedy(llm, batch) == expected
    finally:
        llm.shutdown()


def test_on_the_cpu_the_weights_stay_in_host_memory_at_either_level(checkpoint):
    path, batch = checkpoint
    for dtype in ("auto", "bfloat16"):  # auto: mapped from the checkpoint's file; bf16: sampled through numpy
        llm = LLM(model=path, dtype=dtype, max_model_len=64)
        try:
            expected, loaded = greedy(llm, batch), weight_bytes(llm.model)
            llm.sleep(level=1)  # host memory already: nothing to say
            llm.wake_up()
            with pytest.warns(UserWarning, match=r"host memory \(the CPU\), which level 1 offloads to"):
                llm.sleep(level=2)
            assert weight_bytes(llm.model) == loaded
            llm.wake_up()
            assert greedy(llm, batch) == expected
        finally:
            llm.shutdown()


def test_sleep_keeps_weights_it_cannot_load_again_or_that_changed_shape(tmp_path, checkpoint, as_on_a_gpu):
    from tiny_tokenizer import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    tiny_model("llama", vocab_size=len(tokenizer)).config.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), load_format="dummy", max_model_len=64)  # random weights
    llm.llm_engine.weights.include_host = True
    try:
        before = greedy(llm, ["The quick"])
        llm.sleep(level=2)  # random weights cannot be loaded again: offloaded as at level 1
        assert llm.llm_engine.weights.level == 1 and weight_bytes(llm.model) == 0
        llm.wake_up()
        assert greedy(llm, ["The quick"]) == before
        with pytest.raises(RuntimeError, match="random"):
            llm.collective_rpc("reload_weights")
    finally:
        llm.shutdown()
    llm = as_on_a_gpu(checkpoint[0])
    try:
        llm.model.lm_head.weight = torch.nn.Parameter(llm.model.lm_head.weight.float())
        with pytest.warns(UserWarning, match=r"no longer as its checkpoint loaded them \(lm_head.weight is"):
            llm.sleep(level=2)
        assert weight_bytes(llm.model) > 0
        llm.wake_up()
    finally:
        llm.shutdown()


def test_reload_weights_on_a_model_in_hand_names_the_fix(gemma3, patched):
    model, _, _ = gemma3
    llm = patched(model, max_model_len=128)
    with pytest.raises(RuntimeError, match="load_state_dict"):
        llm.collective_rpc("reload_weights")


def test_pooling_calls_on_a_generating_llm_name_the_runner_and_bad_values_are_refused(gemma3, patched):
    with pytest.raises(ValueError, match=r"runner='embed'.*'pooling'"):
        EngineArgs(model="m", runner="embed")
    assert EngineArgs(model="m", runner="auto", task="generate").model == "m"
    model, batch, _ = gemma3
    llm = LLM(model, max_model_len=128)
    try:
        for call in (llm.embed, llm.classify, llm.reward, llm.encode):
            with pytest.raises(ValueError, match=r"needs a pooling model.*runner='pooling'"):
                call(batch[0])
        with pytest.raises(ValueError, match="needs a pooling model"):
            llm.score("a", "b")
    finally:
        llm.shutdown()
