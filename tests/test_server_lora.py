"""Multi-LoRA serving, vLLM's way: adapters named at start (`--lora-modules`, `serve(lora_modules=...)`) are listed by
`/v1/models` after the model, a request's `model` picks one by name, and `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` change them at run time. The real `openai` client against a real server on a loopback port,
on a tiny Llama with PEFT adapters; each answer equals the offline engine's with the same adapter."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from lora_adapters import make_adapters
from prometheus_client.parser import text_string_to_metric_families
from server_process import save_chat_checkpoint, wait_for_health
from transformers import AutoModelForCausalLM, AutoTokenizer

import hybridkv
from hybridkv import SamplingParams
from hybridkv.serving import cli

from lazy_modules import lazy_import

openai = lazy_import("openai")  # loaded by the first test that uses it (tests/lazy_modules.py)

MODEL = "tiny-llama"
CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
LORA_SETTINGS = {"max_model_len": 256, "block_size": 8, "num_blocks": 128, "enable_lora": True, "max_loras": 2}
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SAME_SETTINGS = {
    "max_tokens": NEW_TOKENS,
    "temperature": 0,
    "extra_body": {"ignore_eos": True, "return_token_ids": True},
}
LONG_TOKENS = 200
DEADLINE_SECONDS = 30


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_chat_checkpoint(tmp_path_factory.mktemp("checkpoint"), CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Three PEFT adapters of the checkpoint (a0, a1, a2; lora_int_ids 1, 2, 3); the server starts with a0 and a1."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    return make_adapters(model, tmp_path_factory.mktemp("adapters"), 3)


def load(checkpoint, **settings):
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    return model, hybridkv.patch(model, tokenizer=AutoTokenizer.from_pretrained(checkpoint), **settings)


@pytest.fixture(scope="module")
def offline(checkpoint):
    """An engine of its own on the same checkpoint: what the server must answer, adapter for adapter."""
    model, llm = load(checkpoint, **LORA_SETTINGS)
    yield llm
    hybridkv.unpatch(model)


@pytest.fixture(scope="module")
def server(checkpoint, adapters):
    model, llm = load(checkpoint, **LORA_SETTINGS)
    handle = hybridkv.serve(llm, port=0, model_name=MODEL, lora_modules=adapters[:2])
    yield handle
    handle.stop()
    hybridkv.unpatch(model)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_SECONDS)


def offline_text(offline, prompt, adapter):
    return offline_output(offline, prompt, adapter).text


def offline_output(offline, prompt, adapter):
    return offline.generate(prompt, GREEDY, lora_request=adapter, use_tqdm=False)[0].outputs[0]


def lora_requests_served(server) -> dict[str, float]:
    """`hybridkv_lora_requests_total` by adapter, read from /metrics."""
    text = httpx.get(server.url + "/metrics").text
    (family,) = (f for f in text_string_to_metric_families(text) if f.name == "hybridkv_lora_requests")
    return {s.labels["adapter"]: s.value for s in family.samples if s.name.endswith("_total")}


def load_adapter(server, name, path):
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def error_message(response):
    return response.json()["error"]["message"]


def test_lora_modules_take_vllms_two_forms_numbered_in_order():
    as_json = '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}'
    argv = ["serve", "m", "--enable-lora", "--lora-modules", "sql=/a/sql", as_json]
    args = cli.build_parser().parse_args([*argv, "--max-loras", "2", "--max-lora-rank", "32"])
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 2, 32)
    requests = cli.lora_requests(args.lora_modules)
    assert [(r.lora_name, r.lora_int_id, r.lora_path, r.base_model_name) for r in requests] == [
        ("sql", 1, "/a/sql", None),
        ("chat", 2, "/a/chat", "m"),
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lora-modules", "sql=/a/sql"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "sql"], "expected name=path or a JSON object, got 'sql'"),
        (["--enable-lora", "--lora-modules", '{"name": "sql"}'], "expected a JSON object with 'name' and 'path'"),
        (["--enable-lora", "--lora-modules", '{"name": "sql", "path": 3}'], "must be strings"),
    ],
)
def test_a_bad_lora_modules_flag_is_refused_before_anything_loads(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "m", *argv])
    assert message in capsys.readouterr().err


def test_models_lists_the_model_then_each_adapter_with_its_folder(client, adapters):
    cards = client.models.list().data
    assert [card.id for card in cards] == [MODEL, "a0", "a1"]
    assert [(card.root, card.parent) for card in cards[1:]] == [(a.lora_path, MODEL) for a in adapters[:2]]
    assert cards[0].parent is None


def test_a_completion_runs_the_adapter_its_model_names(client, offline, adapters):
    """The model's name runs the model alone, an adapter's name that adapter: the offline engine's tokens for each,
    and each differs from the others (the adapters change the tokens)."""
    expected = [offline_output(offline, "The quick", adapter) for adapter in (None, *adapters[:2])]
    assert len({tuple(output.token_ids) for output in expected}) == 3
    for name, output in zip([MODEL, "a0", "a1"], expected, strict=True):
        response = client.completions.create(model=name, prompt="The quick", **SAME_SETTINGS)
        (choice,) = response.choices
        assert (response.model, choice.token_ids, choice.text) == (name, list(output.token_ids), output.text)


def test_a_streamed_chat_runs_its_adapter(client, offline, adapters):
    expected = offline.chat(MESSAGES, GREEDY, lora_request=adapters[1], use_tqdm=False)[0].outputs[0].text
    chunks = list(client.chat.completions.create(model="a1", messages=MESSAGES, stream=True, **SAME_SETTINGS))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == expected
    assert {chunk.model for chunk in chunks} == {"a1"}


def test_concurrent_requests_with_different_adapters_each_get_their_own_answer(client, offline, adapters):
    """Base and both adapters at once, in one batch (max_loras=2 holds both adapters)."""
    names = [MODEL, "a0", "a1"] * 4
    prompts = [f"The quick {i}" for i in range(len(names))]
    lora_of = {MODEL: None, "a0": adapters[0], "a1": adapters[1]}
    expected = [offline_text(offline, p, lora_of[n]) for p, n in zip(prompts, names, strict=True)]

    def complete(name, prompt):
        return client.completions.create(model=name, prompt=prompt, **SAME_SETTINGS).choices[0].text

    with ThreadPoolExecutor(len(names)) as pool:
        assert list(pool.map(complete, names, prompts)) == expected


def test_an_unknown_model_is_a_404_naming_what_is_served(client):
    with pytest.raises(openai.NotFoundError, match=r"this server serves 'tiny-llama' and its LoRA adapters 'a0', 'a1'"):
        client.completions.create(model="a9", prompt="The quick", max_tokens=2)


def test_an_adapter_loaded_at_run_time_serves_until_unloaded(server, client, offline, adapters):
    added = load_adapter(server, "a2", adapters[2].lora_path)
    assert (added.status_code, added.text) == (200, "Success: LoRA adapter 'a2' added successfully.")
    assert [card.id for card in client.models.list().data] == [MODEL, "a0", "a1", "a2"]
    expected = offline_text(offline, "Once upon", adapters[2])
    assert client.completions.create(model="a2", prompt="Once upon", **SAME_SETTINGS).choices[0].text == expected
    deadline = time.monotonic() + DEADLINE_SECONDS
    while lora_requests_served(server).get("a2") != 1.0:  # recorded when the request's handle finishes
        assert time.monotonic() < deadline, lora_requests_served(server)
        time.sleep(0.05)

    again = load_adapter(server, "a2", adapters[2].lora_path)
    assert again.status_code == 400 and "a LoRA adapter named 'a2' is already served" in error_message(again)
    removed = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert (removed.status_code, removed.text) == (200, "Success: LoRA adapter 'a2' removed successfully.")
    assert [card.id for card in client.models.list().data] == [MODEL, "a0", "a1"]
    with pytest.raises(openai.NotFoundError, match="model 'a2' does not exist"):
        client.completions.create(model="a2", prompt="Once upon", max_tokens=2)
    gone = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert gone.status_code == 404 and "no LoRA adapter named 'a2' is served" in error_message(gone)


def test_unloading_an_adapter_lets_its_running_request_finish_with_it(server, client, offline, adapters):
    """A stream running a2 when a2 is unloaded (by vLLM's lora_int_id) runs a2 to its last token."""
    before = server.engine.llm.list_loras()
    loaded = load_adapter(server, "a2", adapters[2].lora_path)
    assert loaded.status_code == 200
    (lora_int_id,) = server.engine.llm.list_loras() - before
    params = SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True)
    expected = offline.generate("Once upon", params, lora_request=adapters[2], use_tqdm=False)[0].outputs[0].text
    settings = {**SAME_SETTINGS, "max_tokens": LONG_TOKENS}
    stream = client.completions.create(model="a2", prompt="Once upon", stream=True, **settings)
    text = next(stream).choices[0].text
    removed = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_int_id": lora_int_id})
    assert removed.status_code == 200
    assert server.engine.stats()["num_running"] == 1  # unloaded while it runs
    text += "".join(chunk.choices[0].text for chunk in stream)
    assert text == expected


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"lora_name": "x", "lora_path": "/no/such/folder"}, 400, "adapter 'x': lora_path '/no/such/folder' is not a"),
        ({"lora_name": MODEL, "lora_path": "/no/such/folder"}, 400, "'tiny-llama' is the served model's name"),
        ({"lora_name": "a0", "lora_path": "/no/such/folder"}, 400, "a LoRA adapter named 'a0' is already served"),
        ({"lora_name": "x"}, 400, "the field 'lora_path' is required"),
    ],
)
def test_a_bad_load_is_a_400_with_the_reason_and_changes_nothing(server, client, body, status, message):
    response = httpx.post(server.url + "/v1/load_lora_adapter", json=body)
    assert response.status_code == status and message in error_message(response)
    assert [card.id for card in client.models.list().data] == [MODEL, "a0", "a1"]


def test_an_adapter_above_max_lora_rank_is_refused_with_the_engines_message(server, checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    (wide,) = make_adapters(model, tmp_path, 1, ranks=[32])
    response = load_adapter(server, "wide", wide.lora_path)
    assert response.status_code == 400 and "max_lora_rank" in error_message(response)


def test_a_server_without_lora_refuses_adapters_naming_the_flag(checkpoint, adapters):
    model, llm = load(checkpoint, max_model_len=64, block_size=8, num_blocks=32)
    try:
        with pytest.raises(ValueError, match="serve with --enable-lora"):
            hybridkv.serve(llm, port=0, model_name=MODEL, lora_modules=adapters[:1])
        with hybridkv.serve(llm, port=0, model_name=MODEL) as handle:  # the refused launch left the engine free
            response = load_adapter(handle, "a0", adapters[0].lora_path)
        assert response.status_code == 400 and "restart it with --enable-lora" in error_message(response)
    finally:
        hybridkv.unpatch(model)


def test_a_bad_lora_module_fails_the_launch_with_the_engines_message(checkpoint, tmp_path):
    missing = str(tmp_path / "none")
    argv = ["serve", str(checkpoint), "--enable-lora", "--lora-modules", f"bad={missing}", "--threads", "1"]
    with pytest.raises(SystemExit, match=re.escape(f"hybridkv serve: adapter 'bad': lora_path {missing!r} is not a")):
        cli.main([*argv, "--max-model-len", "64", "--num-blocks", "32"])


@pytest.mark.slow
def test_the_serve_command_serves_its_lora_modules(checkpoint, adapters, offline):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    json_module = f'{{"name": "a1", "path": "{adapters[1].lora_path}", "base_model_name": "{MODEL}"}}'
    command = [sys.executable, "-m", "hybridkv", "serve", str(checkpoint), "--port", str(port), "--threads", "1"]
    command += ["--served-model-name", MODEL, "--max-model-len", "128", "--enable-lora", "--max-loras", "2"]
    command += ["--lora-modules", f"a0={adapters[0].lora_path}", json_module]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ)
    try:
        wait_for_health(process, port, 60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [(card.id, card.parent) for card in client.models.list().data] == [
            (MODEL, None),
            ("a0", MODEL),
            ("a1", MODEL),
        ]
        for adapter in adapters[:2]:
            response = client.completions.create(model=adapter.lora_name, prompt="The quick", **SAME_SETTINGS)
            assert response.choices[0].text == offline_text(offline, "The quick", adapter)
    finally:
        process.terminate()
        process.wait(timeout=30)
