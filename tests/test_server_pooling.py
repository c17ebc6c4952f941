"""The server of a pooling model (hybridkv/serving/pooling_app.py): OpenAI's `/v1/embeddings` and vLLM's `/classify`,
`/score` and `/rerank`, each answering what the pooling engine computes, through the `openai` client too."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from server_process import wait_for_health
from transformers import LlamaForSequenceClassification

from hybridkv import LLM
from hybridkv.serving.pooling_app import build_pooling_app
from hybridkv.tiny import tiny_config, tiny_model

from lazy_modules import lazy_import
from tiny_tokenizer import tiny_tokenizer

openai = lazy_import("openai")  # loaded by the first test that uses it (tests/lazy_modules.py)

TEXTS = ["Hello, my name is", "The capital of France is"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny Llama causal LM (embedded) and a one-label Llama classifier (a cross-encoder), saved."""
    paths = {}
    vocab = len(tiny_tokenizer())
    torch.manual_seed(1)
    models = {"embed": tiny_model("llama", vocab_size=vocab)}
    models["score"] = LlamaForSequenceClassification(tiny_config("llama", vocab_size=vocab, num_labels=1)).eval()
    for kind, model in models.items():
        path = tmp_path_factory.mktemp(kind)
        tiny_tokenizer().save_pretrained(path)
        model.save_pretrained(path)
        paths[kind] = str(path)
    return paths


def test_embeddings_as_floats_and_base64_are_the_engines(checkpoints):
    llm = LLM(model=checkpoints["embed"], runner="pooling")
    client = TestClient(build_pooling_app(llm.llm_engine, "emb", api_key="k"))
    headers = {"Authorization": "Bearer k"}
    expected = [out.outputs.embedding for out in llm.embed(TEXTS, use_tqdm=False)]
    reply = client.post("/v1/embeddings", json={"model": "emb", "input": TEXTS}, headers=headers).json()
    assert [item["embedding"] for item in reply["data"]] == expected
    assert reply["object"] == "list" and reply["usage"]["prompt_tokens"] == sum(
        len(llm.tokenizer(text)["input_ids"]) for text in TEXTS
    )
    packed = client.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}, headers=headers)
    unpacked = np.frombuffer(base64.b64decode(packed.json()["data"][0]["embedding"]), dtype="<f4")
    alone = llm.embed(TEXTS[0], use_tqdm=False)[0].outputs.embedding  # one prompt: no batch's rounding
    np.testing.assert_array_equal(unpacked, np.asarray(alone, dtype=np.float32))
    assert client.post("/v1/embeddings", json={"input": TEXTS}).status_code == 401
    wrong = client.post("/v1/embeddings", json={"model": "other", "input": TEXTS}, headers=headers)
    assert wrong.status_code == 404 and "'emb'" in wrong.json()["error"]["message"]
    generate = client.post("/v1/completions", json={"prompt": "a"}, headers=headers)
    assert generate.status_code == 400 and "pooling model" in generate.json()["error"]["message"]
    refused = client.post("/classify", json={"input": TEXTS}, headers=headers)
    assert refused.status_code == 400 and "serves embed" in refused.json()["error"]["message"]


def test_the_pooling_route_runs_any_task_of_the_model(checkpoints):
    llm = LLM(model=checkpoints["score"])
    client = TestClient(build_pooling_app(llm.llm_engine, "clf"))
    reply = client.post("/pooling", json={"input": TEXTS}).json()  # the model's default task: classify
    assert reply["object"] == "list" and [item["object"] for item in reply["data"]] == ["pooling", "pooling"]
    probs = [out.outputs.probs for out in llm.classify(TEXTS, use_tqdm=False)]
    assert [item["data"] for item in reply["data"]] == probs
    per_token = client.post("/pooling", json={"input": TEXTS[0], "task": "token_classify"}).json()["data"][0]["data"]
    assert per_token == llm.reward(TEXTS[0], use_tqdm=False)[0].outputs.data.tolist()
    packed = client.post("/pooling", json={"input": TEXTS[0], "task": "token_classify", "encoding_format": "base64"})
    unpacked = np.frombuffer(base64.b64decode(packed.json()["data"][0]["data"]), dtype="<f4")
    np.testing.assert_array_equal(unpacked, np.asarray(per_token, dtype=np.float32).flatten())
    refused = client.post("/pooling", json={"input": TEXTS[0], "task": "embed"})
    assert refused.status_code == 400 and "not 'embed'" in refused.json()["error"]["message"]


def test_vllms_dev_endpoints_sleep_and_wake_a_pooling_server(checkpoints, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    llm = LLM(model=checkpoints["embed"], runner="pooling")
    client = TestClient(build_pooling_app(llm.llm_engine, "emb"))
    expected = client.post("/v1/embeddings", json={"input": TEXTS}).json()["data"]
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert client.post("/sleep", params={"level": 1}).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    asleep = client.post("/v1/embeddings", json={"input": TEXTS})
    assert asleep.status_code == 503 and "wake_up()" in asleep.json()["error"]["message"]
    assert client.post("/wake_up", params=[("tags", "weights")]).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert client.post("/v1/embeddings", json={"input": TEXTS}).json()["data"] == expected
    assert client.post("/reset_prefix_cache").status_code == 200
    refused = client.post("/sleep", params={"level": 3})
    assert refused.status_code == 400 and "level must be 1 or 2" in refused.json()["error"]["message"]
    rpc = client.post("/collective_rpc", json={"method": "reload_weights"})
    assert rpc.status_code == 400 and "without a worker" in rpc.json()["error"]["message"]
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
    assert TestClient(build_pooling_app(llm.llm_engine, "emb")).post("/sleep").status_code == 404


def test_score_rerank_and_classify_are_the_cross_encoders(checkpoints):
    llm = LLM(model=checkpoints["score"])
    client = TestClient(build_pooling_app(llm.llm_engine, "rerank"))
    documents = ["Brasilia is.", "Paris is.", "Rome is."]
    scores = [out.outputs.score for out in llm.score("Which capital?", documents, use_tqdm=False)]
    reply = client.post("/score", json={"text_1": "Which capital?", "text_2": documents}).json()
    assert [item["score"] for item in reply["data"]] == scores
    ranked = client.post("/v1/rerank", json={"query": "Which capital?", "documents": documents, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["relevance_score"] for r in ranked["results"]] == [scores[i] for i in order]
    classified = client.post("/classify", json={"input": TEXTS[0]}).json()["data"][0]
    assert classified["probs"] == llm.classify(TEXTS[0], use_tqdm=False)[0].outputs.probs
    assert classified["num_classes"] == 1 and classified["label"] == "LABEL_0"


@pytest.mark.slow
def test_the_serve_command_serves_embeddings_to_the_openai_client(checkpoints):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "hybridkv", "serve", checkpoints["embed"], "--runner", "pooling"]
    command += ["--port", str(port), "--served-model-name", "emb", "--threads", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ)
    try:
        wait_for_health(process, port, 60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.embeddings.create(model="emb", input=TEXTS)  # the client asks for base64 by default
        llm = LLM(model=checkpoints["embed"], runner="pooling")
        for item, out in zip(reply.data, llm.embed(TEXTS, use_tqdm=False), strict=True):
            np.testing.assert_allclose(item.embedding, out.outputs.embedding, rtol=0, atol=1e-6)
    finally:
        process.terminate()
        process.wait(timeout=30)
