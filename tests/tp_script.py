"""Run under `torchrun --nproc_per_node 2` by tests/test_tensor_parallel.py (gloo on the CPU): loads a
checkpoint with transformers' tensor parallelism (`tp_plan="auto"`) and serves it with hybridkv in
several settings. Rank 0 serves and runs the scenarios; rank 1 runs the worker loop (and injects a fault
in one scenario). Each rank writes what it saw to `<out>.rank<r>.json`.

    torchrun --nproc_per_node 2 tests/tp_script.py CHECKPOINT OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hybridkv
from hybridkv import BeamSearchParams, SamplingParams

from tiny_models import new_request_id

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
BASE = dict(block_size=8, max_model_len=256)


def main() -> None:
    path, out = sys.argv[1], sys.argv[2]
    # transformers' plan, or with `tp_plan.json` in the checkpoint, that plan's rules over it.
    plan_file = Path(path) / "tp_plan.json"
    plan = json.loads(plan_file.read_text()) if plan_file.exists() else "auto"
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan=plan, dtype=torch.float32)
    rank = dist.get_rank()
    with open(f"{path}/prompts.json") as f:
        prompts = json.load(f)
    seen: dict = {"rank": rank}
    # A latent attention model's up-projection rows on this rank (all of them unless the plan splits its heads).
    ups = [m.weight for n, m in model.named_modules() if n.endswith("kv_b_proj")][:1]
    seen["up_projection_rows"] = [getattr(w, "to_local", lambda w=w: w)().shape[0] for w in ups]
    with torch.inference_mode():
        seen["generate"] = [
            model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    tiny = dict(BASE, max_model_len=96, max_num_batched_tokens=32)
    tiny_blocks = hybridkv.min_num_blocks(model, **tiny) + 2

    def tokens(outputs):
        return [o.outputs[0].token_ids for o in outputs]

    def default(llm):
        seen["worker_error"] = None
        # collective_rpc reaches both ranks' workers, in rank order; a lambda cannot be sent, a failure on rank 1 is
        # raised on rank 0 naming it, and the engine serves on after both.
        seen["rpc"] = llm.collective_rpc(rank_and_shard, args=(" of ",))
        calls = (
            ("rpc_lambda_error", lambda worker: worker.rank),
            ("rpc_rank1_error", fail_on_rank_1),
            ("rpc_result_error", unpicklable_result),
        )
        for name, method in calls:
            try:
                llm.collective_rpc(method)
            except (TypeError, RuntimeError) as exc:
                seen[name] = str(exc)
        return tokens(llm.generate(prompts, GREEDY, use_tqdm=False))

    def chunked_and_cached(llm):
        first = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        again = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        seen["prefix_cache_hits"] = llm.stats()["prefix_cache_hits"]
        return [first, again]

    def tiny_pool(llm):
        result = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        seen[f"preemptions_{llm.config.preemption_mode}"] = llm.stats()["num_preemptions"]
        return result

    def beams(llm):
        output = llm.beam_search(prompts[:2], BeamSearchParams(beam_width=3, max_tokens=6), use_tqdm=False)
        return [[s.output_token_ids for s in o.sequences] for o in output]

    def fault(llm):
        """Rank 1 fails to prepare its third step: the step's requests fail on rank 0, the rest do not."""
        ids = [llm.add_request(new_request_id(), p, GREEDY) for p in prompts]
        done = {}
        while llm.has_unfinished_requests():
            for output in llm.step():
                if output.finished:
                    done[output.request_id] = output
        seen["fault_errors"] = [done[i].error for i in ids]
        seen["after_fault"] = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        return seen["after_fault"]

    def speculative(llm):
        """Proposals of the reference continuation, one of each 4 spoiled at a place that moves: every number of
        kept tokens, checked in steps the workers run as rank 0 plans them."""
        continuation = {tuple(p): expected for p, expected in zip(prompts, seen["generate"], strict=True)}

        def propose(requests):
            for request in requests:
                if request.num_output_tokens < 1 or request.status.is_finished:
                    continue
                expected = continuation[tuple(request.token_ids[: request.num_prompt_tokens])]
                proposal = list(expected[request.num_output_tokens : request.num_output_tokens + 4])
                spoiled = len(request.token_ids) * 7 % 6
                if spoiled < len(proposal):
                    proposal[spoiled] = (proposal[spoiled] + 1) % 256
                request.spec_token_ids = proposal

        llm.core.speculator.propose = propose
        result = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        seen["spec_num_accepted_tokens"] = llm.stats()["spec_num_accepted_tokens"]
        return result

    def draft_model(llm):
        """A draft model's proposals (the checkpoint loaded whole, without the plan: every proposal kept), made on rank
        0 alone and checked on both ranks."""
        result = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        stats = llm.stats()
        seen["draft_acceptance_rate"] = stats["spec_acceptance_rate"]
        return result

    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    # Every rank passes the same settings; only rank 0 builds the draft's engine (the workers never propose).
    draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    scenarios = [
        ("default", default, {}),
        ("speculative", speculative, dict(speculative_config=ngram)),
        ("draft_model", draft_model, dict(speculative_config={"model": draft, "num_speculative_tokens": 3})),
        ("chunked_cached", chunked_and_cached, dict(max_num_batched_tokens=24)),
        ("tiny_pool", tiny_pool, dict(tiny, num_blocks=tiny_blocks)),
        ("tiny_pool_swap", tiny_pool, dict(tiny, num_blocks=tiny_blocks, preemption_mode="swap", swap_space=1 / 1024)),
        ("beams", beams, {}),
        ("fault", fault, {}),
    ]
    for name, run, settings in scenarios:
        llm = hybridkv.patch(model, **{**BASE, **settings})
        seen[f"{name}_kv_cache_bytes"] = llm.stats()["kv_cache_bytes"]
        seen[f"{name}_num_blocks"] = llm.stats()["num_blocks"]
        if rank == 0:
            seen[name] = run(llm)
        else:
            try:
                llm.generate(prompts, GREEDY, use_tqdm=False)
            except RuntimeError as exc:
                seen["worker_error"] = str(exc)
            if name == "fault":
                inject_fault(llm, at_call=3)
            llm.run_worker()
        hybridkv.unpatch(model)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


def rank_and_shard(worker, joined: str) -> list:
    """A worker's rank of its world, and whether its model is the engine's (collective_rpc)."""
    return [f"{worker.rank}{joined}{worker.world_size}", worker.model is worker.model_runner.model]


def fail_on_rank_1(worker) -> int:
    if worker.rank == 1:
        raise ValueError("rank 1 refuses")
    return worker.rank


def unpicklable_result(worker):
    return lambda: worker.rank  # pickle cannot send it back to rank 0


def inject_fault(llm, at_call: int) -> None:
    prepare = llm.core.runner.prepare
    calls = [0]

    def failing(inputs):
        calls[0] += 1
        if calls[0] == at_call:
            raise RuntimeError("injected fault on this rank")
        return prepare(inputs)

    llm.core.runner.prepare = failing


if __name__ == "__main__":
    main()
