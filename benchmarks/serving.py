"""Serving under load: hybridkv's OpenAI-compatible server vs `transformers serve --continuous-batching`.

One run, same checkpoint and workload for every server, loopback only, bounded. A tiny random
Gemma-3-style hybrid (5 sliding : 1 full, hidden 128) and a byte-level BPE tokenizer with a chat template
are saved to a temporary folder; each server is started on it as a subprocess on a free 127.0.0.1 port
with the same torch thread count (OMP_NUM_THREADS), offline, on the CPU:

    python -m hybridkv serve --model PATH --host 127.0.0.1 --port P
    transformers serve --continuous-batching --device cpu --host 127.0.0.1 --port P PATH

At each client count C, C async clients (httpx) share max(--requests, C) streamed `/v1/completions`
requests (greedy, `max_tokens` fixed; prompts of 8-24 seeded random words, new ones at each C so no prefix
cache carries over), after two warm-up requests. Per request the client times the first content chunk
(TTFT, from sending) and the gaps between content chunks (ITL). The tokenizer's vocabulary is ASCII only,
so every token decodes to whole characters and each streamed chunk is one token on both servers.
Printed per server and C: requests/s and generated tokens/s (wall clock of the whole level), TTFT and
ITL p50/p90/p99 in ms; then the ratios, hybridkv / transformers for throughput and transformers / hybridkv
for latencies (above 1x: hybridkv is better), and how many requests' greedy texts the two servers agree on.

A server that does not start here is reported with its reason, and the other is reported alone.

Structured outputs' cost: `--servers hybridkv,hybridkv-json` runs the same hybridkv server twice, the
second time with every request constrained to a JSON schema (vLLM's `structured_outputs` extra body), and
prints the constrained / free ratios of requests/s and tokens/s and the server's own mask time per
constrained row and step (its /metrics). The schema asks for more records than max_tokens can hold, so
both runs generate the same number of tokens.
`transformers serve` (transformers 5.23) runs offline on a local folder given as its FORCE_MODEL
argument; it needs fastapi and uvicorn (`pip install "transformers[serving]"`).

    python benchmarks/serving.py [--clients 1,8,32] [--requests 32] [--max-tokens 32] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from hybridkv.serving.cli import DEMO_PROMPTS, SYSTEM_PROMPT
from hybridkv.tiny import tiny_model

HOST = "127.0.0.1"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
WORDS = " ".join([SYSTEM_PROMPT, *DEMO_PROMPTS]).split()
STARTUP_SECONDS = 180


def hybridkv_command(model: Path, port: int, threads: int | None) -> list[str]:
    command = [sys.executable, "-m", "hybridkv", "serve", "--model", str(model), "--host", HOST, "--port", str(port)]
    return command + (["--threads", str(threads)] if threads else [])


def transformers_command(model: Path, port: int, threads: int | None) -> list[str]:
    executable = Path(sys.executable).with_name("transformers")
    flags = ["--continuous-batching", "--device", "cpu", "--host", HOST, "--port", str(port)]
    return [str(executable), "serve", *flags, str(model)]


SERVERS: dict[str, Callable[[Path, int, int | None], list[str]]] = {
    "hybridkv": hybridkv_command,
    "transformers": transformers_command,
    # The same hybridkv server, every request constrained to JSON_SCHEMA (structured outputs' cost).
    "hybridkv-json": hybridkv_command,
}
# A list of short records, too many to close before max_tokens: constrained requests generate as many
# tokens as free ones (a random model closed an open-ended list at once, "[]").
JSON_SCHEMA = {
    "type": "array",
    "minItems": 40,
    "items": {
        "type": "object",
        "properties": {"word": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["word", "n"],
        "additionalProperties": False,
    },
}


class ServerFailed(RuntimeError):
    """A server exited or did not answer /health in time; the message ends with its last log lines."""


def save_checkpoint(folder: Path, family: str = "gemma3", **model_settings: object) -> None:
    """A tiny model (by default the Gemma-3-style hybrid of the module docstring; `family` and `model_settings`:
    another of hybridkv.tiny's, of other sizes) and a tokenizer whose every token is ASCII text (its one special token:
    <eos>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.utils.logging import disable_progress_bar

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # JSON's punctuation and digits in the alphabet: the hybridkv-json run's schema must be writable.
    # An EOS token: structured outputs need one (a grammar that may end ends there).
    alphabet = list('{}[]":,0123456789')
    trainer = trainers.BpeTrainer(
        vocab_size=320, show_progress=False, initial_alphabet=alphabet, special_tokens=["<eos>"]
    )
    bpe.train_from_iterator(WORDS * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    model_settings = model_settings or dict(
        hidden_size=128, intermediate_size=256, head_dim=32, sliding_window=32, max_position_embeddings=1024
    )
    model = tiny_model(family, vocab_size=len(tokenizer), **model_settings)
    disable_progress_bar()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running(command: list[str], log_path: Path, threads: int | None) -> Iterator[str]:
    """Start `command`, wait until GET /health answers 200, yield the base URL; stop the server on exit.
    `threads`: torch threads for every server (None: each server's own default)."""
    port = int(command[command.index("--port") + 1])
    base_url = f"http://{HOST}:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with log_path.open("w") as log:
        try:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        except OSError as error:
            raise ServerFailed(f"{command[0]}: {error}") from error
    try:
        wait_for_health(process, base_url, log_path)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for_health(process: subprocess.Popen, base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerFailed(f"exited with status {process.returncode}: {log_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise ServerFailed(f"no answer on {base_url}/health after {STARTUP_SECONDS} s: {log_tail(log_path)}")


def log_tail(log_path: Path, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in log_path.read_text().splitlines()[-lines:])


@dataclass(slots=True)
class RequestTiming:
    """One streamed request as its client saw it."""

    first_token_s: float
    token_gaps_s: list[float]
    completion_tokens: int
    text: str


@dataclass(slots=True)
class LoadResult:
    """Every request of one client count against one server, and the wall clock of all of them."""

    wall_s: float
    requests: list[RequestTiming] = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return len(self.requests) / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return sum(r.completion_tokens for r in self.requests) / self.wall_s

    def first_token_ms(self) -> list[float]:
        return percentiles([r.first_token_s * 1e3 for r in self.requests])

    def token_gap_ms(self) -> list[float]:
        return percentiles([gap * 1e3 for r in self.requests for gap in r.token_gaps_s])


def percentiles(values: list[float], points: tuple[int, ...] = (50, 90, 99)) -> list[float]:
    if len(values) < 2:
        return [values[0] if values else float("nan")] * len(points)
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return [cuts[p - 1] for p in points]


async def stream_completion(
    client: httpx.AsyncClient, base_url: str, model: str, prompt: str, max_tokens: int, structured: bool
) -> RequestTiming:
    """POST one streamed greedy completion; time its content chunks. Usage comes with the finishing chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if structured:
        body["structured_outputs"] = {"json": JSON_SCHEMA}
    chunk_times: list[float] = []
    pieces: list[str] = []
    completion_tokens = 0
    start = time.perf_counter()
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{base_url}: {response.status_code} {(await response.aread()).decode()[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "choices" not in chunk:
                raise RuntimeError(f"{base_url}: {chunk}")
            text = "".join(choice.get("text") or "" for choice in chunk["choices"])
            if text:
                chunk_times.append(time.perf_counter())
                pieces.append(text)
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
    if not chunk_times:  # EOS first (the random model's greedy choice): its first token is the stream's end
        chunk_times.append(time.perf_counter())
    gaps = [later - earlier for earlier, later in itertools.pairwise(chunk_times)]
    return RequestTiming(chunk_times[0] - start, gaps, completion_tokens, "".join(pieces))


async def run_load(
    base_url: str, model: str, prompts: list[str], clients: int, max_tokens: int, structured: bool = False
) -> LoadResult:
    """`clients` concurrent clients take the prompts in order until none is left; results keep prompt order."""
    timings: list[RequestTiming | None] = [None] * len(prompts)
    next_prompt = iter(range(len(prompts)))

    async def client_loop(client: httpx.AsyncClient) -> None:
        for index in next_prompt:
            timings[index] = await stream_completion(client, base_url, model, prompts[index], max_tokens, structured)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall_s = time.perf_counter() - start
    return LoadResult(wall_s, [timing for timing in timings if timing is not None])


def workload(clients: int, num_requests: int) -> list[str]:
    rng = random.Random(clients)
    return [" ".join(rng.choices(WORDS, k=rng.randint(8, 24))) for _ in range(num_requests)]


def measure(
    name: str, model_dir: Path, workdir: Path, levels: list[int], args: argparse.Namespace
) -> dict[int, LoadResult] | str:
    """Results per client count, or why the server could not be measured."""
    command = SERVERS[name](model_dir, free_port(), args.threads)
    try:
        with running(command, workdir / f"{name}.log", args.threads) as base_url:
            model = str(model_dir)
            structured = name == "hybridkv-json"
            warmup = workload(0, 2)
            asyncio.run(run_load(base_url, model, warmup, 1, args.max_tokens, structured))
            results = {}
            for clients in levels:
                prompts = workload(clients, max(args.requests, clients))
                results[clients] = asyncio.run(run_load(base_url, model, prompts, clients, args.max_tokens, structured))
            if structured:
                MASK_TIME[name] = mask_seconds_per_mask(base_url)
            return results
    except ServerFailed as error:
        return f"{name} did not start here ({' '.join(command)}): {error}"


MASK_TIME: dict[str, float] = {}


def mask_seconds_per_mask(base_url: str) -> float:
    """The server's own count of grammar masks and their seconds (its /metrics), warm-up included."""
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("hybridkv_structured_output_masks_total", "hybridkv_structured_output_mask_seconds_total"):
            values[name] = float(value)
    masks = values.get("hybridkv_structured_output_masks_total", 0.0)
    return values.get("hybridkv_structured_output_mask_seconds_total", 0.0) / masks if masks else float("nan")


def row(label: str, clients: int, result: LoadResult) -> str:
    first = "".join(f"{ms:>9.1f}" for ms in result.first_token_ms())
    gaps = "".join(f"{ms:>9.1f}" for ms in result.token_gap_ms())
    return (
        f"{label:<13}{clients:>7}{len(result.requests):>6}{result.requests_per_s:>8.2f}{result.tokens_per_s:>8.1f}"
        f"{first}{gaps}"
    )


def ratio_row(clients: int, ours: LoadResult, theirs: LoadResult) -> str:
    first = "".join(f"{t / o:>8.2f}x" for o, t in zip(ours.first_token_ms(), theirs.first_token_ms(), strict=True))
    gaps = "".join(f"{t / o:>8.2f}x" for o, t in zip(ours.token_gap_ms(), theirs.token_gap_ms(), strict=True))
    same = sum(o.text == t.text for o, t in zip(ours.requests, theirs.requests, strict=True))
    return (
        f"{'ratio':<13}{clients:>7}{'':>6}{ours.requests_per_s / theirs.requests_per_s:>7.2f}x"
        f"{ours.tokens_per_s / theirs.tokens_per_s:>7.2f}x{first}{gaps}  same text {same}/{len(ours.requests)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", default="1,8,32", help="concurrent client counts, comma-separated")
    parser.add_argument("--requests", type=int, default=32, help="requests per client count (at least the count)")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (greedy)")
    parser.add_argument("--servers", default="hybridkv,transformers", help=f"a subset of {','.join(SERVERS)}")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for every server (default: each server's own: transformers serve takes every core, "
        "hybridkv serve one fewer)",
    )
    args = parser.parse_args()
    levels = [int(count) for count in args.clients.split(",")]
    with tempfile.TemporaryDirectory(prefix="hybridkv-serving-") as tmp:
        workdir = Path(tmp)
        save_checkpoint(workdir / "model")
        results = {name: measure(name, workdir / "model", workdir, levels, args) for name in args.servers.split(",")}
    print(
        f"torch {torch.__version__}, {args.threads or 'default'} torch threads per server ({os.cpu_count()} cores), "
        f"{args.max_tokens} new tokens per request; latencies in ms"
    )
    for result in results.values():
        if isinstance(result, str):
            print(result)
    print(
        f"{'server':<13}{'clients':>7}{'reqs':>6}{'req/s':>8}{'tok/s':>8}"
        f"{'TTFT p50':>9}{'p90':>9}{'p99':>9}{'ITL p50':>9}{'p90':>9}{'p99':>9}"
    )
    measured = {name: result for name, result in results.items() if not isinstance(result, str)}
    for clients in levels:
        for name, by_clients in measured.items():
            print(row(name, clients, by_clients[clients]))
        if "hybridkv" in measured and "transformers" in measured:
            print(ratio_row(clients, measured["hybridkv"][clients], measured["transformers"][clients]))
        if "hybridkv" in measured and "hybridkv-json" in measured:
            free, constrained = measured["hybridkv"][clients], measured["hybridkv-json"][clients]
            tokens = [sum(r.completion_tokens for r in m.requests) / len(m.requests) for m in (free, constrained)]
            print(
                f"{'json / free':<13}{clients:>7}{'':>6}{constrained.requests_per_s / free.requests_per_s:>7.2f}x"
                f"{constrained.tokens_per_s / free.tokens_per_s:>7.2f}x  tokens per request {tokens[0]:.1f} free, "
                f"{tokens[1]:.1f} json"
            )
    for name, seconds in MASK_TIME.items():
        print(f"{name}: {seconds * 1e6:.0f} us per grammar mask (one constrained row, one step; the server's /metrics)")
    if "hybridkv" in measured and "transformers" in measured:
        print(
            "ratio: hybridkv / transformers for req/s and tok/s, transformers / hybridkv for latencies (above 1x:"
            " hybridkv better); same text = requests whose greedy completions are equal on both servers"
        )


if __name__ == "__main__":
    main()
