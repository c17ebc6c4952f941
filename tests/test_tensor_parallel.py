"""Tensor parallelism on the CPU: a tiny checkpoint loaded with transformers' `tp_plan="auto"` under
`torchrun --nproc_per_node 2` (gloo), served by hybridkv (tests/tp_script.py runs on both ranks).

Greedy tokens under TP equal the single-process engine's and `model.generate`'s, for a full-attention
model, a Gemma-3-style hybrid, DeepSeek-V3 (latent attention; with transformers' plan, and with a plan
that splits its heads across the ranks) and Jamba and MiniMax (state layers, whole on each rank: transformers' plans
split their attention heads only), with chunked prefill, prefix caching and tiny pools (preemption
by recompute and by swap); beam search too; each rank holds half the single-process KV bytes (the whole
latent for DeepSeek, whose heads share it); a fault on rank 1 fails the step's requests on rank 0, which
keeps serving; rank 1's public calls are refused; every process exits. And `hybridkv serve` under
torchrun serves from rank 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from server_process import wait_for_health

import hybridkv
from hybridkv import BeamSearchParams, SamplingParams
from hybridkv.tiny import tiny_model

from model_zoo import LATENT, STATE
from tiny_models import prompts
from tiny_tokenizer import tiny_tokenizer

SCRIPT = Path(__file__).resolve().parent / "tp_script.py"
MAX_NEW = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma3", "deepseek_v3", "deepseek_v3_heads_split", "jamba", "minimax"])
def test_tensor_parallel_engine_matches_one_process(tmp_path, family, patched):
    # 4 query heads and 2 KV heads: each of the 2 ranks holds 2 and 1 (the hybrid's window, 16, slides). DeepSeek-V3's
    # latent attention is not split by transformers 5.24's plan (its experts and MLPs are; 5.25's splits its heads):
    # every rank pages the latent.
    # With a plan that splits its heads too (each rank: its heads' rows of q_b_proj and kv_b_proj, o_proj's columns),
    # every rank still pages the whole latent, which its heads share, and attends through its own up-projection rows.
    if family.startswith("deepseek_v3"):
        model = LATENT["deepseek_v3"]()
    elif family in STATE:  # transformers' plan splits their attention heads; the state layers run whole on each rank
        model = STATE[family]()
    else:
        model = tiny_model(family, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    batch = prompts((9, 40, 70), seed=4)
    checkpoint = tmp_path / family
    model.save_pretrained(checkpoint)
    (checkpoint / "prompts.json").write_text(json.dumps(batch))
    if family == "deepseek_v3_heads_split":  # rules over transformers' plan (tests/tp_script.py)
        heads = {"q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise"}
        plan = {f"model.layers.*.self_attn.{name}": style for name, style in heads.items()}
        (checkpoint / "tp_plan.json").write_text(json.dumps(plan))
    llm = patched(model, block_size=8, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    expected = [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]
    expected_beams = [
        [s.output_token_ids for s in o.sequences]
        for o in llm.beam_search(batch[:2], BeamSearchParams(beam_width=3, max_tokens=6), use_tqdm=False)
    ]
    one_process_bytes = llm.stats()["kv_cache_bytes"] / llm.stats()["num_blocks"]
    hybridkv.unpatch(model)

    out = tmp_path / "seen"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(SCRIPT), str(checkpoint), str(out),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    driver, worker = (json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1))

    if family.startswith("deepseek_v3"):
        rows = model.model.layers[0].self_attn.kv_b_proj.out_features
        # transformers 5.25's own plan splits the heads too (5.24's split the experts and MLPs only).
        splits_heads = (model.config.base_model_tp_plan or {}).get("layers.*.self_attn.kv_b_proj") == "colwise"
        split = 2 if family == "deepseek_v3_heads_split" or splits_heads else 1
        assert driver["up_projection_rows"] == worker["up_projection_rows"] == [rows // split]
    assert driver["generate"] == worker["generate"] == expected  # transformers' own TP generate agrees
    assert driver["default"] == expected
    # collective_rpc: each rank's worker answered, in rank order; a lambda is refused before anything is sent, rank
    # 1's error is raised on rank 0, and so is a result pickle cannot send back (then the engine served on).
    assert driver["rpc"] == [["0 of 2", True], ["1 of 2", True]]
    assert "pickle cannot send" in driver["rpc_lambda_error"]
    assert "collective_rpc failed on rank 1: rank 1 refuses" in driver["rpc_rank1_error"]
    assert "collective_rpc failed on rank 0" in driver["rpc_result_error"] and "pickle" in driver["rpc_result_error"]
    assert driver["speculative"] == expected and driver["spec_num_accepted_tokens"] > 0  # proposals checked on 2 ranks
    assert driver["draft_model"] == expected and driver["draft_acceptance_rate"] > 0.9  # a draft on rank 0 alone
    assert driver["chunked_cached"] == [expected, expected] and driver["prefix_cache_hits"] > 0
    assert driver["tiny_pool"] == driver["tiny_pool_swap"] == expected
    assert driver["preemptions_recompute"] > 0 and driver["preemptions_swap"] > 0
    assert driver["beams"] == expected_beams
    # Rank 1 failed its third step: those requests failed on rank 0 with the reason, the others finished
    # exactly, and the engine served the next call.
    errors = driver["fault_errors"]
    assert any(e and "another rank of the tensor-parallel group" in e for e in errors)
    assert driver["after_fault"] == expected
    assert "rank 1 of a tensor-parallel engine is a worker" in worker["worker_error"]
    # Each rank's pages hold its own KV heads: half the bytes per block, the same block count on both ranks.
    for name in ("default", "tiny_pool"):
        assert driver[f"{name}_num_blocks"] == worker[f"{name}_num_blocks"]
        assert driver[f"{name}_kv_cache_bytes"] == worker[f"{name}_kv_cache_bytes"]
        shards = 1 if family.startswith("deepseek_v3") else 2
        assert driver[f"{name}_kv_cache_bytes"] / driver[f"{name}_num_blocks"] == one_process_bytes / shards
    # This test's own ranks only (their command lines hold its temporary folder), not another run's on the machine.
    leftover = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
    assert leftover.stdout == "", "a rank outlived torchrun"


def replayed_event_types(endpoint: str) -> set[str]:
    """The types of every KV event a publisher's replay socket keeps (vLLM's replay: from sequence number 0)."""
    import msgpack
    import zmq

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(endpoint)
    socket.send_multipart([b"", (0).to_bytes(8, "big")])
    types = set()
    try:
        while socket.poll(10_000):
            _, _, seq, payload = socket.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return types
            types.update(event["type"] for event in msgpack.unpackb(payload)[1])
        raise AssertionError("no end of the replay")
    finally:
        socket.close(linger=0)


@pytest.mark.slow  # two ranks under torchrun, in subprocesses
def test_hybridkv_serve_under_torchrun_serves_from_rank_0(tmp_path, patched):
    """`torchrun --nproc_per_node 2 -m hybridkv serve --model PATH`: the checkpoint is sharded, rank 0
    serves OpenAI's API and publishes the KV events (alone: rank 1 opens no socket), rank 1 runs the worker loop;
    Ctrl-C stops both."""
    httpx = pytest.importorskip("httpx")
    tokenizer = tiny_tokenizer()
    model = tiny_model("gemma3", vocab_size=len(tokenizer), num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = patched(model, tokenizer=tokenizer, max_model_len=128)
    expected = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), "-m", "hybridkv", "serve", "--model", str(tmp_path),
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "128", "--threads", "1",
        "--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/events",
            "replay_endpoint": f"ipc://{tmp_path}/replay",
        }),
    ]  # fmt: skip
    server = subprocess.Popen(command, env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for_health(server, port, 120)
        body = {"model": str(tmp_path), "prompt": "The quick", "max_tokens": 8, "temperature": 0}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        assert response["choices"][0]["text"] == expected.text
        assert replayed_event_types(f"ipc://{tmp_path}/replay") >= {"BlockStored"}
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            raise
    # The server's own session (start_new_session): its ranks, not another process on the machine.
    leftover = subprocess.run(["pgrep", "-s", str(server.pid)], capture_output=True, text=True)
    assert leftover.stdout == "", "a rank outlived the server"
