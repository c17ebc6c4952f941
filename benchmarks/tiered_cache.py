"""KV memory beyond the pool: returning sessions' prefix-cache hits and first-token times, pool vs host and disk tiers.

Part 1 (`--sessions`, the default): eight chat sessions, served round robin one request at a time, six turns
each. Every session has its own 192-token document (random ids, seeded); a turn appends 24 new user tokens and
generates 8 tokens greedily (fp32, CPU, block size 16), and the next turn's prompt is the previous one + its 8
tokens + 24 new user tokens, so its prefix is the previous turn's whole sequence (384 tokens after turn 6).
Models, tiny and random (hybridkv.tiny): a Gemma 3 (5 sliding-window layers of window 16, 1 full: 6 KV cache
groups), a Llama (2 full layers, 1 group) and a Qwen3.5-style state hybrid (3 Gated DeltaNet : 1 full; its hits
land on state checkpoints, every 64 tokens). Modes:
  unbounded  num_blocks=10,000: nothing is evicted; the reference for tokens and hits
  pool       a pool of a quarter of the eight sessions' final history in blocks (384 tokens in every KV cache
             group, `--pool-blocks` to override): under this cyclic workload LRU evicts a session's blocks
             before it returns, so it hits (near) nothing
  host       the same pool + a host-RAM tier that holds every session (`kv_offloading_size`, GiB, from
             `llm.bytes_per_block`; `kv_offloading_backend="native"`)
  disk       the same pool + a disk tier only (`prefix_cache_dir` in a temporary folder, `prefix_cache_dir_size`)
Printed per model and mode: prompt tokens served from the cache over turns 2-6 (`num_cached_tokens`), that as a
share of the unbounded pool's, whether every turn's tokens equal the unbounded pool's (MISMATCH, exit status 1,
if not), the seconds of the 48 requests, and `stats()["prefix_cache_tiers"]` where there is one.

Part 2 (`--ttft`): a returning session's time to first token on a Llama large enough for prefill to matter on a
CPU (12 layers, hidden 512, 8 heads and 8 KV heads, intermediate 1,024, vocab 1,000; `--layers`): its first
request (a 2,048-token document, `--doc-tokens`, + a 32-token question, one token), then two other documents'
requests, which evict it from a pool of 1.5 requests' blocks (too small to hold two documents), then the
returning request (the same document + a new question, one token), timed with `time.perf_counter` around
`generate`. Modes: recompute (the pool alone: the document is computed again), host tier, disk tier (no host
tier), and a new process: this script again (`--ttft-child`), on a freshly built model with the same weights
(the same seed, checked by a checksum) and the disk tier's folder, timed after a short unrelated request (a new
process's first request pays one-off costs). Each mode has its own model and engine, and each round times every
mode once (eviction traffic first; the in-process modes in turn, the new process last), --repeats rounds. Printed:
the median TTFT of each mode, recompute's over it (restoring should be >= 3x faster), the cached prompt tokens
(recompute must show none) and whether every mode's token is recompute's.

Modes whose settings this hybridkv does not take yet are skipped with a note.

    python benchmarks/tiered_cache.py [--sessions] [--models gemma3,llama,qwen3_5] [--modes unbounded,pool,host,disk]
                                      [--pool-blocks N]
    python benchmarks/tiered_cache.py --ttft [--doc-tokens 2048] [--layers 12] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import hybridkv
from hybridkv import SamplingParams
from hybridkv.tiny import tiny_model

BLOCK_SIZE = 16
GIB = 2**30
SESSIONS, TURNS, DOC_TOKENS, USER_TOKENS, MAX_NEW = 8, 6, 192, 24, 8
FINAL_TOKENS = DOC_TOKENS + TURNS * (USER_TOKENS + MAX_NEW)
SESSION_MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "gemma3": lambda: tiny_model("gemma3"),
    "llama": lambda: tiny_model("llama"),
    "qwen3_5": lambda: tiny_model("qwen3_5"),
}
SESSION_MODES = ("unbounded", "pool", "host", "disk")
TTFT_MODES = ("recompute", "host", "disk")
TTFT_VOCAB, QUESTION_TOKENS, OTHER_DOCUMENTS = 1000, 32, 2
TIER_SETTINGS = ("kv_offloading_size", "kv_offloading_backend", "prefix_cache_dir", "prefix_cache_dir_size")


def mode_settings(mode: str, pool_blocks: int, tier_gib: float, cache_dir: str) -> dict[str, Any]:
    """The `hybridkv.patch` settings of a mode beyond the block size: its pool and its tiers."""
    if mode == "unbounded":
        return dict(num_blocks=10_000)
    settings: dict[str, Any] = dict(num_blocks=pool_blocks)
    if mode == "host":
        settings.update(kv_offloading_size=tier_gib, kv_offloading_backend="native")
    elif mode == "disk":  # the default bound (10 GiB): a disk holds every session
        settings.update(prefix_cache_dir=cache_dir)
    return settings


def patched(model: torch.nn.Module, settings: dict[str, Any]) -> hybridkv.LLMEngine:
    """`hybridkv.patch(model, **settings)` at the benchmark's block size, without progress bars."""
    return hybridkv.patch(model, block_size=BLOCK_SIZE, use_tqdm=False, **settings)


def history_blocks(llm: hybridkv.LLMEngine, tokens: int) -> int:
    """Blocks `tokens` tokens fill in every KV cache group of the engine's model together."""
    return sum(math.ceil(tokens / group.block_size) for group in llm.kv_config.groups)


def random_ids(seed: str, count: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(count)]


# ---- part 1: returning chat sessions ------------------------------------------------------------------------


def run_sessions(llm: hybridkv.LLMEngine, vocab: int) -> tuple[list[list[list[int]]], list[list[int]], float]:
    """The sessions' turns, round robin: each turn's generated tokens and cached prompt tokens, per session, and
    the seconds of all the requests."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    histories = [random_ids(f"document {s}", DOC_TOKENS, vocab) for s in range(SESSIONS)]
    generated: list[list[list[int]]] = [[] for _ in range(SESSIONS)]
    cached: list[list[int]] = [[] for _ in range(SESSIONS)]
    start = time.perf_counter()
    for turn in range(TURNS):
        for session in range(SESSIONS):
            prompt = histories[session] + random_ids(f"user {session} {turn}", USER_TOKENS, vocab)
            (output,) = llm.generate([prompt], params, use_tqdm=False)
            tokens = list(output.outputs[0].token_ids)
            generated[session].append(tokens)
            cached[session].append(output.num_cached_tokens)
            histories[session] = prompt + tokens
    return generated, cached, time.perf_counter() - start


def sessions_row(name: str, modes: list[str], pool_override: int | None) -> bool:
    """Every mode on one model, the unbounded pool first; False if a mode's tokens differ from the unbounded's."""
    model = SESSION_MODELS[name]()
    llm = hybridkv.patch(model, block_size=BLOCK_SIZE, use_tqdm=False, **mode_settings("unbounded", 0, 0.0, ""))
    history = SESSIONS * history_blocks(llm, FINAL_TOKENS)
    pool_blocks = pool_override or history // 4
    # Every session's blocks and state checkpoints, a quarter to spare.
    stats = llm.stats()
    checkpoints = stats["state_checkpoint_interval"] and SESSIONS * FINAL_TOKENS // stats["state_checkpoint_interval"]
    tier_bytes = history * llm.bytes_per_block + checkpoints * stats["state_bytes_per_request"]
    tier_gib = tier_bytes * 1.25 / GIB
    groups = ", ".join(group.kind for group in llm.kv_config.groups)
    print(
        f"{name}: groups [{groups}]; history {history:,} blocks of {llm.bytes_per_block:,} bytes; pool "
        f"{pool_blocks} blocks; tiers {tier_gib:.4f} GiB"
    )
    reference, reference_hits = sessions_mode(model, "unbounded", llm)
    same_everywhere = True
    with tempfile.TemporaryDirectory(prefix="hybridkv-tiered-") as cache_dir:
        for mode in modes:
            if mode == "unbounded":
                continue
            llm = patched(model, mode_settings(mode, pool_blocks, tier_gib, cache_dir))
            same_everywhere &= sessions_mode(model, mode, llm, reference, reference_hits) is not None
    return same_everywhere


def sessions_mode(
    model: torch.nn.Module,
    mode: str,
    llm: hybridkv.LLMEngine,
    reference: list[list[list[int]]] | None = None,
    reference_hits: int = 0,
) -> tuple[list[list[list[int]]], int] | None:
    """Run the sessions on `llm` (then unpatch) and print its row against the unbounded pool's tokens and hits
    (itself when `reference` is None): its tokens and hits, None where its tokens differ."""
    generated, cached, seconds = run_sessions(llm, model.config.vocab_size)
    stats = llm.stats()
    hybridkv.unpatch(model)
    hits = sum(sum(turns[1:]) for turns in cached)
    if reference is None:
        reference, reference_hits = generated, hits
    mismatched = sum(
        mine != theirs
        for session, turns in enumerate(generated)
        for mine, theirs in zip(turns, reference[session], strict=True)
    )
    share = hits / reference_hits if reference_hits else float("nan")
    same = "yes" if not mismatched else f"MISMATCH in {mismatched} of {SESSIONS * TURNS} turns"
    print(
        f"  {mode:<10}{stats['num_blocks']:>7}{hits:>10,}{share:>9.1%}  {same:<6}{stats['num_evictions']:>10,}"
        f"{seconds:>9.1f}"
    )
    if "prefix_cache_tiers" in stats:
        print(f"    tiers: {stats['prefix_cache_tiers']}")
    return None if mismatched else (generated, hits)


def sessions(args: argparse.Namespace) -> bool:
    modes = args.modes.split(",")
    print(
        f"torch {torch.__version__}; {SESSIONS} sessions x {TURNS} turns, round robin, one request at a time: "
        f"{DOC_TOKENS}-token documents, {USER_TOKENS} user tokens and {MAX_NEW} generated a turn "
        f"({FINAL_TOKENS} tokens at the end); block size {BLOCK_SIZE}"
    )
    print(f"  {'mode':<10}{'blocks':>7}{'cached':>10}{'share':>9}  {'same':<6}{'evictions':>10}{'seconds':>9}")
    results = [sessions_row(name, modes, args.pool_blocks) for name in args.models.split(",")]
    print(
        "cached = prompt tokens served from the prefix cache over turns 2-6; share = of the unbounded pool's; "
        "same = every turn's tokens equal the unbounded pool's"
    )
    return all(results)


# ---- part 3: eviction in the pool alone ----------------------------------------------------------------------

SYSTEM_TOKENS, USERS, ROUNDS, USER_DOC_TOKENS, QUESTION = 256, 8, 3, 96, 16


def run_system_prompt(llm: hybridkv.LLMEngine, vocab: int) -> tuple[list[list[int]], int]:
    """The shared-system-prompt workload: every request is one system prompt + its user's document + a question of
    its round, users round robin, rounds after each other: each request's tokens, and the cached prompt tokens."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    system = random_ids("system", SYSTEM_TOKENS, vocab)
    tokens, cached = [], 0
    for round_index in range(ROUNDS):
        for user in range(USERS):
            prompt = system + random_ids(f"user {user}", USER_DOC_TOKENS, vocab)
            prompt += random_ids(f"question {user} {round_index}", QUESTION, vocab)
            (output,) = llm.generate([prompt], params, use_tqdm=False)
            tokens.append(list(output.outputs[0].token_ids))
            cached += output.num_cached_tokens
    return tokens, cached


def eviction(args: argparse.Namespace) -> bool:
    """Plain LRU against window-aware eviction (`KVCacheCoordinator.window_aware_eviction`), the pool alone, on the
    sessions workload and the shared-system-prompt one, alternated; False if their tokens differ."""
    from hybridkv.memory.coordinator import KVCacheCoordinator

    print(
        f"torch {torch.__version__}; the pool alone: plain LRU against window-aware eviction (blocks a window left "
        f"behind reused before other cached blocks); cached prompt tokens (sessions: turns 2-{TURNS}; system prompt: "
        f"{USERS} users x {ROUNDS} rounds of a {SYSTEM_TOKENS}-token system prompt + a {USER_DOC_TOKENS}-token "
        f"document + a {QUESTION}-token question)"
    )
    same = True
    for name in args.models.split(","):
        model = SESSION_MODELS[name]()
        probe = patched(model, mode_settings("unbounded", 0, 0.0, ""))
        history = SESSIONS * history_blocks(probe, FINAL_TOKENS)
        system_history = history_blocks(probe, SYSTEM_TOKENS) + USERS * history_blocks(
            probe, USER_DOC_TOKENS + QUESTION + MAX_NEW
        )
        unbounded = (run_sessions(probe, model.config.vocab_size), run_system_prompt(probe, model.config.vocab_size))
        hybridkv.unpatch(model)
        # The system-prompt workload's pool: half its history, at least a request at the model's length.
        system_pool = max(system_history // 2, history_blocks(probe, probe.max_model_len) + 1)
        for label, blocks in (("quarter", history // 4), ("half", history // 2)):
            system_blocks = system_pool if label == "quarter" else system_history
            results = {}
            for window_aware in (False, True):
                KVCacheCoordinator.window_aware_eviction = window_aware
                try:
                    llm = patched(model, dict(num_blocks=blocks))
                    generated, cached, _ = run_sessions(llm, model.config.vocab_size)
                    hybridkv.unpatch(model)
                    llm = patched(model, dict(num_blocks=system_blocks))
                    system_tokens, system_cached = run_system_prompt(llm, model.config.vocab_size)
                    hybridkv.unpatch(model)
                finally:
                    KVCacheCoordinator.window_aware_eviction = True
                results[window_aware] = (sum(sum(t[1:]) for t in cached), system_cached)
                same &= generated == unbounded[0][0] and system_tokens == unbounded[1][0]
            (lru_sessions, lru_system), (window_sessions, window_system) = results[False], results[True]
            print(
                f"  {name:<8} pool {label:<7} ({blocks:>4} / {system_blocks:>4} blocks): "
                f"sessions LRU {lru_sessions:>6,} window-aware {window_sessions:>6,} "
                f"(unbounded {sum(sum(t[1:]) for t in unbounded[0][1]):,}); "
                f"system prompt LRU {lru_system:>6,} window-aware {window_system:>6,} (unbounded {unbounded[1][1]:,})"
            )
    print("same tokens as the unbounded pool in every run:", "yes" if same else "MISMATCH")
    return same


# ---- part 2: a returning session's time to first token ---------------------------------------------------------


def ttft_model(layers: int, doc_tokens: int) -> torch.nn.Module:
    return tiny_model(
        "llama", vocab_size=TTFT_VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8, initializer_range=0.02,
        max_position_embeddings=max(4096, 2 * doc_tokens),
    )  # fmt: skip


def ttft_settings(mode: str, doc_tokens: int, pool_blocks: int, tier_gib: float, cache_dir: str) -> dict[str, Any]:
    """A mode's settings, with a max_model_len of one request (the pool must hold one at max_model_len)."""
    return dict(mode_settings(mode, pool_blocks, tier_gib, cache_dir), max_model_len=doc_tokens + 2 * QUESTION_TOKENS)


def weights_checksum(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def document(doc_tokens: int, index: int) -> list[int]:
    """Document 0 is the returning session's, the others are traffic."""
    return random_ids(f"ttft document {index}", doc_tokens, TTFT_VOCAB)


def question(tag: str) -> list[int]:
    """Round r's question is `question(str(r))` in every in-process mode; the new process asks `f"process {r}"`,
    so that it finds only the document on the disk, not the disk mode's question blocks of the round."""
    return random_ids(f"question {tag}", QUESTION_TOKENS, TTFT_VOCAB)


def first_token(llm: hybridkv.LLMEngine, prompt: list[int]) -> tuple[float, int, int]:
    """Seconds to the first (only) token of `prompt`, the token, and the prompt tokens served from the cache."""
    start = time.perf_counter()
    (output,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - start, output.outputs[0].token_ids[0], output.num_cached_tokens


def ttft_child(args: argparse.Namespace) -> None:
    """A new process: the same model on the disk tier's folder, the returning request timed; one JSON line."""
    model = ttft_model(args.layers, args.doc_tokens)
    settings = ttft_settings("disk", args.doc_tokens, args.pool_blocks, args.tier_gib, args.ttft_child)
    llm = hybridkv.patch(model, block_size=BLOCK_SIZE, use_tqdm=False, **settings)
    # A short unrelated request first, as the in-process engines served one: a new process's first request pays
    # one-off costs (0.05-0.4 s seen on a 2-layer model) that are no part of restoring.
    first_token(llm, question("warm-up"))
    seconds, token, cached = first_token(llm, document(args.doc_tokens, 0) + question(f"process {args.round}"))
    tiers = llm.stats().get("prefix_cache_tiers")
    result = dict(checksum=weights_checksum(model), seconds=seconds, token=token, cached=cached, tiers=tiers)
    print(json.dumps(result))


def run_child(args: argparse.Namespace, cache_dir: str, pool_blocks: int, tier_gib: float, round_index: int) -> dict:
    command = [
        sys.executable, __file__, "--ttft-child", cache_dir, "--round", str(round_index), "--layers",
        str(args.layers), "--doc-tokens", str(args.doc_tokens), "--pool-blocks", str(pool_blocks), "--tier-gib",
        str(tier_gib),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the new process failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ttft(args: argparse.Namespace) -> bool:
    """Part 2; False where a check failed (weights, eviction, tokens)."""
    models = {mode: ttft_model(args.layers, args.doc_tokens) for mode in TTFT_MODES}
    checksum = weights_checksum(models["recompute"])
    probe = hybridkv.patch(models["recompute"], block_size=BLOCK_SIZE, use_tqdm=False)
    request_blocks = history_blocks(probe, args.doc_tokens + QUESTION_TOKENS + 1)
    pool_blocks = args.pool_blocks or request_blocks * 3 // 2
    # Every document and its questions, twice over.
    tier_gib = 2 * (1 + OTHER_DOCUMENTS) * request_blocks * probe.bytes_per_block / GIB
    print(
        f"torch {torch.__version__}; Llama, {args.layers} layers, hidden 512; a {args.doc_tokens:,}-token document "
        f"+ {QUESTION_TOKENS}-token questions, {OTHER_DOCUMENTS} other documents between; pool {pool_blocks} "
        f"blocks ({request_blocks} a request) of {probe.bytes_per_block:,} bytes; tiers {tier_gib:.3f} GiB; "
        f"weights {checksum}"
    )
    ok = True
    for mode, model in models.items():
        if weights_checksum(model) != checksum:
            print(f"MISMATCH: the {mode} model's weights differ from the recompute model's")
            ok = False
    seconds: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    cached: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="hybridkv-tiered-") as cache_dir:
        engines: dict[str, hybridkv.LLMEngine] = {}
        for mode, model in models.items():
            llm = patched(model, ttft_settings(mode, args.doc_tokens, pool_blocks, tier_gib, cache_dir))
            engines[mode] = llm
            first_token(llm, document(args.doc_tokens, 0) + question("first"))
        if "disk" not in engines:
            print(f"  {'process':<10}skipped: a new process needs the disk tier")
        for round_index in range(args.repeats):
            turn = round_index % len(engines)
            for mode in list(engines)[turn:] + list(engines)[:turn]:
                llm = engines[mode]
                for other in range(1, OTHER_DOCUMENTS + 1):
                    first_token(llm, document(args.doc_tokens, other) + question(str(round_index)))
                run_s, token, hit = first_token(llm, document(args.doc_tokens, 0) + question(str(round_index)))
                seconds.setdefault(mode, []).append(run_s)
                tokens.setdefault(mode, []).append(token)
                cached.setdefault(mode, []).append(hit)
            if "disk" in engines:
                child = run_child(args, cache_dir, pool_blocks, tier_gib, round_index)
                if child["checksum"] != checksum:
                    print(f"MISMATCH: the new process's weights are {child['checksum']}, not {checksum}")
                    ok = False
                seconds.setdefault("process", []).append(child["seconds"])
                tokens.setdefault("process", []).append(child["token"])
                cached.setdefault("process", []).append(child["cached"])
        tiers = {mode: llm.stats().get("prefix_cache_tiers") for mode, llm in engines.items()}
    expected = dict.fromkeys(seconds, tokens["recompute"])
    if "process" in seconds:  # the new process's prompts, computed after the timed rounds
        recompute = engines["recompute"]
        expected["process"] = [
            first_token(recompute, document(args.doc_tokens, 0) + question(f"process {r}"))[1]
            for r in range(args.repeats)
        ]
    for model in models.values():
        hybridkv.unpatch(model)
    recompute_s = statistics.median(seconds["recompute"])
    print(f"  {'mode':<10}{'TTFT ms':>9}{'runs ms':>22}{'cached':>20}{'recompute/mode':>16}  same token")
    for mode, runs in seconds.items():
        median_s = statistics.median(runs)
        runs_ms = ",".join(f"{s * 1000:.0f}" for s in runs)
        hits = ",".join(str(c) for c in cached[mode])
        same = "yes" if tokens[mode] == expected[mode] else f"MISMATCH {tokens[mode]} vs {expected[mode]}"
        ok = ok and same == "yes"
        print(f"  {mode:<10}{median_s * 1000:>9.1f}{runs_ms:>22}{hits:>20}{recompute_s / median_s:>15.2f}x  {same}")
        if tiers.get(mode):
            print(f"    tiers: {tiers[mode]}")
    if any(cached["recompute"]):
        print(f"MISMATCH: the pool alone served {cached['recompute']} tokens: the traffic did not evict the document")
        ok = False
    print(
        "TTFT = seconds of generate with max_tokens=1, median of the rounds; cached = prompt tokens served from the "
        "cache, per round; restoring should be >= 3x faster than recomputing"
    )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    part = parser.add_mutually_exclusive_group()
    part.add_argument("--sessions", action="store_true", help="part 1 (the default): returning chat sessions")
    part.add_argument("--ttft", action="store_true", help="part 2: a returning session's time to first token")
    part.add_argument("--eviction", action="store_true", help="part 3: LRU against window-aware eviction")
    parser.add_argument("--models", default=",".join(SESSION_MODELS))
    parser.add_argument("--modes", default=",".join(SESSION_MODES))
    parser.add_argument("--pool-blocks", type=int, default=None, help="the small pool (default: computed)")
    parser.add_argument("--doc-tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttft-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tier-gib", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ttft_child is not None:
        ttft_child(args)
        return
    unknown = (set(args.models.split(",")) - set(SESSION_MODELS)) | (set(args.modes.split(",")) - set(SESSION_MODES))
    if unknown:
        parser.error(f"unknown models or modes: {', '.join(sorted(unknown))}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if not (ttft(args) if args.ttft else eviction(args) if args.eviction else sessions(args)):
        sys.exit(1)


if __name__ == "__main__":
    main()
