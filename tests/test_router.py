"""hybridkv behind vllm-router and SGLang's router, unchanged: two `hybridkv serve` workers of a tiny checkpoint behind
`vllm-router --policy cache_aware`, which asks each worker for a request's prompt tokens (/v1/completions/render and
/v1/chat/completions/render) to route it by its cached prefix, or SGLang's (`python -m sglang_router.launch_router
--policy cache_aware`), and behind vllm-router's kv_aware over the workers' KV events. Completions and chats, streamed
or not, go through the router with the real `openai` client; each answer is the offline engine's for the token ids
the worker ran.

Both routers are in the dev extra: without one the test fails naming the install, rather than skipping unseen."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import save_chat_checkpoint, wait_for_health
from transformers import AutoModelForCausalLM, AutoTokenizer

import hybridkv
from hybridkv import SamplingParams
from hybridkv.engine.chat import chat_prompt

from lazy_modules import lazy_import

openai = lazy_import("openai")  # loaded by the first test that uses it (tests/lazy_modules.py)

MODEL = "tiny-llama"
CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "The quick brown fox"}]
# Two prompts that share a prefix: what cache_aware routes by.
PROMPTS = ["The quick brown fox", "The quick brown fox jumps over"]
MAX_MODEL_LEN = 128
BLOCK_SIZE = 8
NEW_TOKENS = 8
SETTINGS = {"max_tokens": NEW_TOKENS, "temperature": 0, "extra_body": {"return_token_ids": True}}
WORKER_START_SECONDS = 120
ROUTER_START_SECONDS = 60
DEADLINE_SECONDS = 30
STOP_SECONDS = 30
SUBSCRIBE_SECONDS = 1.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_chat_checkpoint(tmp_path_factory.mktemp("checkpoint"), CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def offline(checkpoint):
    """An engine of its own on the same checkpoint: what the workers must answer."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    yield hybridkv.patch(model, tokenizer=tokenizer, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_blocks=64)
    hybridkv.unpatch(model)


def router_command(kind: str) -> list[str]:
    """The command of a router: vllm-router (on PATH, or beside this Python: a virtual environment's bin, not
    activated), or SGLang's (`python -m sglang_router.launch_router`); both in the dev extra."""
    if kind == "sglang-router":
        if importlib.util.find_spec("sglang_router") is None:
            pytest.fail(
                "sglang-router is not installed: pip install sglang-router (it is in hybridkv's dev extra)", False
            )
        return [sys.executable, "-m", "sglang_router.launch_router"]
    beside = Path(sys.executable).with_name("vllm-router")
    found = shutil.which("vllm-router") or (str(beside) if beside.exists() else None)
    if found is None:
        pytest.fail("vllm-router is not installed: pip install vllm-router (it is in hybridkv's dev extra)", False)
    return [found]


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free now (each probe is held until all are chosen)."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


@contextlib.contextmanager
def routed(checkpoint, policy: str, events: bool = False, kind: str = "vllm-router", discovery: bool = False):
    """Two workers behind `vllm-router --policy POLICY`: the router's URL, its Prometheus URL and the workers' URLs;
    with `events`, each worker publishes its KV events on a loopback port the router subscribes to (kv_aware's
    `--kv-event-source`), and answers replays on another (`--kv-event-replay-source`: batches sent before the router's
    subscription reached the worker are read from there); with `discovery`, the router finds both itself (its
    `/get_server_info` and `/kv_event_sources` queries). Every process is stopped on exit."""
    command = router_command(kind)
    *worker_ports, router_port, metrics_port, event_a, event_b, replay_a, replay_b = free_ports(8)
    processes: list[subprocess.Popen] = []

    def start(command: list[str]) -> subprocess.Popen:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        processes.append(process)
        return process

    endpoints = [f"tcp://127.0.0.1:{event_a}", f"tcp://127.0.0.1:{event_b}"]
    replays = [f"tcp://127.0.0.1:{replay_a}", f"tcp://127.0.0.1:{replay_b}"]
    try:
        for port, endpoint, replay in zip(worker_ports, endpoints, replays, strict=True):
            config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay}
            config = ["--kv-events-config", json.dumps(config)]
            start([
                sys.executable, "-m", "hybridkv", "serve", "--model", str(checkpoint), "--port", str(port),
                "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
                "--threads", "1", "--log-level", "warning", *(config if events else []),
            ])  # fmt: skip
        for process, port in zip(processes, worker_ports, strict=True):
            wait_for_health(process, port, WORKER_START_SECONDS)
        urls = [f"http://127.0.0.1:{port}" for port in worker_ports]
        sources = []
        if events and not discovery:
            sources = [flag for url, endpoint, replay in zip(urls, endpoints, replays, strict=True)
                       for flag in ("--kv-event-source", f"{url}={endpoint}",
                                    "--kv-event-replay-source", f"{url}={replay}")]  # fmt: skip
            sources += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL]
        routing = start([
            *command, "--worker-urls", *urls, "--host", "127.0.0.1", "--port", str(router_port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), "--policy", policy,
            "--worker-startup-timeout-secs", str(ROUTER_START_SECONDS),
            "--log-level", "warn" if kind == "sglang-router" else "warning", *sources,
        ])  # fmt: skip
        wait_for_health(routing, router_port, ROUTER_START_SECONDS)
        if events:  # the router's subscribers connect (a batch sent before is replayed once a later one shows the gap)
            time.sleep(SUBSCRIBE_SECONDS)
        yield f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{metrics_port}", urls
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(params=["vllm-router", "sglang-router"])
def router(checkpoint, request):
    """The router's kind, URL and Prometheus URL, and its two workers' URLs (cache_aware)."""
    with routed(checkpoint, "cache_aware", kind=request.param) as (router_url, metrics_url, workers):
        yield request.param, router_url, metrics_url, workers


def offline_answer(offline, prompt_ids: list[int]) -> tuple[list[int], str]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    (sample,) = offline.generate([prompt_ids], params, use_tqdm=False)[0].outputs
    return list(sample.token_ids), sample.text


def routing_inputs(metrics_url: str) -> dict[str, float]:
    """How the router got the tokens it routed by, per worker and request: `render`, or why it got none."""
    text = httpx.get(metrics_url + "/metrics", timeout=DEADLINE_SECONDS).text
    families = [f for f in text_string_to_metric_families(text) if f.name == "vllm_router_kv_routing_inputs"]
    return {s.labels["result"]: s.value for f in families for s in f.samples if s.name.endswith("_total")}


@pytest.mark.slow
def test_completions_and_chats_through_a_router_are_the_offline_engines(router, offline):
    kind, router_url, metrics_url, _ = router
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_SECONDS)
    for prompt in PROMPTS:
        (choice,) = client.completions.create(model=MODEL, prompt=prompt, **SETTINGS).choices
        expected_ids, expected_text = offline_answer(offline, choice.prompt_token_ids)
        assert (choice.token_ids, choice.text) == (expected_ids, expected_text)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True, **SETTINGS))
        streamed = [c.choices[0] for c in chunks if c.choices]
        assert [t for c in streamed for t in c.token_ids] == expected_ids
        assert "".join(c.text for c in streamed) == expected_text

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, extra_headers={"X-Request-Id": "routed-1"}, **SETTINGS
    )
    chat = raw.parse()
    # SGLang's router passes a chat's choices on but drops vLLM's top-level prompt_token_ids: rendered here instead.
    prompt_ids = getattr(chat, "prompt_token_ids", None) or chat_prompt(offline.tokenizer, MESSAGES)[1]
    expected_ids, expected_text = offline_answer(offline, prompt_ids)
    assert chat.choices[0].message.content == expected_text
    # SGLang's router rebuilds a chat's body from its own schema, without vLLM's token_ids; vllm-router passes them.
    assert getattr(chat.choices[0], "token_ids", None) == (expected_ids if kind == "vllm-router" else None)
    assert (chat.id, raw.headers["x-request-id"]) == ("routed-1", "routed-1")  # the client's name reached the worker
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **SETTINGS))
    streamed = [c.choices[0] for c in chunks if c.choices]
    if kind == "vllm-router":
        assert [t for c in streamed for t in c.token_ids] == expected_ids
    assert "".join(c.delta.content or "" for c in streamed) == expected_text

    # Each worker rendered each request's tokens for the router (a render that ran past the router's one-second
    # budget on a busy machine counts as preparation_unavailable); none was refused or unreadable.
    if kind == "vllm-router":
        inputs = routing_inputs(metrics_url)
        assert inputs.get("render", 0) > 0 and set(inputs) <= {"render", "preparation_unavailable"}, inputs


def prefix_hits(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=DEADLINE_SECONDS).text
    return next(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:prefix_cache_hits_total"
    )


@pytest.mark.slow
@pytest.mark.parametrize("discovery", [False, True], ids=["kv-event-source", "discovered"])
def test_kv_aware_routes_each_session_to_the_worker_its_events_say_holds_it(checkpoint, offline, discovery):
    """vllm-router's kv_aware policy over hybridkv's KV events: session A starts on worker 0 and session B on worker 1
    (sent to them directly, not through the router); each next turn through the router goes to the worker holding its
    prefix, which only the router's index of the events can know (a load-only choice sends both to one worker), so
    every turn finds its whole computed prefix there; answers stay the offline engine's. The router learns where the
    events are from its flags, or from each worker's /get_server_info and /kv_event_sources."""
    tokenizer = offline.tokenizer
    sessions = [tokenizer.encode(text) * 2 for text in ("The quick brown fox", "Once upon a time, a tiny model")]
    with routed(checkpoint, "kv_aware", events=True, discovery=discovery) as (router_url, _, workers):
        for prompt, url in zip(sessions, workers, strict=True):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
            assert httpx.post(url + "/v1/completions", json=body, timeout=DEADLINE_SECONDS).status_code == 200
        client = openai.OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_SECONDS)
        for _ in range(2):
            for index, prompt in enumerate(sessions):
                expected_ids, _ = offline_answer(offline, prompt)
                sessions[index] = prompt + expected_ids + tokenizer.encode(" and more")
                time.sleep(0.5)  # the last turn's events reach the router's index
                before = [prefix_hits(url) for url in workers]
                # Without return_token_ids: vllm-router 0.1.17 gives a completion that asks for them no kv_aware credit
                # (its decision logs credited_prefix_tokens=0 whatever its index holds); the prompt is ours anyway.
                (choice,) = client.completions.create(
                    model=MODEL, prompt=sessions[index], max_tokens=NEW_TOKENS, temperature=0
                ).choices
                assert choice.text == offline_answer(offline, sessions[index])[1]
                hits = [prefix_hits(url) - earlier for url, earlier in zip(workers, before, strict=True)]
                # Its worker found the last turn's prompt and answer but the answer's last token, in whole blocks.
                expected = (len(prompt) + NEW_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
                assert hits == [expected if worker == index else 0 for worker in range(2)], (index, hits)


def finished_by_reason(url: str) -> dict[str, float]:
    """A worker's finished samples by finish reason (its /metrics)."""
    text = httpx.get(url + "/metrics", timeout=DEADLINE_SECONDS).text
    return {
        sample.labels["finish_reason"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "hybridkv_request_finished_total"
    }


@pytest.mark.slow
def test_a_stream_the_client_drops_at_the_router_is_aborted_on_its_worker(router):
    """A client that goes away mid-stream: the router drops its connection to the worker, which aborts the request
    (finish reason "abort", not "length") and gets back every block it held."""
    _, router_url, _, workers = router
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router_url + "/v1/completions", json=body, timeout=DEADLINE_SECONDS) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then the client is gone
    deadline = time.monotonic() + DEADLINE_SECONDS
    while sum(finished_by_reason(url).get("abort", 0) for url in workers) < 1:
        assert time.monotonic() < deadline, [finished_by_reason(url) for url in workers]
        time.sleep(0.2)
    assert sum(finished_by_reason(url).get("length", 0) for url in workers) == 0
    for url in workers:
        text = httpx.get(url + "/metrics", timeout=DEADLINE_SECONDS).text
        assert re.search(r"^hybridkv_kv_blocks_in_use 0\.0$", text, re.MULTILINE), url
