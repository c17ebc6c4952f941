"""A `hybridkv serve` started as a subprocess by a test: the checkpoint it serves, and waiting until it answers."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from hybridkv.tiny import tiny_model

from tiny_tokenizer import tiny_tokenizer


def wait_for_health(process: subprocess.Popen, port: int, seconds: float) -> None:
    """Return once the server on 127.0.0.1:`port` answers /health with 200; fail with the end of its output if the
    process exits first, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, (process.stdout or process.stderr).read()[-4000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"the server did not start within {seconds:g} s"
        time.sleep(0.2)


def save_chat_checkpoint(path: Path, chat_template: str) -> Path:
    """A tiny random Llama and the tests' tokenizer with `chat_template`, saved to `path` (a copy of the tokenizer:
    tiny_tokenizer() is shared by the process's tests)."""
    tiny_tokenizer().save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(path)
    return path
