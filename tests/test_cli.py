import re
import subprocess
import sys
from dataclasses import fields

import pytest

import hybridkv
from hybridkv import EngineConfig, SamplingParams
from hybridkv.serving.cli import PATCH_FLAGS
from hybridkv.tiny import tiny_model

from tiny_tokenizer import tiny_tokenizer


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "hybridkv", *args], capture_output=True, text=True, check=True)


@pytest.mark.slow
def test_demo_generates_on_a_tiny_hybrid_model_and_reports_stats():
    out = run_cli("demo", "--max-tokens", "8").stdout
    assert "KV cache groups: group 0: window 32" in out and "full (layers [5])" in out
    assert "16 requests, 128 tokens" in out
    hits, queries = map(int, re.search(r"prefix cache hits: (\d+) of (\d+)", out).groups())
    assert 0 < hits < queries


@pytest.mark.slow
def test_generate_serves_a_local_checkpoint(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = hybridkv.patch(model, tokenizer=tokenizer)
    expected = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    result = run_cli("generate", "--model", str(tmp_path), "--prompt", "The quick", "--max-tokens", "6")
    assert result.stdout == "The quick" + expected.outputs[0].text + "\n"
    assert "6 tokens" in result.stderr


def test_serve_has_a_flag_for_every_patch_setting():
    assert set(PATCH_FLAGS) == {field.name for field in fields(EngineConfig)}
