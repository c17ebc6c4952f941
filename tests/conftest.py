import os
import tempfile

# Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. when the kernel module is
# imported: it must be set before anything imports hybridkv.kernels. Without a GPU the interpreter
# is the only way to run the Triton kernels.
if os.environ.get("HYBRIDKV_TEST_ON_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Compiled programs go to a cache of this test process's own, never the user's (~/.cache/hybridkv).
os.environ["HYBRIDKV_CACHE_DIR"] = tempfile.mkdtemp(prefix="hybridkv-test-cache-")

import pytest
import torch

import hybridkv

from tiny_models import DEVICE

# Two OpenMP threads on this 2-core machine spin against any other busy process: tiny-model steps
# measured 50x slower. The tests' tensors are small, one thread is the fast setting.
torch.set_num_threads(1)


@pytest.fixture
def patched():
    """`patched(model, tokenizer, **settings)` is `hybridkv.patch(model, tokenizer, **settings)`, with every model it
    patched unpatched when the test ends, pass or fail (in reverse order, those still patched)."""
    models = []

    def patch(model, tokenizer=None, **settings):
        if DEVICE.type == "cuda" and not {"num_blocks", "kv_cache_memory", "gpu_memory_utilization"} & settings.keys():
            # The CPU's default budget: 0.9 of an H200 is ~15 million blocks of a tiny model (seconds of block
            # objects), and a fraction of the device is shared with the other test workers' processes.
            settings["kv_cache_memory"] = 1 << 30
        if DEVICE.type == "cuda":
            # On one GPU the default compiles (minutes for the zoo): tests of the compiled forward there pass
            # `compile` themselves (tests/test_cuda_graphs.py).
            settings.setdefault("compile", False)
        llm = hybridkv.patch(model, tokenizer, **settings)
        # Every step checks that the runner's persistent block tables equal the managers' lists.
        llm.core.runner.verify_tables = llm.core.coordinator.block_tables
        models.append(model)
        return llm

    yield patch
    for model in reversed(models):
        if hybridkv.is_patched(model):
            hybridkv.unpatch(model)


@pytest.fixture
def eager_pieces(monkeypatch):
    """compile=True with every distinct piece run as its traced graph, not compiled by inductor (seconds, not
    minutes a family): what the test checks is the trace, the split and the program (hybridkv/execution/compilation.py).
    Nothing is saved to or loaded from the disk cache."""
    from hybridkv.execution import compiled_forward

    monkeypatch.setattr(compiled_forward, "compile_piece", lambda module, fake_args: module)
    monkeypatch.setattr(compiled_forward.ProgramCache, "save", lambda self, key, spec, pieces: None)
    monkeypatch.setattr(compiled_forward.ProgramCache, "load", lambda self, key: None)


def pytest_collection_modifyitems(config, items):
    """The tests marked slow (tens of seconds each) run first, so that the workers end together on short tests
    instead of one of them finishing a long one alone (pytest-xdist hands tests out in collection order)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
