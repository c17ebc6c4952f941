"""vLLM's development endpoints (`VLLM_SERVER_DEV_MODE=1`; hybridkv/serving/dev_endpoints.py): an RL trainer puts the
rollout server to sleep, wakes it, resets its prefix cache and calls its workers over HTTP; without the switch the
routes are not there."""

from __future__ import annotations

import httpx
import pytest

import hybridkv
from hybridkv.tiny import tiny_model


class Extension:
    """A worker extension (vLLM's worker_extension_cls) a trainer's call reaches."""

    def weight_sum(self, scale: float = 1.0) -> float:
        return scale * float(sum(p.detach().double().sum() for p in self.model.parameters()))


@pytest.fixture
def server(monkeypatch):
    def start(dev: bool):
        if dev:
            monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
        else:
            monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
        model = tiny_model("gemma3")
        llm = hybridkv.patch(model, max_model_len=64, worker_extension_cls=Extension)
        handle = hybridkv.serve(llm, port=0, model_name="tiny")
        started.append((handle, model))
        return handle, model

    started: list = []
    yield start
    for handle, model in started:
        handle.stop()
        hybridkv.unpatch(model)


def complete(url: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}, timeout=30
    )


def test_sleep_wake_up_and_reset_prefix_cache_over_http(server):
    handle, _ = server(dev=True)
    url = handle.url
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    before = complete(url).json()["choices"][0]["text"]
    assert httpx.post(f"{url}/sleep", params={"level": 1}).status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
    asleep = complete(url)
    assert asleep.status_code >= 400 and "wake_up" in asleep.text
    assert httpx.post(f"{url}/wake_up", params=[("tags", "weights"), ("tags", "kv_cache")]).status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200
    assert complete(url).json()["choices"][0]["text"] == before
    refused = httpx.post(f"{url}/sleep", params={"level": 3})
    assert refused.status_code == 400 and "level must be 1 or 2" in refused.json()["error"]["message"]
    refused = httpx.post(f"{url}/wake_up", params={"tags": "everything"})
    assert refused.status_code == 400 and "'weights' and 'kv_cache'" in refused.json()["error"]["message"]


def test_collective_rpc_over_http_reaches_the_worker_extension(server):
    handle, model = server(dev=True)
    body = {"method": "weight_sum", "kwargs": {"scale": 2.0}}
    results = httpx.post(f"{handle.url}/collective_rpc", json=body, timeout=30).json()["results"]
    assert results == [pytest.approx(2.0 * float(sum(p.double().sum() for p in model.parameters())))]
    unknown = httpx.post(f"{handle.url}/collective_rpc", json={"method": "no_such_method"})
    assert unknown.status_code == 400 and "worker_extension_cls" in unknown.json()["error"]["message"]
    no_checkpoint = httpx.post(f"{handle.url}/collective_rpc", json={"method": "reload_weights"})
    assert no_checkpoint.status_code == 400 and "load_state_dict" in no_checkpoint.json()["error"]["message"]


def test_without_the_switch_the_routes_are_not_there(server):
    handle, _ = server(dev=False)
    assert httpx.post(f"{handle.url}/sleep").status_code == 404
    assert httpx.post(f"{handle.url}/collective_rpc", json={"method": "weight_sum"}).status_code == 404
