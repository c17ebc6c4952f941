import ast
import dataclasses
import inspect
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hybridkv
from hybridkv.execution.config import EngineConfig
from hybridkv.tiny import tiny_model

from tiny_tokenizer import tiny_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_against_a_local_checkpoint(tmp_path, capsys):
    examples = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    # The quick start: the first example that patches a model (the tensor-parallel one needs torchrun:
    # tests/test_tensor_parallel.py runs its steps).
    example = next(block for block in examples if "hybridkv.patch(" in block)
    assert "tp_plan" not in example
    checkpoint = re.search(r'from_pretrained\("([^"]+)"', example).group(1)
    tokenizer = tiny_tokenizer()
    tiny_model("gemma3", vocab_size=len(tokenizer), max_position_embeddings=8192).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    namespace: dict = {}
    exec(compile(example.replace(checkpoint, str(tmp_path)), "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    # What its comments claim: the stream printed text, stats() names the prefix-cache hits, and unpatch leaves the
    # model exactly as a fresh load of the checkpoint (its greedy generate the same). The example runs in bf16, where
    # no system's tokens are another's after a near tie (README, "bf16 agreement"): its outputs are 64 tokens each.
    stats_line = printed.rstrip("\n").rpartition("\n")[2]
    assert "prefix_cache_hits" in stats_line and printed[: -len(stats_line)].strip()
    model, tok, outs = namespace["model"], namespace["tok"], namespace["outs"]
    assert not hybridkv.is_patched(model)
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=model.dtype)
    assert [len(output.outputs[0].token_ids) for output in outs] == [64, 64]
    for prompt in ["Hello", "Tell me a story"]:
        ids = tok(prompt, return_tensors="pt").input_ids
        generated = [m.generate(ids, max_new_tokens=16, do_sample=False)[0].tolist() for m in (model, fresh)]
        assert generated[0] == generated[1]
    assert all(torch.equal(value, fresh.state_dict()[name]) for name, value in model.state_dict().items())


def test_the_readmes_patch_signature_is_engine_configs():
    """The signature the README gives for `hybridkv.patch` names every setting, with its default, and no other."""
    written = re.search(r"`hybridkv\.patch\((model, .*?)\)`", README.read_text(), flags=re.S).group(1)
    arguments = ast.parse(f"def patch({written}): pass").body[0].args
    documented = dict(
        zip(
            [a.arg for a in arguments.args[-len(arguments.defaults) :] + arguments.kwonlyargs],
            [eval(compile(ast.Expression(d), "README.md", "eval")) for d in arguments.defaults + arguments.kw_defaults],
            strict=True,
        )
    )
    expected = {"tokenizer": None, "processor": None}
    expected.update({f.name: f.default for f in dataclasses.fields(EngineConfig)})
    assert documented == expected
    assert [a.arg for a in arguments.args] == ["model", "tokenizer"]
    assert list(inspect.signature(hybridkv.patch).parameters) == ["model", "tokenizer", "processor", "config"]
