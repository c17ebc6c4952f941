"""Replicas behind a router: hybridkv serve processes behind vllm-router, by routing policy, in one run.

Per model (a Gemma-3-style sliding-window hybrid and a Qwen3.5-style state-layer hybrid, tiny and random, saved with
a byte-level BPE tokenizer and a chat template) and per policy, `--replicas` fresh `hybridkv serve` processes (one
torch thread each, 127.0.0.1 only, each publishing vLLM's KV events on a loopback tcp:// port) run behind a fresh
`vllm-router` (PyPI's vllm-router, the Rust binary), and `--sessions` chat sessions talk to the router at once: each
session's first message is its own document of `--document-words` words, then `--turns` turns, each the conversation
so far plus the answer (`--max-tokens`, greedy, streamed) and a new question of `--question-words` words. Policies:
- round_robin: the baseline, each request to the next replica;
- cache_aware: vllm-router's approximate radix tree of the token ids it routed (it asks a replica's
  /v1/chat/completions/render for them);
- kv_aware: vllm-router's index of the replicas' KV events (`--kv-event-source URL=tcp://127.0.0.1:PORT`,
  `--kv-event-block-size`; `--kv-event-replay-source` for batches sent before it subscribed): the replica that holds the
  longest prefix of the prompt, in its pool.

Printed per model and policy: the prompt tokens found in the prefix cache over all replicas (their /metrics,
`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`, the first turn of each session left out: it has nothing to hit
anywhere; "ideal": what a replica that served each session's every turn would find), how the requests spread over the
replicas, requests/s and generated tokens/s (wall clock of the sessions), TTFT p50/p90 through the router (from
sending to the first content chunk), the requests the replicas preempted (a preempted request's prompt is looked up
again when it resumes, so its lookups count twice); then each policy's ratios to round_robin. Every answer is checked
against the
model's own greedy `generate` on the token ids the server saw (vLLM's `return_token_ids`): the count that equal it is
printed, and anything short of all fails the run.

By default each replica's pool holds every session's conversation, so only routing decides what is hit; a router
earns its keep where a replica's memory holds its own share of the sessions and not every session's, as in a
deployment sized for its traffic: `--num-blocks 480` (the Gemma 3 model) or `--num-blocks 264` (Qwen3.5: its one full
attention layer pages a block per 16 tokens; 257 is the least for one 4,096-token request) gives each replica room for
about half of the six conversations. There round_robin, which sends every session to both replicas, evicts and
preempts.

    python benchmarks/replicas.py [--replicas 2] [--sessions 6] [--turns 5] [--families gemma3,qwen3_5]
                                  [--policies round_robin,cache_aware,kv_aware] [--max-tokens 16] [--document-words 600]
                                  [--question-words 24] [--num-blocks 4096]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from serving import HOST, WORDS, ServerFailed, free_port, running, save_checkpoint
from transformers import AutoModelForCausalLM

BLOCK_SIZE = 16
MODELS = {
    # A 5:1 sliding : full hybrid with a window the documents outgrow.
    "gemma3": dict(
        hidden_size=512, intermediate_size=1024, head_dim=64, sliding_window=128, num_hidden_layers=6,
        max_position_embeddings=4096,
    ),
    # 3 Gated DeltaNet : 1 full attention.
    "qwen3_5": dict(
        hidden_size=512, intermediate_size=1024, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
        num_hidden_layers=4, max_position_embeddings=4096,
    ),
}  # fmt: skip
POLICIES = ("round_robin", "cache_aware", "kv_aware")
REQUEST_SECONDS = 120


def router_executable() -> str:
    found = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not Path(found).exists():
        raise SystemExit("vllm-router is not installed: pip install vllm-router (it is in hybridkv's dev extra)")
    return found


@dataclass(slots=True)
class Turn:
    """One request as the client saw it, and the token ids the server reports it ran and gave."""

    session: int
    turn: int
    first_token_s: float
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str


@dataclass(slots=True)
class PolicyRun:
    policy: str
    wall_s: float = 0.0
    hits: float = 0.0
    queries: float = 0.0
    per_replica: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    exact: int = 0
    ideal_hits: float = 0.0
    preemptions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def ttft(self, quantile: float) -> float:
        values = sorted(t.first_token_s for t in self.turns)
        return values[min(len(values) - 1, int(quantile * len(values)))]

    @property
    def ideal_rate(self) -> float:
        return self.ideal_hits / self.queries if self.queries else 0.0

    @property
    def requests_per_s(self) -> float:
        return len(self.turns) / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t.token_ids) for t in self.turns) / self.wall_s


def replica_command(model: Path, port: int, events: tuple[str, str], num_blocks: int) -> list[str]:
    config = {"enable_kv_cache_events": True, "endpoint": events[0], "replay_endpoint": events[1]}
    return [
        sys.executable, "-m", "hybridkv", "serve", str(model), "--host", HOST, "--port", str(port), "--threads", "1",
        "--served-model-name", "model", "--block-size", str(BLOCK_SIZE), "--num-blocks", str(num_blocks),
        "--max-model-len", "4096", "--kv-events-config", json.dumps(config), "--log-level", "warning",
    ]  # fmt: skip


def router_command(policy: str, port: int, workers: list[tuple[str, tuple[str, str]]]) -> list[str]:
    command = [
        router_executable(), "--host", HOST, "--port", str(port), "--prometheus-host", HOST,
        "--prometheus-port", str(free_port()), "--policy", policy, "--log-level", "warning",
        "--worker-urls", *[url for url, _ in workers],
    ]  # fmt: skip
    if policy == "kv_aware":
        for url, (events, replay) in workers:
            command += ["--kv-event-source", f"{url}={events}", "--kv-event-replay-source", f"{url}={replay}"]
        command += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", "model"]
    return command


COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total")


def prefix_counters(url: str) -> tuple[float, float, float]:
    """A replica's prompt tokens found in its prefix cache and looked up, and its requests preempted, from its
    /metrics (a preempted request is looked up again when it resumes: its lookups count again)."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in COUNTERS:
                values[sample.name] = sample.value
    return tuple(values[name] for name in COUNTERS)


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def ask(
    client: httpx.AsyncClient, messages: list[dict], max_tokens: int
) -> tuple[float, list[int], list[int], str]:
    """One streamed chat request: seconds to its first content chunk, the prompt's token ids, the answer's, its text."""
    body = {
        "model": "model", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "return_token_ids": True, "ignore_eos": True,
    }  # fmt: skip
    start = time.perf_counter()
    first = None
    prompt_ids: list[int] = []
    token_ids: list[int] = []
    text = []
    async with client.stream("POST", "/v1/chat/completions", json=body, timeout=REQUEST_SECONDS) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the router answered {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
            for choice in chunk.get("choices", ()):
                token_ids += choice.get("token_ids") or []
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = first or time.perf_counter() - start
                    text.append(content)
    return first or time.perf_counter() - start, prompt_ids, token_ids, "".join(text)


async def session(client: httpx.AsyncClient, index: int, args: argparse.Namespace, turns: list[Turn]) -> None:
    rng = random.Random(1000 + index)
    messages = [{"role": "user", "content": f"Session {index}. " + sentence(rng, args.document_words)}]
    for turn in range(args.turns):
        first, prompt_ids, token_ids, text = await ask(client, messages, args.max_tokens)
        turns.append(Turn(index, turn, first, prompt_ids, token_ids, text))
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": sentence(rng, args.question_words)},
        ]


async def run_sessions(router: str, args: argparse.Namespace) -> tuple[list[Turn], float]:
    turns: list[Turn] = []
    limits = httpx.Limits(max_connections=args.sessions)
    async with httpx.AsyncClient(base_url=router, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(session(client, i, args, turns) for i in range(args.sessions)))
        return turns, time.perf_counter() - start


def run_policy(policy: str, model: Path, workdir: Path, args: argparse.Namespace, num_blocks: int) -> PolicyRun:
    """Fresh replicas and a fresh router for one policy; the sessions through it."""
    result = PolicyRun(policy)
    with contextlib.ExitStack() as stack:
        workers = []
        for replica in range(args.replicas):
            port = free_port()
            events = (f"tcp://{HOST}:{free_port()}", f"tcp://{HOST}:{free_port()}")
            log = workdir / f"{policy}-replica{replica}.log"
            url = stack.enter_context(running(replica_command(model, port, events, num_blocks), log, 1))
            workers.append((url, events))
        router_port = free_port()
        router = stack.enter_context(
            running(router_command(policy, router_port, workers), workdir / f"{policy}-router.log", None)
        )
        time.sleep(1.0)  # the router's subscribers connect to the replicas' event sockets
        before = [prefix_counters(url) for url, _ in workers]
        turns, result.wall_s = asyncio.run(run_sessions(router, args))
        after = [prefix_counters(url) for url, _ in workers]
    result.turns = sorted(turns, key=lambda t: (t.session, t.turn))
    first_turn_queries = sum(len(t.prompt_token_ids) for t in result.turns if t.turn == 0)
    result.hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    # The first turn of each session has nothing to hit on any replica: left out of the lookups.
    result.queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True)) - first_turn_queries
    result.per_replica = [round(a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    result.preemptions = round(sum(a[2] - b[2] for a, b in zip(after, before, strict=True)))
    result.ideal_hits = ideal_hits(result.turns)
    return result


def ideal_hits(turns: list[Turn]) -> int:
    """The prompt tokens a replica that served every earlier turn of the session would find: each turn's prompt's
    common prefix with the previous turn's computed tokens (its prompt and answer but the last token), in whole blocks
    (every group's hit ends at a block), short of the prompt's last token (computed for its logits)."""
    hits = 0
    for previous, turn in itertools.pairwise(turns):
        if previous.session != turn.session:
            continue
        computed = previous.prompt_token_ids + previous.token_ids[:-1]
        common = 0
        for a, b in zip(computed, turn.prompt_token_ids, strict=False):
            if a != b:
                break
            common += 1
        hits += min(common, len(turn.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    return hits


def check_exact(model_path: Path, runs: list[PolicyRun]) -> None:
    """Each answer against the model's own greedy generate on the token ids the server saw."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    model.generation_config.eos_token_id = None  # the requests' ignore_eos: the answer goes on past an EOS
    cache: dict[tuple[int, ...], list[int]] = {}
    for run in runs:
        for turn in run.turns:
            key = tuple(turn.prompt_token_ids)
            if key not in cache:
                with torch.inference_mode():
                    out = model.generate(
                        torch.tensor([turn.prompt_token_ids]), max_new_tokens=len(turn.token_ids), do_sample=False,
                        pad_token_id=0,
                    )  # fmt: skip
                cache[key] = out[0, len(key) :].tolist()
            run.exact += cache[key] == turn.token_ids


def report(family: str, runs: list[PolicyRun]) -> None:
    print(f"\n== {family}: {len(runs[0].turns)} requests per policy ==")
    print(f"{'policy':<12} {'prefix hits':>12} {'(ideal)':>8} {'prompt tokens per replica':>28} {'req/s':>7} "
          f"{'tok/s':>7} {'TTFT p50':>9} {'p90':>7} {'exact':>7} {'preempted':>9}")  # fmt: skip
    for run in runs:
        spread = "/".join(f"{n:,}" for n in run.per_replica)
        print(
            f"{run.policy:<12} {run.hit_rate:>11.1%} {run.ideal_rate:>8.1%} {spread:>28} {run.requests_per_s:>7.2f} "
            f"{run.tokens_per_s:>7.1f} "
            f"{run.ttft(0.5) * 1000:>7.0f}ms {run.ttft(0.9) * 1000:>5.0f}ms {run.exact:>3}/{len(run.turns)} "
            f"{run.preemptions:>9}"
        )
    base = next((r for r in runs if r.policy == "round_robin"), None)
    if base is None:
        return
    for run in runs:
        if run is base:
            continue
        hits = run.hit_rate / base.hit_rate if base.hit_rate else float("inf")
        throughput = run.tokens_per_s / base.tokens_per_s
        print(
            f"{run.policy} / round_robin: prefix hits {hits:.2f}x, throughput {throughput:.2f}x, "
            f"TTFT p50 {base.ttft(0.5) / run.ttft(0.5):.2f}x faster, p90 {base.ttft(0.9) / run.ttft(0.9):.2f}x faster"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--document-words", type=int, default=600)
    parser.add_argument("--question-words", type=int, default=24, help="each later turn's new message")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--families", default=",".join(MODELS))
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=4096,
        help="each replica's pool: by default every session's longest conversation fits, so routing, not the pool's "
        "size, decides what is hit; smaller pools (480 for gemma3, 264 for qwen3_5: a replica holds its share of the "
        "sessions, not all of them) are the deployment a router is for",
    )
    args = parser.parse_args()
    router_executable()
    failed = False
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory(prefix="hybridkv-replicas-") as folder:
            workdir = Path(folder)
            save_checkpoint(workdir / "model", family, **MODELS[family])
            runs = []
            for policy in args.policies.split(","):
                try:
                    runs.append(run_policy(policy, workdir / "model", workdir, args, args.num_blocks))
                except ServerFailed as error:
                    print(f"{family} {policy}: a process failed: {error}")
                    failed = True
            check_exact(workdir / "model", runs)
            report(family, runs)
            failed = failed or any(run.exact != len(run.turns) for run in runs)
    if failed:
        raise SystemExit("some answers differ from the model's own generate, or a process failed (see above)")


if __name__ == "__main__":
    main()
