import os

# Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. when the kernel module is
# imported: it must be set before anything imports hybridkv.kernels. Without a GPU the interpreter
# is the only way to run the Triton kernels.
if os.environ.get("HYBRIDKV_TEST_ON_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

# Two OpenMP threads on this 2-core machine spin against any other busy process: tiny-model steps
# measured 50x slower. The tests' tensors are small, one thread is the fast setting.
torch.set_num_threads(1)
