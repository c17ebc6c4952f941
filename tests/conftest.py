import os

# Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. when the kernel module is
# imported: it must be set before anything imports hybridkv.kernels. Without a GPU the interpreter
# is the only way to run the Triton kernels.
if os.environ.get("HYBRIDKV_TEST_ON_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import hybridkv

# Two OpenMP threads on this 2-core machine spin against any other busy process: tiny-model steps
# measured 50x slower. The tests' tensors are small, one thread is the fast setting.
torch.set_num_threads(1)


@pytest.fixture
def patched():
    """`patched(model, **settings)` is `hybridkv.patch(model, **settings)`, with every model it patched
    unpatched when the test ends, pass or fail (in reverse order, those still patched)."""
    models = []

    def patch(model, **settings):
        llm = hybridkv.patch(model, **settings)
        models.append(model)
        return llm

    yield patch
    for model in reversed(models):
        if hybridkv.is_patched(model):
            hybridkv.unpatch(model)
