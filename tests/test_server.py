"""The OpenAI-compatible server: a real uvicorn server on a loopback port, called with the real `openai`
client (and httpx where the exact bytes matter), against a tiny checkpoint whose tokenizer has a chat
template; its answers are compared with the offline engine's for the same prompts and settings."""

import functools
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field
from server_process import save_chat_checkpoint, wait_for_health
from transformers import AutoModelForCausalLM, AutoTokenizer

import hybridkv
from hybridkv import SamplingParams
from hybridkv.engine.chat import ChatOptions, chat_prompt, render_chat

from lazy_modules import lazy_import

openai = lazy_import("openai")  # loaded by the first test that uses it (tests/lazy_modules.py)

MODEL = "tiny-llama"
MAX_MODEL_LEN = 512
SETTINGS = {"max_model_len": MAX_MODEL_LEN, "block_size": 8, "num_blocks": 256}
CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "The quick brown fox"}]
GREEDY = SamplingParams(temperature=0, max_tokens=8)
DEADLINE_SECONDS = 30


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_chat_checkpoint(tmp_path_factory.mktemp("checkpoint"), CHAT_TEMPLATE)


def load(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return model, hybridkv.patch(model, tokenizer=tokenizer, **SETTINGS)


@pytest.fixture(scope="module")
def offline(checkpoint):
    """An engine of its own on the same checkpoint: what the server must answer."""
    model, llm = load(checkpoint)
    yield llm
    hybridkv.unpatch(model)


@pytest.fixture(scope="module")
def server(checkpoint):
    model, llm = load(checkpoint)
    handle = hybridkv.serve(llm, port=0, model_name=MODEL)
    yield handle
    handle.stop()
    hybridkv.unpatch(model)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_SECONDS)


def wait_until_idle(server):
    deadline = time.monotonic() + DEADLINE_SECONDS
    while (stats := server.engine.stats())["blocks_in_use"] or stats["num_running"] or stats["num_waiting"]:
        assert time.monotonic() < deadline, f"still in use after {DEADLINE_SECONDS} s: {stats}"
        time.sleep(0.05)
    return stats


def test_models_lists_the_served_name(client):
    (card,) = client.models.list().data
    assert (card.id, card.owned_by) == (MODEL, "hybridkv")


def test_a_completion_equals_the_offline_engines_output(client, offline):
    expected = offline.generate("The quick", GREEDY, use_tqdm=False)[0]
    response = client.completions.create(model=MODEL, prompt="The quick", max_tokens=8, temperature=0)
    (choice,) = response.choices
    assert (choice.text, choice.finish_reason) == (expected.outputs[0].text, expected.outputs[0].finish_reason)
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_a_streamed_completion_is_the_completion_in_pieces(client, offline):
    expected = offline.generate("Once upon", GREEDY, use_tqdm=False)[0].outputs[0]
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8, temperature=0, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_extra_sampling_fields_reach_the_engine(client, offline):
    params = SamplingParams(temperature=0.8, top_k=5, min_p=0.05, seed=3, max_tokens=10, ignore_eos=True)
    expected = offline.generate("The quick", params, use_tqdm=False)[0].outputs[0]
    response = client.completions.create(
        model=MODEL,
        prompt="The quick",
        max_tokens=10,
        temperature=0.8,
        seed=3,
        extra_body={"top_k": 5, "min_p": 0.05, "ignore_eos": True},
    )
    assert response.choices[0].text == expected.text
    assert response.usage.completion_tokens == 10


def test_best_of_returns_the_engines_best_samples_and_is_not_streamed(client, offline):
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    expected = offline.generate("The quick", params, use_tqdm=False)[0].outputs
    response = client.completions.create(
        model=MODEL, prompt="The quick", n=2, best_of=4, max_tokens=6, temperature=1.0, seed=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in response.choices] == [c.text for c in expected]
    with pytest.raises(openai.BadRequestError, match=r"best_of=4 > n=2 cannot be streamed"):
        client.completions.create(model=MODEL, prompt="The quick", n=2, best_of=4, max_tokens=6, stream=True)


def test_a_chat_renders_the_template_and_streams_the_same_text(client, offline):
    prompt = render_chat(offline.tokenizer, MESSAGES)
    prompt_ids = offline.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    expected = offline.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True)
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert response.choices[0].message.content == expected.outputs[0].text == streamed
    assert (response.choices[0].message.role, chunks[0].choices[0].delta.role) == ("assistant", "assistant")
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens


def test_text_content_parts_are_the_text_and_any_other_part_is_a_400(server, client):
    """A list of text parts is the text they join; an image sent to a model that takes none, or a part of a kind
    no model here takes, would be dropped from the prompt and answered as if it had not been sent, so it is
    refused, and nothing is queued."""
    before = wait_until_idle(server)["num_generated_tokens"]
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    as_parts = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0)
    as_text = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    for content, reason in (
        ([{"type": "text", "text": "What is in this picture?"}, image], "takes no images"),
        ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "part 0 is of type 'input_audio'"),
        ([{"type": "text"}], "part 0 \\(type 'text'\\) needs a string 'text'"),
    ):
        with pytest.raises(openai.BadRequestError, match=reason):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4)
    # Only the two text chats generated: no refused request reached the engine.
    generated = as_parts.usage.completion_tokens + as_text.usage.completion_tokens
    assert wait_until_idle(server)["num_generated_tokens"] == before + generated


def test_a_chat_with_include_usage_ends_with_a_usage_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_n_samples_and_logprobs(client):
    response = client.completions.create(model=MODEL, prompt="The quick", max_tokens=4, n=3, seed=1, logprobs=2)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    for choice in response.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == 4
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert response.usage.completion_tokens == 12


def test_streamed_logprobs_are_the_non_streamed_ones_in_pieces(client):
    """Completions (n=2, seeded) and chat: the chunks' logprobs, joined, equal the whole response's, text
    offsets included; a token whose text is held back brings its logprobs with the chunk that shows it."""
    settings = dict(model=MODEL, prompt="The quick", max_tokens=10, n=2, seed=3, temperature=1.0, logprobs=3)
    # Each pair compared takes its prompt from the prefix cache alike: a prompt computed whole and one whose last
    # token is computed after a hit round apart (1e-6 in a logprob with torch's two CPU threads).
    client.completions.create(**settings)
    whole = client.completions.create(**settings)
    pieces: dict[int, dict[str, list]] = {}
    for chunk in client.completions.create(**settings, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                joined = pieces.setdefault(choice.index, {"tokens": [], "token_logprobs": [], "top": [], "offsets": []})
                joined["tokens"] += choice.logprobs.tokens
                joined["token_logprobs"] += choice.logprobs.token_logprobs
                joined["top"] += choice.logprobs.top_logprobs
                joined["offsets"] += choice.logprobs.text_offset
    for choice in whole.choices:
        joined = pieces[choice.index]
        assert joined["tokens"] == choice.logprobs.tokens and len(joined["tokens"]) == 10
        assert joined["token_logprobs"] == choice.logprobs.token_logprobs
        assert joined["top"] == choice.logprobs.top_logprobs
        assert joined["offsets"] == choice.logprobs.text_offset

    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    client.chat.completions.create(**chat)
    expected = client.chat.completions.create(**chat).choices[0].logprobs.content
    streamed = [
        entry
        for chunk in client.chat.completions.create(**chat, stream=True)
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in expected] and len(expected) == 10


def test_tokenize_and_detokenize_give_the_ids_the_server_runs(server, offline):
    tokenizer = offline.tokenizer
    post = functools.partial(httpx.post, timeout=DEADLINE_SECONDS)
    body = post(server.url + "/tokenize", json={"model": MODEL, "prompt": "The quick brown fox"}).json()
    expected = tokenizer("The quick brown fox", add_special_tokens=True)["input_ids"]
    assert body == {"tokens": expected, "count": len(expected), "max_model_len": MAX_MODEL_LEN}
    chat = post(server.url + "/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    rendered = render_chat(tokenizer, MESSAGES)
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    text = post(server.url + "/detokenize", json={"model": MODEL, "tokens": expected}).json()["prompt"]
    assert text == tokenizer.decode(expected)
    for path, payload, message in (
        ("/tokenize", {"model": MODEL}, "send either a prompt or messages"),
        ("/tokenize", {"model": MODEL, "prompt": "a", "messages": MESSAGES}, "send either a prompt or messages"),
        ("/detokenize", {"model": MODEL, "tokens": [len(tokenizer)]}, "outside the vocabulary"),
        ("/tokenize", {"model": "gpt-4", "prompt": "a"}, "does not exist"),
    ):
        response = post(server.url + path, json=payload)
        assert response.status_code in (400, 404) and message in response.json()["error"]["message"]


def test_get_server_info_names_the_model_the_block_size_and_the_instance(server, checkpoint):
    """What vllm-router's kv_aware discovery reads (model_id, kv_block_size, instance_id), and SGLang's model info."""
    info = httpx.get(server.url + "/get_server_info", timeout=DEADLINE_SECONDS).json()
    assert re.fullmatch(r"[0-9a-f]{32}", info.pop("instance_id"))
    assert info == {"model_id": MODEL, "model_path": MODEL, "kv_block_size": SETTINGS["block_size"]}
    model_info = httpx.get(server.url + "/get_model_info", timeout=DEADLINE_SECONDS).json()
    assert model_info == {"model_path": MODEL, "tokenizer_path": str(checkpoint), "is_generation": True}
    assert httpx.get(server.url + "/kv_event_sources", timeout=DEADLINE_SECONDS).json() == {}  # no kv_events_config


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param("The quick brown fox", id="text"),
        pytest.param(["The quick", "Once upon a time"], id="texts"),
        pytest.param([5, 17, 42, 9], id="token-ids"),
        pytest.param([[5, 17], [42, 9, 11]], id="lists-of-token-ids"),
    ],
)
def test_a_completions_render_is_the_prompt_token_ids_the_completion_runs(server, prompt):
    """vLLM's /v1/completions/render, which vllm-router asks for a prompt's tokens to route by: one item per prompt,
    named as the completion's requests are, with the token ids the completion returns as prompt_token_ids."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "return_token_ids": True}
    post = functools.partial(httpx.post, timeout=DEADLINE_SECONDS, headers={"X-Request-Id": "r-1"})
    ran = post(server.url + "/v1/completions", json=body).json()
    response = post(server.url + "/v1/completions/render", json=body)
    rendered = response.json()
    assert [item["token_ids"] for item in rendered] == [choice["prompt_token_ids"] for choice in ran["choices"]]
    names = ["r-1", "r-1-1"][: len(rendered)]
    assert [(item["request_id"], item["features"], item["model"]) for item in rendered] == [
        (name, None, MODEL) for name in names
    ]
    assert response.headers["x-request-id"] == "r-1"


CONTINUED = [*MESSAGES, {"role": "assistant", "content": "The fox"}]
GREETING_TEMPLATE = "{{ greeting }}" + CHAT_TEMPLATE


@pytest.mark.parametrize(
    ("change", "options"),
    [
        pytest.param({}, ChatOptions(), id="plain"),
        pytest.param(
            {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True},
            ChatOptions(add_generation_prompt=False, continue_final_message=True),
            id="continue-final-message",
        ),
        pytest.param(
            {"chat_template": GREETING_TEMPLATE, "chat_template_kwargs": {"greeting": "Hello there"}},
            ChatOptions(GREETING_TEMPLATE, chat_template_kwargs={"greeting": "Hello there"}),
            id="template-and-kwargs",
        ),
    ],
)
def test_a_chat_render_is_the_prompt_token_ids_the_chat_runs(server, offline, change, options):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "return_token_ids": True, **change}
    post = functools.partial(httpx.post, timeout=DEADLINE_SECONDS)
    ran = post(server.url + "/v1/chat/completions", json=body).json()
    rendered = post(server.url + "/v1/chat/completions/render", json=body).json()
    _, expected = chat_prompt(offline.tokenizer, body["messages"], None, options)
    assert rendered["token_ids"] == ran["prompt_token_ids"] == expected
    assert rendered["features"] is None and rendered["request_id"].startswith("chatcmpl-")


@pytest.mark.parametrize(
    ("change", "status"),
    [
        pytest.param({"model": "gpt-4"}, 404, id="unknown-model"),
        pytest.param({"prompt": [5] * (MAX_MODEL_LEN + 1)}, 400, id="prompt-too-long"),
    ],
)
def test_a_render_refuses_the_prompt_the_completion_refuses_alike(server, change, status):
    body = {"model": MODEL, "prompt": "The quick", **change}
    post = functools.partial(httpx.post, timeout=DEADLINE_SECONDS)
    ran, rendered = (post(server.url + path, json=body) for path in ("/v1/completions", "/v1/completions/render"))
    assert (rendered.status_code, rendered.json()) == (ran.status_code, ran.json()) and ran.status_code == status


def test_a_chat_render_with_images_is_a_400_naming_why(server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]
    body = {"model": MODEL, "messages": messages}
    response = httpx.post(server.url + "/v1/chat/completions/render", json=body, timeout=DEADLINE_SECONDS)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("a chat with images is not rendered here")


def test_several_prompts_in_one_completion_and_echo(server, client, offline):
    """A list of prompts (text or token ids) runs them concurrently: prompt i's samples are choices i x n ..,
    streamed or not; echo puts the prompt before each choice's text, and with logprobs its tokens' logprobs."""
    prompts = ["The quick", "Once upon a time", "A tiny model"]
    expected = [o.outputs[0].text for o in offline.generate(prompts, GREEDY, use_tqdm=False)]
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in whole.choices] == [0, 1, 2] and [c.text for c in whole.choices] == expected
    ids = [offline.tokenizer(p)["input_ids"] for p in prompts]
    assert whole.usage.prompt_tokens == sum(map(len, ids))
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == expected
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(6)] == [text for text in expected for _ in range(2)]

    echoed = client.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=8, temperature=0, echo=True)
    rendered = [offline.tokenizer.decode(i) for i in ids[:2]]
    assert [c.text for c in echoed.choices] == [r + e for r, e in zip(rendered, expected, strict=False)]
    chunks = client.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == rendered[0] + expected[0]
    # echo with logprobs (OpenAI's): the prompt's tokens lead, the first without a logprob; not streamed.
    scored = client.completions.create(
        model=MODEL, prompt="The quick", max_tokens=2, temperature=0, echo=True, logprobs=1
    )
    logprobs = scored.choices[0].logprobs
    prompt_params = SamplingParams(temperature=0, max_tokens=2, logprobs=1, prompt_logprobs=1)
    (reference,) = offline.generate("The quick", prompt_params, use_tqdm=False)
    prompt_ids = reference.prompt_token_ids
    assert len(logprobs.tokens) == len(prompt_ids) + 2 and logprobs.token_logprobs[0] is None
    expected_logprobs = [reference.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt_ids) if i]
    sample = reference.outputs[0]
    expected_logprobs += [e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs, strict=True)]
    assert logprobs.token_logprobs[1:] == pytest.approx(expected_logprobs, abs=1e-5)
    assert "".join(logprobs.tokens) == scored.choices[0].text
    with pytest.raises(openai.BadRequestError, match="echo with logprobs is not streamed"):
        client.completions.create(model=MODEL, prompt="The quick", max_tokens=2, echo=True, logprobs=1, stream=True)
    with pytest.raises(openai.BadRequestError, match="a prompt is empty"):
        client.completions.create(model=MODEL, prompt=["The quick", ""], max_tokens=2)
    assert wait_until_idle(server)["blocks_in_use"] == 0


def test_a_long_prompt_is_tokenized_off_the_event_loop(server, client, monkeypatch):
    """While a long prompt is tokenized, /health answers: tokenizing runs in a worker thread, not on the loop. The
    tokenizer is held until /health has answered, so a tokenizer on the loop would leave /health unanswered (its
    request then fails on its timeout, and the tokenizer is let go)."""
    tokenizer = server.engine.llm.tokenizer
    original, threads, release = type(tokenizer).__call__, [], threading.Event()

    def held(self, *args, **kwargs):
        threads.append(threading.current_thread())
        release.wait(DEADLINE_SECONDS)  # a 50 MB prompt's tokenization, as long as the test needs
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", held)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.completions.create, model=MODEL, prompt="The quick", max_tokens=2)
        while not threads:
            time.sleep(0.01)
        try:
            health = httpx.get(server.url + "/health", timeout=10)
            assert not release.is_set() and health.status_code == 200  # answered while the tokenizer was held
        finally:
            release.set()
        assert pending.result(timeout=DEADLINE_SECONDS).choices[0].text is not None
    assert threads and all(t.name != "hybridkv-server" for t in threads)  # not the event loop's thread


def test_32_concurrent_clients_all_get_the_offline_answer(server, client, offline):
    prompts = [f"The quick brown fox {i}" for i in range(32)]
    expected = [o.outputs[0].text for o in offline.generate(prompts, GREEDY, use_tqdm=False)]

    def ask(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(ask, prompts, timeout=120))
    assert answers == expected
    wait_until_idle(server)


def test_a_client_that_disconnects_mid_stream_aborts_its_request(server):
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=DEADLINE_SECONDS) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: ") :])["choices"][0]["finish_reason"] is None
    stats = wait_until_idle(server)
    assert stats["blocks_in_use"] == 0
    assert 'hybridkv_request_finished_total{finish_reason="abort"}' in httpx.get(server.url + "/metrics").text


def engine_ids(server, monkeypatch):
    """The request ids the server's engine is given, in order, from now to the end of the test."""
    submit, given = server.engine.submit, []

    def recorded(prompt, params, request_id, lora_request=None):
        given.append(request_id)
        return submit(prompt, params, request_id, lora_request)

    monkeypatch.setattr(server.engine, "submit", recorded)
    return given


def sse_payloads(lines):
    return [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: {")]


def test_x_request_id_names_the_engine_request_and_comes_back_streamed_or_not(server, client, monkeypatch):
    """vLLM's request-id headers: the client's X-Request-Id is the request's id (the engine's, the response's `id`)
    and comes back as the response's X-Request-Id; it comes before a body's request_id (vLLM's order); with neither,
    the server's own id comes back."""
    given = engine_ids(server, monkeypatch)
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="The quick", max_tokens=4, extra_headers={"X-Request-Id": "client-1"}
    )
    assert (raw.headers["x-request-id"], raw.parse().id, given) == ("client-1", "client-1", ["client-1"])
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "client-2"}
    ) as response:
        chunks = sse_payloads(response.iter_lines())
    assert response.headers["x-request-id"] == "client-2" and given[-1] == "client-2"
    assert {chunk["id"] for chunk in chunks} == {"client-2"}
    named = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "The quick", "max_tokens": 4, "request_id": "body-3"},
        headers={"X-Request-Id": "client-3"},
    )
    assert (named.headers["x-request-id"], named.json()["id"], given[-1]) == ("client-3", "client-3", "client-3")
    own = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert own.headers["x-request-id"] == own.parse().id == given[-1] and given[-1].startswith("chatcmpl-")
    refused = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "The quick", "temperature": -1},
        headers={"X-Request-Id": "client-4"},
    )
    assert (refused.status_code, refused.headers["x-request-id"]) == (400, "client-4")


def test_a_request_id_that_cannot_be_a_header_is_the_responses_id_only(server):
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 2, "request_id": "two\nlines"}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=DEADLINE_SECONDS)
    assert response.json()["id"] == "two\nlines" and "x-request-id" not in response.headers


def test_a_prompt_list_runs_as_the_request_id_and_its_numbered_variants(server, client, monkeypatch):
    given = engine_ids(server, monkeypatch)
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=["The quick", "Once upon"], max_tokens=4, extra_headers={"X-Request-Id": "pair"}
    )
    assert (raw.headers["x-request-id"], raw.parse().id, given) == ("pair", "pair", ["pair", "pair-1"])


def test_two_requests_in_flight_with_one_x_request_id_each_get_their_own_answer(server, client, offline, monkeypatch):
    """A client's retry, or two clients behind a router, may send the same X-Request-Id while the first request
    runs: the second runs under a suffixed engine id, both answers are their own prompts', and both come back
    named as the client named them; once they end, the id is free again."""
    given = engine_ids(server, monkeypatch)
    execute = server.engine.llm.core.runner.execute

    def slow(*args, **kwargs):  # the first request's 40 steps take a second at least: the second comes meanwhile
        time.sleep(0.025)
        return execute(*args, **kwargs)

    monkeypatch.setattr(server.engine.llm.core.runner, "execute", slow)
    long_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected_long = offline.generate("Once upon", long_params, use_tqdm=False)[0].outputs[0].text
    expected_short = offline.generate("The quick", GREEDY, use_tqdm=False)[0].outputs[0].text
    header = {"X-Request-Id": "same"}
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=header
    ) as streamed:
        lines = streamed.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))  # the first request is in flight
        other = client.completions.with_raw_response.create(
            model=MODEL, prompt="The quick", max_tokens=8, temperature=0, extra_headers=header
        )
        chunks = sse_payloads([first, *lines])
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]) == expected_long
    assert (other.parse().choices[0].text, other.parse().id, other.headers["x-request-id"]) == (
        expected_short,
        "same",
        "same",
    )
    assert streamed.headers["x-request-id"] == "same" and {chunk["id"] for chunk in chunks} == {"same"}
    assert given[0] == "same" and re.fullmatch(r"same-[0-9a-f]{8}", given[1])
    wait_until_idle(server)
    client.completions.create(model=MODEL, prompt="The quick", max_tokens=2, extra_headers=header)
    assert given[2] == "same"


BAD_REQUESTS = [
    pytest.param(
        {"temperature": -1},
        400,
        "temperature must be >= 0 (0 = greedy), got -1.0",
        "temperature",
        id="invalid-temperature",
    ),
    pytest.param({"top_p": 2}, 400, "top_p must be in (0, 1], got 2.0", "top_p", id="invalid-top-p"),
    pytest.param({"top_k": -5}, 400, "top_k must be 0 or -1 (off) or >= 1, got -5", "top_k", id="invalid-top-k"),
    pytest.param(
        {"model": "gpt-4"},
        404,
        "model 'gpt-4' does not exist; this server serves 'tiny-llama'",
        "model",
        id="unknown-model",
    ),
    pytest.param(
        {"prompt": [5] * 600},
        400,
        "prompt has 600 tokens but max_model_len is 512; shorten the prompt (or serve with a larger --max-model-len)",
        "prompt",
        id="prompt-too-long",
    ),
    pytest.param({"max_tokens": "many"}, 400, None, "max_tokens", id="wrong-type"),
    pytest.param(
        {"n": 10**6},
        400,
        "n must be at most 16384 (samples of one request: vLLM's VLLM_MAX_N_SEQUENCES), got 1000000; ask for fewer, "
        "or send several requests",
        "n",
        id="too-many-samples",
    ),
]


@pytest.mark.parametrize(("change", "status", "message", "param"), BAD_REQUESTS)
def test_a_bad_request_gets_its_4xx_and_the_server_keeps_answering(
    server, client, offline, change, status, message, param
):
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 8, **change}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=DEADLINE_SECONDS)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if message is not None:
        assert error["message"] == message
    test_a_completion_equals_the_offline_engines_output(client, offline)


ROUTER_FIELDS = {"no_stop_trim": False, "return_hidden_states": False, "stream_options": {"continuous_usage": True}}


def test_unknown_fields_are_ignored_with_one_warning_naming_them(server, client, offline, caplog):
    """vLLM's behaviour, which routers rely on (vllm-router adds no_stop_trim and return_hidden_states to every
    body): the answer is the one without them, and the log names them once, not once per request."""
    expected = offline.generate("The quick", GREEDY, use_tqdm=False)[0].outputs[0].text
    with caplog.at_level(logging.WARNING, logger="hybridkv"):
        for _ in range(3):
            response = client.completions.create(
                model=MODEL, prompt="The quick", max_tokens=8, temperature=0, extra_body=ROUTER_FIELDS
            )
            assert response.choices[0].text == expected
    (warning,) = [record.getMessage() for record in caplog.records if "not used by this server" in record.getMessage()]
    assert warning.startswith("/v1/completions: the request's fields 'no_stop_trim', 'return_hidden_states', ")
    assert "'stream_options.continuous_usage'" in warning


@pytest.fixture(scope="module")
def strict_server(checkpoint):
    model, llm = load(checkpoint)
    handle = hybridkv.serve(llm, port=0, model_name=MODEL, strict_fields=True)
    yield handle
    handle.stop()
    hybridkv.unpatch(model)


@pytest.mark.parametrize(
    ("change", "param"),
    [({"temprature": 0.5}, "temprature"), ({"stream_options": {"include_usge": True}}, "stream_options.include_usge")],
)
def test_strict_fields_refuse_an_unknown_field_naming_it(strict_server, change, param):
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 2, **change}
    response = httpx.post(strict_server.url + "/v1/completions", json=body, timeout=DEADLINE_SECONDS)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == f"unknown field {param!r}; check its spelling (see the API reference)"
    assert error["param"] == param
    assert strict_server.engine.stats()["num_steps"] == 0


def test_malformed_json_is_a_400(server, client, offline):
    response = httpx.post(
        server.url + "/v1/chat/completions",
        content=b'{"model": "tiny-llama", "messages": [',
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("the request body is not valid JSON")
    test_a_completion_equals_the_offline_engines_output(client, offline)


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="presence_penalty must be in"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, presence_penalty=3)


def test_a_bad_request_does_not_disturb_a_running_stream(server, client, offline):
    expected = offline.generate(
        "Once upon", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )[0]
    stream = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=30, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    text = next(iter(stream)).choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Once upon", temperature=-1)
    text += "".join(chunk.choices[0].text for chunk in stream)
    assert text == expected.outputs[0].text


def test_health_and_metrics_answer(server, client):
    """/metrics is Prometheus' text format, read back with prometheus_client's own parser: the engine's series
    under hybridkv's names and vLLM's, with stats()' values, and the server's histograms."""
    client.completions.create(model=MODEL, prompt="The quick", max_tokens=4)
    wait_until_idle(server)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    response = httpx.get(server.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }
    stats = server.engine.stats()
    for names, value in (
        (("hybridkv_kv_blocks_in_use",), 0),
        (("hybridkv_num_requests_running", "vllm:num_requests_running"), 0),
        (("hybridkv_num_requests_waiting", "vllm:num_requests_waiting"), 0),
        (("hybridkv_num_requests_swapped", "vllm:num_requests_swapped"), 0),
        (("vllm:kv_cache_usage_perc",), 0),
        (("hybridkv_generation_tokens_total", "vllm:generation_tokens_total"), stats["num_generated_tokens"]),
        (("hybridkv_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"), stats["prefix_cache_queries"]),
        (("hybridkv_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"), stats["prefix_cache_hits"]),
    ):
        for name in names:
            assert samples[(name, ())] == value, name
    assert samples[("hybridkv_kv_blocks_in_use_per_group", (("group", "0"),))] == 0
    for name in ("hybridkv_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"):
        assert samples[(name, ())] >= 1
    assert samples[("hybridkv_time_per_output_token_seconds_count", ())] >= 1
    assert samples[("vllm:request_success_total", (("finished_reason", "length"),))] >= 1


@pytest.mark.slow
def test_importing_hybridkv_does_not_import_fastapi():
    code = "import sys, hybridkv; assert 'fastapi' not in sys.modules and 'uvicorn' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_serve_refuses_a_port_in_use(server, offline):
    port = int(server.url.rsplit(":", 1)[1])
    with pytest.raises(OSError, match=f"the server could not start on 127.0.0.1:{port}"):
        hybridkv.serve(offline, port=port)


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_the_serve_command_serves_a_checkpoint(checkpoint, offline):
    port = free_port()
    command = [sys.executable, "-m", "hybridkv", "serve", "--model", str(checkpoint), "--port", str(port)]
    command += ["--served-model-name", MODEL, "--max-model-len", "128", "--block-size", "8", "--threads", "1"]
    # The key from the environment (HYBRIDKV_API_KEY), as `--api-key` would give it.
    # vLLM's development endpoints on: the server loaded its model itself, so reload_weights has a checkpoint to read.
    environment = {**os.environ, "HYBRIDKV_API_KEY": "s3cret", "VLLM_SERVER_DEV_MODE": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="s3cret", max_retries=0)
        wait_for_health(process, port, 60)
        expected = offline.generate("The quick", GREEDY, use_tqdm=False)[0].outputs[0].text
        assert (
            client.completions.create(model=MODEL, prompt="The quick", max_tokens=8, temperature=0).choices[0].text
            == expected
        )
        assert client.models.list().data[0].max_model_len == 128
        with pytest.raises(openai.AuthenticationError):
            client.with_options(api_key="wrong").models.list()
        reloaded = httpx.post(
            f"http://127.0.0.1:{port}/collective_rpc",
            json={"method": "reload_weights"},
            headers={"Authorization": "Bearer s3cret"},
            timeout=60,
        )
        assert reloaded.status_code == 200 and reloaded.json() == {"results": [None]}
        assert (
            client.completions.create(model=MODEL, prompt="The quick", max_tokens=8, temperature=0).choices[0].text
            == expected
        )
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_with_an_api_key_every_route_but_health_asks_for_it(checkpoint, offline):
    model, llm = load(checkpoint)
    handle = hybridkv.serve(llm, port=0, model_name=MODEL, api_key="k-123")
    try:
        keyed = openai.OpenAI(base_url=handle.url + "/v1", api_key="k-123", max_retries=0, timeout=DEADLINE_SECONDS)
        expected = offline.generate("The quick", GREEDY, use_tqdm=False)[0].outputs[0].text
        answer = keyed.completions.create(model=MODEL, prompt="The quick", max_tokens=8, temperature=0)
        assert answer.choices[0].text == expected
        for key in ("k-12", "k-1234", "wrong"):
            with pytest.raises(openai.AuthenticationError, match="invalid or missing API key"):
                keyed.with_options(api_key=key).completions.create(model=MODEL, prompt="The quick", max_tokens=2)
        for path in ("/v1/models", "/metrics"):
            response = httpx.get(handle.url + path, timeout=DEADLINE_SECONDS)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(handle.url + "/health", timeout=DEADLINE_SECONDS).status_code == 200
        assert httpx.get(handle.url + "/metrics", headers={"Authorization": "Bearer k-123"}).status_code == 200
        assert handle.engine.stats()["blocks_in_use"] == 0
    finally:
        handle.stop()
        hybridkv.unpatch(model)


class Reply(BaseModel):
    """What `chat.completions.parse` asks for (OpenAI's strict JSON schema made from it)."""

    mood: Literal["happy", "sad", "calm"]
    ok: bool
    score: int = Field(ge=0, le=9)


def test_parse_with_a_pydantic_model_returns_the_offline_engines_object(client, offline):
    response = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Reply, max_tokens=64, temperature=0
    )
    message = response.choices[0].message
    assert isinstance(message.parsed, Reply) and response.choices[0].finish_reason == "stop"
    schema = openai.lib._pydantic.to_strict_json_schema(Reply)
    prompt = render_chat(offline.tokenizer, MESSAGES)
    prompt_ids = offline.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs={"json": schema})
    assert message.content == offline.generate([prompt_ids], params, use_tqdm=False)[0].outputs[0].text
    json_object = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0, response_format={"type": "json_object"}
    ).choices[0]
    if json_object.finish_reason == "stop":  # a random model may nest objects past max_tokens
        assert isinstance(json.loads(json_object.message.content), dict)


def test_a_structural_tag_response_format_is_the_offline_engines_structural_tag(client, offline):
    # vLLM's response_format {"type": "structural_tag", "structures": [...], "triggers": [...]}: a 400 before.
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
    tag = {"structures": [{"begin": "e=", "schema": schema, "end": ";"}], "triggers": ["e"]}
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=1.0, seed=3,
        response_format={"type": "structural_tag", **tag},
    )  # fmt: skip
    prompt = render_chat(offline.tokenizer, MESSAGES)
    prompt_ids = offline.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, structured_outputs={"structural_tag": tag})
    assert response.choices[0].message.content == offline.generate([prompt_ids], params)[0].outputs[0].text


def test_regex_and_choice_constraints_hold_on_every_sample_of_n_4(client):
    regex = r"[0-9]{3}-[a-z]{2,4}"
    response = client.completions.create(
        model=MODEL, prompt="The quick", n=4, max_tokens=32, temperature=1.0, seed=2,
        extra_body={"structured_outputs": {"regex": regex}},
    )  # fmt: skip
    assert len(response.choices) == 4 and all(re.fullmatch(regex, c.text) for c in response.choices)
    choices = ["yes", "no", "maybe so"]
    chunks = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=4, max_tokens=32, temperature=1.0, seed=2, stream=True,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    texts = ["", "", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(text in choices for text in texts)


def test_concurrent_constrained_and_free_requests_each_get_their_own_result(server, client, offline):
    regex = r"[a-z]{4}-[0-9]{2}"
    prompts = [f"The quick brown fox {i}" for i in range(12)]
    structured = [{"regex": regex} if i % 2 else None for i in range(12)]
    expected = [
        offline.generate(p, SamplingParams(temperature=0, max_tokens=12, structured_outputs=s), use_tqdm=False)[0]
        for p, s in zip(prompts, structured, strict=True)
    ]

    def ask(index):
        extra = {"structured_outputs": structured[index]} if structured[index] else {}
        response = client.completions.create(
            model=MODEL, prompt=prompts[index], max_tokens=12, temperature=0, extra_body=extra
        )
        return response.choices[0].text

    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(ask, range(12), timeout=120))
    assert answers == [o.outputs[0].text for o in expected]
    assert all(re.fullmatch(regex, a) for a in answers[1::2]) and not any(re.fullmatch(regex, a) for a in answers[::2])
    wait_until_idle(server)


def test_a_bad_constraint_is_a_400_and_nothing_is_queued(server, client):
    cases = [
        ({"structured_outputs": {"regex": "("}}, "regex cannot be used"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
        ({"structured_outputs": {"pattern": "a"}}, "unknown field"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "not both"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs json_schema.schema"),
    ]
    steps = wait_until_idle(server)["num_steps"]
    for extra, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert wait_until_idle(server)["num_steps"] == steps


TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool['function']['name'] }};{% endfor %}</tools>{% endif %}"
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>{{ call['function'] | tojson }}</tool_call>"
    "{% endfor %}<eos>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["oslo", "lima"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tool_server(checkpoint):
    """A server whose chat template renders tools and shows Hermes' <tool_call> format."""
    model, llm = load(checkpoint)
    llm.tokenizer.chat_template = TOOLS_TEMPLATE
    handle = hybridkv.serve(llm, port=0, model_name=MODEL)
    yield handle, openai.OpenAI(base_url=handle.url + "/v1", api_key="-", max_retries=0, timeout=DEADLINE_SECONDS)
    handle.stop()
    hybridkv.unpatch(model)


def streamed_calls(chunks):
    """The tool calls and the content of a streamed chat, assembled as OpenAI's clients do."""
    calls, content, finish = {}, "", None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    return [calls[i] for i in sorted(calls)], content, finish


def test_required_and_named_tool_choices_return_valid_calls_streamed_or_not(tool_server):
    server, client = tool_server
    schema = TOOLS[0]["function"]["parameters"]
    for choice in ("required", WEATHER):
        settings = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=96, temperature=0)
        response = client.chat.completions.create(**settings)
        (answer,) = response.choices
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        assert answer.message.tool_calls and all(c.id.startswith("call_") for c in answer.message.tool_calls)
        for call in answer.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time")
            if call.function.name == "get_weather":
                jsonschema.validate(json.loads(call.function.arguments), schema)
        if choice is WEATHER:
            assert [c.function.name for c in answer.message.tool_calls] == ["get_weather"]
        chunks = list(client.chat.completions.create(**settings, stream=True))
        calls, content, finish = streamed_calls(chunks)
        expected = [{"name": c.function.name, "arguments": c.function.arguments} for c in answer.message.tool_calls]
        assert (calls, content, finish) == (expected, "", "tool_calls")
        # Each call's arguments stream as they come, as OpenAI and vLLM send them: its id and name once, first.
        pieces = [c for chunk in chunks for choice_ in chunk.choices for c in choice_.delta.tool_calls or []]
        for index in range(len(expected)):
            own = [c for c in pieces if c.index == index]
            assert sum(1 for c in own if c.function.arguments) > 1
            assert own[0].function.name == expected[index]["name"] and own[0].id.startswith("call_")
            assert all(c.function.name is None and c.id is None for c in own[1:])
        # A call cut by max_tokens comes back as a call, as far as it went, never as content.
        cut = {**settings, "max_tokens": 12}
        (answer,) = client.chat.completions.create(**cut).choices
        assert (answer.finish_reason, answer.message.content) == ("length", None)
        calls, content, finish = streamed_calls(client.chat.completions.create(**cut, stream=True))
        assert (content, finish) == ("", "length")
        assert calls == [
            {"name": c.function.name, "arguments": c.function.arguments} for c in answer.message.tool_calls
        ]
        if choice is WEATHER:
            assert calls and calls[0]["name"] == "get_weather"
    wait_until_idle(server)


def test_a_chat_render_with_tools_is_the_prompt_token_ids_the_chat_runs(tool_server):
    handle, _ = tool_server
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 1, "return_token_ids": True}
    post = functools.partial(httpx.post, timeout=DEADLINE_SECONDS)
    ran = post(handle.url + "/v1/chat/completions", json=body).json()
    rendered = post(handle.url + "/v1/chat/completions/render", json=body).json()
    tokenizer = handle.engine.llm.tokenizer
    assert rendered["token_ids"] == ran["prompt_token_ids"]
    assert tokenizer.decode(rendered["token_ids"]).startswith("<tools>get_weather;get_time;</tools>")


def test_auto_parses_the_templates_format_from_the_text(tool_server):
    """tool_choice "auto" with Hermes' format (found in the template): the random model is held to a call in that
    format by a regex, so the parser has something to find; the text before it stays content."""
    _, client = tool_server
    arguments = r'\{"city": "(oslo|lima)", "days": [1-7]\}'
    call = r'Checking\.<tool_call>\{"name": "get_weather", "arguments": ' + arguments + r"\}</tool_call>"
    settings = dict(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0,
        extra_body={"structured_outputs": {"regex": call}},
    )  # fmt: skip
    (answer,) = client.chat.completions.create(**settings).choices
    assert (answer.message.content, answer.finish_reason) == ("Checking.", "tool_calls")
    ((name, arguments),) = [(c.function.name, json.loads(c.function.arguments)) for c in answer.message.tool_calls]
    assert name == "get_weather" and set(arguments) == {"city", "days"}
    calls, content, finish = streamed_calls(client.chat.completions.create(**settings, stream=True))
    assert (content, finish) == ("Checking.", "tool_calls")
    assert calls == [{"name": name, "arguments": answer.message.tool_calls[0].function.arguments}]
    # Without a call in the text, the answer is content; tool_choice "none" never parses.
    (plain,) = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8).choices
    assert plain.message.tool_calls == [] and plain.finish_reason in ("stop", "length")  # vLLM's empty list
    (none,) = client.chat.completions.create(**settings, tool_choice="none").choices
    assert none.message.tool_calls == [] and none.message.content.startswith("Checking.<tool_call>")


def test_a_conversation_with_tool_results_renders_and_bad_tool_requests_are_400s(tool_server, server, client):
    _, tool_client = tool_server
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    answer = tool_client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")
    unknown = {"type": "function", "function": {"name": "nope"}}
    cases = [
        (tool_client, {"tools": TOOLS, "tool_choice": unknown}, "not in tools"),
        (tool_client, {"tool_choice": "required"}, "needs tools"),
        (tool_client, {"tools": [{"type": "function", "function": {}}]}, "needs a name"),
        (tool_client, {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "drop"),
        (client, {"tools": TOOLS}, "needs a parser"),  # the plain template shows no tool-call format
        (client, {"tools": TOOLS, "tool_choice": "required"}, "does not read `tools`"),
    ]
    for which, extra, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            which.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **extra)


def streamed_chunks(server, path, body):
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=DEADLINE_SECONDS) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    return [json.loads(line[len("data: ") :]) for line in lines]


def test_return_token_ids_streams_the_prompts_ids_first_as_vllm_does(server):
    """A router (or an RL loop) reads the token ids the server ran from the stream: a chat's first chunk carries them
    beside its choices, a completion's first choice of each prompt inside it; the answer's ids come chunk by chunk."""
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    whole = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=DEADLINE_SECONDS).json()
    chunks = streamed_chunks(server, "/v1/chat/completions", chat)
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == whole["choices"][0]["token_ids"]
    completion = {"model": MODEL, "prompt": ["The quick", "Once upon"], "max_tokens": 4, "temperature": 0}
    completion["return_token_ids"] = True
    whole = httpx.post(server.url + "/v1/completions", json=completion, timeout=DEADLINE_SECONDS).json()
    firsts = {}
    for chunk in streamed_chunks(server, "/v1/completions", completion):
        for choice in chunk["choices"]:
            if "prompt_token_ids" in choice:
                assert choice["index"] not in firsts
                firsts[choice["index"]] = choice["prompt_token_ids"]
    assert firsts == {choice["index"]: choice["prompt_token_ids"] for choice in whole["choices"]}
