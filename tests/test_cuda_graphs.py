"""CUDA graphs of decode steps, on a GPU (benchmarks/gpu_check.sh runs these with HYBRIDKV_TEST_ON_GPU=1; the
CPU suite tests the same padded step buffers eagerly, tests/test_graph_ready.py).

Replay must be the eager step bit for bit: the same kernels over the same buffers. Every zoo family, fp32 and
bf16: a batch's prompts run eagerly, then each decode step runs as the captured graph and again eagerly over
the same prepared buffers (storing the same K/V again), and the logits must be equal. The replay path must not
synchronise with the host (`torch.cuda.set_sync_debug_mode("error")`)."""

from __future__ import annotations

import pytest
import torch

from hybridkv import SamplingParams

from model_zoo import ZOO
from tiny_models import DEVICE, prompts

if DEVICE.type != "cuda":
    pytest.skip("CUDA graphs need a CUDA GPU (benchmarks/gpu_check.sh runs these there)", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_graph_replay_gives_the_eager_steps_logits_bit_for_bit(name, dtype, patched):
    model = ZOO[name]().to(DEVICE, dtype)
    llm = patched(model, block_size=8, max_model_len=256, max_num_seqs=8)
    stats = llm.stats()
    assert stats["cuda_graph_error"] is None and stats["cuda_graphs"] == [1, 2, 4, 8]
    for prompt in prompts((7, 33, 70)):
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=5))
    llm.step()  # the prompts, eagerly
    runner, scheduler = llm.runner, llm.scheduler
    for _ in range(4):
        plan = scheduler.schedule()
        with torch.cuda.set_sync_debug_mode("error"):
            prepared = runner.prepare(runner.step_inputs(plan))
            assert prepared.bucket == 4
            replayed = runner.forward(prepared).clone()
        graphs, runner.graphs = runner.graphs, None
        try:
            eager = runner.forward(prepared)
        finally:
            runner.graphs = graphs
        assert torch.equal(replayed, eager), f"replay differs by {(replayed - eager).abs().max().item()}"
        scheduler.update(plan, eager.argmax(-1).tolist())
    llm.abort_all()
    assert llm.stats()["blocks_in_use"] == 0


def test_graph_mode_serves_requests_of_every_batch_size_as_generate_does(patched):
    """Batches of 1 to 9 sequences (9: beyond the largest bucket, eager) decode through graphs, tokens equal
    to eager mode's."""
    model = ZOO["gemma3_text"]().to(DEVICE)
    batch = prompts((5, 9, 17, 33, 40, 51, 64, 70, 90))
    params = SamplingParams(temperature=0, max_tokens=12)
    eager = patched(model, block_size=8, max_model_len=256, enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in eager.generate(batch, params, use_tqdm=False)]
    llm = patched(model, block_size=8, max_model_len=256, max_num_seqs=8)
    for size in range(1, len(batch) + 1):
        got = [o.outputs[0].token_ids for o in llm.generate(batch[:size], params, use_tqdm=False)]
        assert got == expected[:size]
