"""vLLM's `collective_rpc` (issue 63): a worker method by name (`worker_extension_cls`) or a function called with the
worker, on every rank (one here; tests/test_tensor_parallel.py runs two under torchrun), between steps; bad calls and
extensions are clear errors that leave the engine serving. A weight update made through it is followed: the next
tokens are the updated model's."""

from __future__ import annotations

import asyncio

import pytest
import torch

import hybridkv
from hybridkv import LLM, EngineArgs, SamplingParams
from hybridkv.async_engine import AsyncLLM
from hybridkv.tiny import tiny_model

from tiny_models import hf_greedy, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6)


class WeightTools:
    """A worker extension, as vLLM's RLHF examples write one: methods that reach the model through the worker."""

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model_runner.model.parameters())

    def scale_lm_head(self, factor: float) -> str:
        with torch.no_grad():
            self.model.lm_head.weight.mul_(factor)
        return str(self.device)


class Conflicting:
    def model(self) -> None:  # the worker's own attribute
        return None


def roll_embeddings(worker, shift: int) -> int:
    """An update a trainer would send: every token's embedding moved to another id."""
    embeddings = worker.model.get_input_embeddings().weight
    with torch.no_grad():
        embeddings.copy_(embeddings.roll(shift, dims=0))
    return worker.rank


def test_collective_rpc_calls_a_function_and_an_extension_method_and_follows_the_update(patched):
    model = tiny_model("gemma3")
    batch = prompts((9, 30))
    llm = patched(model, worker_extension_cls=WeightTools)
    assert llm.collective_rpc(lambda worker: (worker.model is model, worker.rank, worker.world_size)) == [(True, 0, 1)]
    assert llm.collective_rpc("num_parameters") == [sum(p.numel() for p in model.parameters())]
    before = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    assert llm.collective_rpc(roll_embeddings, args=(5,)) == [0]
    after = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    # The prompts' blocks were cached under the old weights: the next tokens are the updated model's own.
    assert after == [hf_greedy(model, p, 6)[0] for p in batch] and after != before
    assert llm.collective_rpc("scale_lm_head", kwargs={"factor": 2.0}) == ["cpu"]


def test_collective_rpc_bad_calls_are_clear_errors_and_the_engine_serves_on(patched):
    model = tiny_model("llama")
    batch = prompts((12,))
    llm = patched(model)
    expected = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    with pytest.raises(AttributeError, match=r"no method 'num_parameters'.*worker_extension_cls"):
        llm.collective_rpc("num_parameters")
    with pytest.raises(ValueError, match="timeout must be a number of seconds above 0"):
        llm.collective_rpc("num_parameters", timeout=0)
    with pytest.raises(TypeError, match="args must be a tuple"):
        llm.collective_rpc(roll_embeddings, args=5)
    with pytest.raises(TypeError, match="a method name or a function"):
        llm.collective_rpc(42)
    with pytest.raises(ZeroDivisionError):  # the function's own error, as it raised it
        llm.collective_rpc(lambda worker: 1 / 0)
    assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == expected
    assert llm.stats()["blocks_in_use"] == 0


def test_worker_extension_cls_by_name_and_refusals():
    model = tiny_model("llama")
    # A qualified name is imported (string.Formatter's `format` needs no state of its own).
    llm = hybridkv.patch(model, worker_extension_cls="string.Formatter")
    try:
        assert llm.collective_rpc("format", args=("{}-{}", 1, 2)) == ["1-2"]
    finally:
        hybridkv.unpatch(model)
    with pytest.raises(ValueError, match="names no class that can be imported"):
        hybridkv.patch(model, worker_extension_cls="no_such_module.Extension")
    with pytest.raises(ValueError, match="defines model, which the worker has: rename"):
        hybridkv.patch(model, worker_extension_cls=Conflicting)
    with pytest.raises(TypeError, match="worker_extension_cls must be a class or its qualified name"):
        hybridkv.patch(model, worker_extension_cls=3)
    # vLLM's engine argument and flag.
    assert EngineArgs(model="m", worker_extension_cls="string.Formatter").settings == {
        "worker_extension_cls": "string.Formatter"
    }


def test_collective_rpc_through_llm_and_async_llm():
    model = tiny_model("llama")
    llm = LLM(model=model, worker_extension_cls=WeightTools)
    count = sum(p.numel() for p in model.parameters())
    try:
        assert llm.collective_rpc("num_parameters") == [count]
        engine = AsyncLLM(llm.llm_engine)  # the engine's thread serves it now: the call goes to that thread
        try:
            assert asyncio.run(engine.collective_rpc("num_parameters", timeout=5)) == [count]
        finally:
            engine.shutdown()
    finally:
        hybridkv.unpatch(model)
