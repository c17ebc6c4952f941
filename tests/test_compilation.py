"""The compiled forward (hybridkv/execution/compilation.py, hybridkv/execution/compiled_forward.py,
hybridkv/execution/compile_cache.py): traced once, split at attention with identical pieces compiled once, kept on disk
for the next process, rebuilt (never a crash) from a bad entry, and following the model when it changes.

Tests of the trace and the program run the pieces as traced (`eager_pieces`, seconds); the ones about
inductor's code and the disk compile for real, on a two-layer Llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

import hybridkv
from hybridkv import SamplingParams
from hybridkv.execution.compile_cache import cache_dir, model_key, program_key
from hybridkv.execution.model_watch import model_adapter_state
from hybridkv.tiny import tiny_model

from tiny_models import FAMILIES, hf_greedy, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6)
BATCH = prompts((7, 30, 1))


def tokens(outputs):
    return [output.outputs[0].token_ids for output in outputs]


def references(model, batch=BATCH):
    return [hf_greedy(model, prompt, 6)[0] for prompt in batch]


def num_pieces(llm) -> tuple[int, int]:
    """(distinct pieces, pieces) of the engine's compiled program."""
    program = llm.core.runner.compiled.program
    return len(program.pieces), sum(1 for call in program.spec.calls if hasattr(call, "piece"))


# ---- where the cache lives, and its key -------------------------------------------------------------------------


def test_the_cache_lives_under_hybridkv_cache_dir_else_xdg_cache_home_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("HYBRIDKV_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "hybridkv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "hybridkv"


def key_of(model, device="cpu"):
    return program_key(model_key(model, model_adapter_state(model)), torch.device(device))


def test_the_key_ignores_weight_values_and_follows_config_dtype_device_and_mode():
    first, second = tiny_model("llama", num_hidden_layers=2), tiny_model("llama", num_hidden_layers=2)
    with torch.no_grad():
        second.lm_head.weight.mul_(2)
    assert key_of(first) == key_of(second)  # the program reads the weights: their values are not in its code
    assert key_of(first) != key_of(tiny_model("llama", num_hidden_layers=3))
    assert key_of(first) != key_of(tiny_model("llama", num_hidden_layers=2, rms_norm_eps=1e-5))
    assert key_of(first) != key_of(tiny_model("llama", num_hidden_layers=2).to(torch.bfloat16))
    assert key_of(first) != key_of(first, "meta")  # the device enters the key (a GPU's: its name and capability)
    assert key_of(first) != key_of(first.train())


def test_the_key_follows_what_the_trace_bakes_in_besides_the_config():
    """A module's plain attribute, a forward hook, a forward replaced on an instance: each changes what a trace
    computes, so each changes the key (a process whose model has none never loads the program of one that has)."""
    model = tiny_model("llama", num_hidden_layers=2)
    plain = key_of(model)
    model.model.layers[1].self_attn.scaling = 0.5
    assert key_of(model) != plain
    model.model.layers[1].self_attn.scaling = tiny_model("llama", num_hidden_layers=2).model.layers[1].self_attn.scaling
    assert key_of(model) == plain
    handle = model.model.layers[0].mlp.register_forward_hook(lambda module, args, output: output * 2)
    assert key_of(model) != plain
    handle.remove()
    model.model.norm.forward = lambda hidden_states: hidden_states
    assert key_of(model) != plain


def test_the_key_follows_the_active_adapter():
    model = get_peft_model(tiny_model("llama", num_hidden_layers=2), LoraConfig(r=4, target_modules=["q_proj"]), "a")
    model.add_adapter("b", LoraConfig(r=4, target_modules=["q_proj"]))
    under_a = key_of(model)
    model.set_adapter("b")
    assert key_of(model) != under_a


# ---- one trace, identical pieces compiled once ------------------------------------------------------------------


@pytest.mark.slow
def test_identical_layers_share_their_pieces_whatever_the_depth(patched, eager_pieces):
    """Between two attentions lies the same graph for every layer of a kind: a model 7 layers deeper compiles
    no piece more (its program calls them more often)."""
    shallow = patched(tiny_model("gemma3", num_hidden_layers=6), block_size=8, max_model_len=128, compile=True)
    deep = patched(tiny_model("gemma3", num_hidden_layers=13), block_size=8, max_model_len=128, compile=True)
    assert num_pieces(shallow) == (3, 7)
    assert num_pieces(deep) == (3, 14)


@pytest.mark.slow  # compiles the program
def test_the_compiled_program_serves_steps_without_dynamo(patched, eager_pieces):
    """After the trace at patch time no step runs through dynamo: set_stance('fail_on_recompile') passes and dynamo
    compiles no graph, over steps of one row, of one logits row, chunked prompts and mixed steps."""
    model = FAMILIES["gemma3_text"]()
    llm = patched(model, block_size=8, max_model_len=128, max_num_batched_tokens=16, compile=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.compiler.set_stance("fail_on_recompile"):
        assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == references(model)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


# ---- compiled by inductor, kept on disk ---------------------------------------------------------------------------

COLD_AND_WARM = textwrap.dedent(
    """
    import json, sys, time, torch
    import hybridkv
    from hybridkv import SamplingParams
    from hybridkv.tiny import tiny_model
    torch.manual_seed(0)
    model = tiny_model("llama", num_hidden_layers=1)  # two pieces, the least a split program has
    start = time.perf_counter()
    llm = hybridkv.patch(model, block_size=8, max_model_len=128, compile=True, use_tqdm=False)
    outputs = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    hybridkv.unpatch(model)
    eager = hybridkv.patch(model, block_size=8, max_model_len=128, compile=False)
    expected = eager.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    print(json.dumps({
        "seconds": seconds, "from": stats["compiled_from"], "trace": stats["compile_trace_seconds"],
        "tokens": [o.outputs[0].token_ids for o in outputs], "eager": [o.outputs[0].token_ids for o in expected],
    }))
    """
)


def run_process(cache: Path) -> dict:
    env = {**os.environ, "HYBRIDKV_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    done = subprocess.run(
        [sys.executable, "-c", COLD_AND_WARM], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_loads_the_compiled_program_instead_of_compiling(tmp_path):
    """The first process traces and compiles (inductor, cold caches); the second loads the program and its pieces
    from the disk cache: no trace, the same tokens, eager mode's tokens, in a fraction of the time."""
    cold = run_process(tmp_path)
    warm = run_process(tmp_path)
    assert cold["from"] == "traced" and warm["from"] == "disk" and warm["trace"] == 0.0
    assert cold["tokens"] == warm["tokens"] == cold["eager"]
    assert warm["seconds"] < 0.5 * cold["seconds"], (cold["seconds"], warm["seconds"])


@pytest.fixture(scope="module")
def compiled_entry(tmp_path_factory):
    """A two-layer Llama's program, compiled once by inductor into a cache directory of its own: (the model, that
    directory, its eager tokens)."""
    cache = tmp_path_factory.mktemp("compiled")
    previous = os.environ["HYBRIDKV_CACHE_DIR"]
    os.environ["HYBRIDKV_CACHE_DIR"] = str(cache)
    try:
        model = tiny_model("llama", num_hidden_layers=2)
        expected = references(model)
        llm = hybridkv.patch(model, block_size=8, max_model_len=128, compile=True, use_tqdm=False)
        assert llm.stats()["compiled_from"] == "traced"
        assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == expected
        hybridkv.unpatch(model)
    finally:
        os.environ["HYBRIDKV_CACHE_DIR"] = previous
    return model, cache, expected


def entry_files(cache: Path) -> list[Path]:
    (entry,) = [path for path in (cache / "compiled").iterdir() if not path.name.startswith(".")]
    return sorted(entry.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated piece", "missing piece", "program of another format", "garbage"])
def test_a_bad_cache_entry_is_compiled_again_with_a_warning(damage, compiled_entry, tmp_path, monkeypatch, patched):
    model, cache, expected = compiled_entry
    import shutil

    shutil.copytree(cache, tmp_path / "cache")
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path / "cache"))
    files = entry_files(tmp_path / "cache")
    piece = next(path for path in files if path.suffix == ".bin")
    program = next(path for path in files if path.name == "program.json")
    if damage == "truncated piece":
        piece.write_bytes(piece.read_bytes()[: piece.stat().st_size // 2])
    elif damage == "missing piece":
        piece.unlink()
    elif damage == "program of another format":
        data = json.loads(program.read_text())
        program.write_text(json.dumps({**data, "format": 0}))
    else:
        program.write_text("not json {")
    with pytest.warns(UserWarning, match="compile cache entry .* cannot be used .* compiled again"):
        llm = patched(model, block_size=8, max_model_len=128, compile=True, use_tqdm=False)
    assert llm.stats()["compiled_from"] == "traced"
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == expected
    hybridkv.unpatch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rebuilt whole: the next engine loads it without a word
        again = patched(model, block_size=8, max_model_len=128, compile=True, use_tqdm=False)
    assert again.stats()["compiled_from"] == "disk"


@pytest.mark.slow
def test_a_compiled_program_reads_the_weights_as_they_are_now(compiled_entry, monkeypatch, patched):
    """Loaded from disk, the program reads the model's tensors at their paths: an in-place update and a replaced
    parameter both change its tokens to transformers' with the new weights."""
    model, cache, _ = compiled_entry
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(cache))
    llm = patched(model, block_size=8, max_model_len=128, compile=True, use_tqdm=False)
    assert llm.stats()["compiled_from"] == "disk"
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(-1.5)
    expected = references(model)
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == expected
    model.model.layers[1].self_attn.o_proj.weight = torch.nn.Parameter(
        torch.randn_like(model.model.layers[1].self_attn.o_proj.weight) * 0.5
    )
    replaced = references(model)
    assert replaced != expected
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == replaced


# ---- following the model ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_switching_adapters_switches_programs_and_back(patched, eager_pieces):
    """An adapter switch changes what the trace read (the active adapter's name and scaling): the engine takes the
    program of the adapter now active, traced once per adapter and kept for switching back."""
    model = get_peft_model(
        FAMILIES["llama"](), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False), "sft"
    )
    model.add_adapter("dpo", LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.set_adapter("sft")
    model.eval()
    llm = patched(model, block_size=8, max_model_len=128, compile=True)
    under_sft = references(model)
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == under_sft
    first = llm.core.runner.compiled.program
    model.set_adapter("dpo")
    under_dpo = references(model)
    assert under_dpo != under_sft
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == under_dpo
    assert llm.core.runner.compiled.program is not first and llm.stats()["compiled_from"] == "traced"
    model.set_adapter("sft")
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == under_sft
    assert llm.core.runner.compiled.program is first and llm.stats()["compiled_from"] == "memory"


@pytest.mark.slow  # two traces of the forward (8 s): the fast tier traces one in tests/test_graph_ready.py
def test_a_model_in_training_mode_is_served_by_its_eval_program_and_left_in_its_mode(patched, eager_pieces):
    """Rollouts of a policy being trained run as inference: dropout is never in the graph, so switching the model to
    training mode takes the same program (no trace), and the tokens are eval mode's; the model stays in training."""
    model = tiny_model("llama", num_hidden_layers=2, attention_dropout=0.5)
    model.eval()
    expected = references(model)
    model.train()
    llm = patched(model, block_size=8, max_model_len=128, compile=True)
    first = llm.core.runner.compiled.program
    assert model.training
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == expected
    assert llm.core.runner.compiled.program is first and model.training
    model.eval()
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == expected
    assert llm.core.runner.compiled.program is first and not model.training


# ---- the default, and models that cannot be compiled ---------------------------------------------------------


def test_compile_is_off_by_default_on_the_cpu(patched):
    llm = patched(FAMILIES["llama"](), block_size=8, max_model_len=128)
    assert llm.config.compile is None and not llm.stats()["compiled"]


def test_when_compiling_is_the_default_an_untraceable_model_runs_eagerly_with_a_warning(patched, monkeypatch):
    """compile=None compiles where CUDA graphs are captured; a model dynamo cannot trace whole then runs eagerly,
    with a warning naming the cause, never an error (compile=True makes it one: tests/test_graph_ready.py)."""
    from model_zoo import untraceable_llama

    monkeypatch.setattr(hybridkv.engine.core, "compiles_by_default", lambda captures: True)
    model = untraceable_llama()
    with pytest.warns(UserWarning, match="forward cannot be compiled: torch.compile.*cannot trace.*runs eagerly"):
        llm = patched(model, block_size=8, max_model_len=128)
    assert not llm.stats()["compiled"] and "cannot trace" in llm.stats()["compile_error"]
    assert tokens(llm.generate(prompts((7,)), GREEDY, use_tqdm=False)) == references(model, prompts((7,)))


@pytest.mark.slow
def test_set_up_shows_its_progress_unless_asked_not_to(patched, eager_pieces, capsys, caplog):
    model = tiny_model("llama", num_hidden_layers=2)
    with caplog.at_level("INFO", logger="hybridkv"):
        patched(model, block_size=8, max_model_len=128, compile=True)
    assert "hybridkv: compiling" in capsys.readouterr().err
    assert any("traced in" in record.getMessage() for record in caplog.records)
    hybridkv.unpatch(model)
    patched(model, block_size=8, max_model_len=128, compile=True, use_tqdm=False)
    assert "hybridkv: compiling" not in capsys.readouterr().err


@pytest.mark.slow
def test_an_attribute_edit_is_followed_after_reset_prefix_cache(patched, eager_pieces):
    """A plain attribute the forward reads is seen by no check (README, "Models that change"): after
    reset_prefix_cache() the compiled forward is the one traced with the model as it now is."""
    model = FAMILIES["llama"]()
    llm = patched(model, block_size=8, max_model_len=128, compile=True)
    before = references(model)
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == before
    for layer in model.model.layers:
        layer.self_attn.scaling *= 4
    after = references(model)
    assert after != before
    llm.reset_prefix_cache()
    assert tokens(llm.generate(BATCH, GREEDY, use_tqdm=False)) == after
