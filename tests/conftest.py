import os
import sys
import tempfile

import pytest

# Bytecode caches are written even where PYTHONDONTWRITEBYTECODE is set (this machine sets it): without them every
# run, in each worker, compiles hybridkv's modules and rewrites every test module's asserts again (about 6 s of the
# fast tier's start). They go to __pycache__ folders, which git ignores.
sys.dont_write_bytecode = False

# Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. when the kernel module is
# imported: it must be set before anything imports hybridkv.kernels. Without a GPU the interpreter
# is the only way to run the Triton kernels.
if os.environ.get("HYBRIDKV_TEST_ON_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Compiled programs go to a cache of this test process's own, never the user's (~/.cache/hybridkv).
os.environ["HYBRIDKV_CACHE_DIR"] = tempfile.mkdtemp(prefix="hybridkv-test-cache-")


def pytest_configure(config):
    """Two OpenMP threads on this 2-core machine spin against any other busy process: tiny-model steps measured 50x
    slower. The tests' tensors are small, one thread is the fast setting. Set where tests run: in each worker, or in
    the one process without workers; pytest-xdist's controller runs none and imports neither torch nor hybridkv
    (seconds before the workers start). The fast tier is told it is one (tests/fast_tier.py) before tests are
    collected."""
    import fast_tier

    fast_tier.FAST = "not slow" in (config.option.markexpr or "")
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def patched():
    """`patched(model, tokenizer, **settings)` is `hybridkv.patch(model, tokenizer, **settings)`, with every model it
    patched unpatched when the test ends, pass or fail (in reverse order, those still patched)."""
    import hybridkv

    from tiny_models import DEVICE

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


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: a case `fast_if` marks slow must leave the fast tier
def pytest_collection_modifyitems(config, items):
    """A case of a test marked `fast_if(predicate)` whose parameters fail the predicate is marked slow (the fast tier
    keeps the cases that reach a path first; the full suite runs the rest). The tests marked slow (tens of seconds
    each) run first, so that the workers end together on short tests instead of one of them finishing a long one
    alone (pytest-xdist hands tests out in collection order)."""
    for item in items:
        marker = item.get_closest_marker("fast_if")
        if marker is not None and not marker.args[0](**item.callspec.params):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
