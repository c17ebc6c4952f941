"""Tiers beyond the pool (issue 64): a host tier for the blocks the pool evicts, a disk tier that outlives the
engine, and the errors of their settings. Every test compares tokens with an engine whose pool holds everything
(itself checked against `model.generate` across the suite), or with `model.generate` directly."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch

import hybridkv
from hybridkv.memory.tiers import BlockTiers
from hybridkv.tiny import tiny_model

from model_zoo import ZOO, slow_except
from tiny_models import hf_greedy

GREEDY = hybridkv.SamplingParams(temperature=0, max_tokens=4)


def llama():
    return tiny_model("llama", vocab_size=500, max_position_embeddings=1024)


MODELS = {
    "llama": llama,
    # Sliding (window 32) and full layers.
    "gemma3": lambda: tiny_model("gemma3", vocab_size=500, sliding_window=32, max_position_embeddings=1024),
    # Latent attention, paged as the latent.
    "minicpm3": ZOO["minicpm3"],
    # Gated DeltaNet state layers beside full attention: hits restore a state checkpoint, which the pool's few
    # checkpoint slots lose too (num_state_checkpoints below).
    "qwen3_5": lambda: tiny_model("qwen3_5", vocab_size=500, max_position_embeddings=1024),
}
# What each model needs besides: a state model's checkpoints as few as its pool's blocks.
EXTRA = {"qwen3_5": dict(num_state_checkpoints=4)}


def sessions(num_sessions: int = 6, doc_tokens: int = 96, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 250) for _ in range(doc_tokens)] for _ in range(num_sessions)]


def run_turns(llm, docs: list[list[int]], turns: int = 2) -> list[tuple[list[int], int]]:
    """Round robin over the documents, one request at a time, each turn asking again with a new question: each
    request's tokens and cached prompt tokens."""
    results = []
    for turn in range(turns):
        for doc in docs:
            output = llm.generate([doc + [7, 8, 9 + turn]], GREEDY, use_tqdm=False)[0]
            results.append((output.outputs[0].token_ids, output.num_cached_tokens))
    return results


def patched(model, **config):
    return hybridkv.patch(model, max_model_len=128, **config)


# The fast tier: full attention and state checkpoints (windows beside the tiers: test_kv_events.py's gemma3-host-tier).
@pytest.mark.parametrize("name", slow_except(list(MODELS), fast=("llama", "qwen3_5")))
def test_host_tier_brings_back_what_the_pool_evicted_and_keeps_tokens_exact(name):
    model = MODELS[name]()
    docs = sessions()
    reference = run_turns(patched(model, num_blocks=4000), docs)
    hybridkv.unpatch(model)
    extra = EXTRA.get(name, {})
    small = run_turns(patched(model, num_blocks=24, **extra), docs)
    hybridkv.unpatch(model)
    llm = patched(model, num_blocks=24, kv_offloading_size=0.05, **extra)
    tiered = run_turns(llm, docs)
    stats = llm.stats()
    llm.core.coordinator.tiers.check_integrity()
    llm.core.coordinator.pool.check_integrity()
    hybridkv.unpatch(model)
    assert [t for t, _ in tiered] == [t for t, _ in reference]
    assert [t for t, _ in small] == [t for t, _ in reference]
    # The pool alone loses every session before its next turn (LRU under a cyclic workload); the tier keeps them.
    assert sum(c for _, c in small) == 0
    second_turn = [c for _, c in tiered[len(docs) :]]
    assert second_turn == [c for _, c in reference[len(docs) :]] and min(second_turn) > 0
    host = stats["prefix_cache_tiers"]["host"]
    assert host["hit_tokens"] == sum(second_turn) and host["restored"] > 0 and host["stored"] > 0


def test_host_tier_tokens_equal_model_generate():
    model = llama()
    docs = sessions(num_sessions=4)
    llm = patched(model, num_blocks=24, kv_offloading_size=0.05)
    results = run_turns(llm, docs)
    hybridkv.unpatch(model)
    for index, (tokens, _) in enumerate(results):
        turn, doc = divmod(index, len(docs))
        assert tokens == hf_greedy(model, docs[doc] + [7, 8, 9 + turn], 4)[0]


def test_host_tier_never_serves_another_models_blocks():
    model = llama()
    docs = sessions(num_sessions=4)
    llm = patched(model, num_blocks=24, kv_offloading_size=0.05)
    run_turns(llm, docs, turns=1)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
    after = run_turns(llm, docs, turns=1)
    hybridkv.unpatch(model)
    assert all(cached == 0 for _, cached in after)
    for (tokens, _), doc in zip(after, docs, strict=True):
        assert tokens == hf_greedy(model, doc + [7, 8, 9], 4)[0]


def test_host_tier_under_preemption_by_swap_and_recompute():
    model = llama()
    docs = sessions(num_sessions=6, doc_tokens=64)
    prompts = [doc + [7, 8, 9] for doc in docs]
    params = hybridkv.SamplingParams(temperature=0, max_tokens=24)
    reference = [o.outputs[0].token_ids for o in patched(model, num_blocks=4000).generate(prompts, params)]
    hybridkv.unpatch(model)
    for mode in ("swap", "recompute"):
        llm = patched(model, num_blocks=12, kv_offloading_size=0.05, preemption_mode=mode, swap_space=0.01)
        for _ in range(2):  # the second round finds its prompts below the pool
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == reference, mode
        llm.core.coordinator.tiers.check_integrity()
        llm.core.coordinator.pool.check_integrity()
        assert llm.stats()["num_preemptions"] > 0
        hybridkv.unpatch(model)


def test_disk_tier_serves_a_new_engine_and_survives_damage(tmp_path):
    model = llama()
    rng = random.Random(3)
    prompt = [rng.randrange(5, 250) for _ in range(600)]
    config = dict(max_model_len=1024, prefix_cache_dir=tmp_path)
    first = hybridkv.patch(model, **config)
    expected = first.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert expected == hf_greedy(model, prompt, 4)[0]
    hybridkv.unpatch(model)
    files = sorted(tmp_path.rglob("*.kvb"))
    assert len(files) == 600 // 16  # every full block, written as it was cached

    second = hybridkv.patch(model, **config)  # a new engine: nothing in its pool
    output = second.generate([prompt], GREEDY, use_tqdm=False)[0]
    stats = second.stats()["prefix_cache_tiers"]
    hybridkv.unpatch(model)
    assert output.outputs[0].token_ids == expected
    assert output.num_cached_tokens >= 0.9 * len(prompt)
    assert stats["disk"]["hit_tokens"] == output.num_cached_tokens

    # Random bytes over every file, and one truncated: misses with one warning, never wrong tokens.
    for index, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if index == 0:
            path.write_bytes(bytes(data[: len(data) // 2]))
            continue
        for offset in rng.sample(range(len(data)), 8):
            data[offset] = rng.randrange(256)
        path.write_bytes(bytes(data))
    third = hybridkv.patch(model, **config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = third.generate([prompt], GREEDY, use_tqdm=False)[0]
    hybridkv.unpatch(model)
    assert output.outputs[0].token_ids == expected
    assert output.num_cached_tokens == 0
    assert sum("damaged" in str(w.message) for w in caught) == 1


def test_disk_tier_is_another_models_miss(tmp_path):
    model = llama()
    prompt = sessions(num_sessions=1, doc_tokens=200)[0]
    config = dict(max_model_len=256, prefix_cache_dir=tmp_path)
    hybridkv.patch(model, **config).generate([prompt], GREEDY, use_tqdm=False)
    hybridkv.unpatch(model)
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)
    llm = hybridkv.patch(model, **config)
    output = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    hybridkv.unpatch(model)
    assert output.num_cached_tokens == 0
    assert output.outputs[0].token_ids == hf_greedy(model, prompt, 4)[0]
    # Two fingerprints, two folders.
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


def test_disk_tier_stops_after_an_in_process_change_and_stays_under_its_size(tmp_path):
    model = llama()
    docs = sessions(num_sessions=4, doc_tokens=128)
    llm = hybridkv.patch(model, max_model_len=256, prefix_cache_dir=tmp_path)
    llm.generate([docs[0]], GREEDY, use_tqdm=False)
    files = list(tmp_path.rglob("*.kvb"))
    assert len(files) == 128 // 16
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(0.5)
    llm.generate([docs[1]], GREEDY, use_tqdm=False)
    hybridkv.unpatch(model)
    assert len(list(tmp_path.rglob("*.kvb"))) == len(files)  # the changed model is not the one the folder names
    # A bound of ten files: the oldest go first.
    bound = 10 * files[0].stat().st_size
    llm = hybridkv.patch(model, max_model_len=256, prefix_cache_dir=tmp_path, prefix_cache_dir_size=bound / 1024**3)
    llm.generate(docs, GREEDY, use_tqdm=False)
    removed = llm.stats()["prefix_cache_tiers"]["disk"]["evicted"]
    hybridkv.unpatch(model)
    assert sum(f.stat().st_size for f in tmp_path.rglob("*.kvb")) <= bound
    assert removed >= len(docs) * 128 // 16 - 10


def test_tier_settings_are_checked(tmp_path):
    model = llama()
    afile = tmp_path / "a-file"
    afile.write_text("x")
    cases = [
        (dict(kv_offloading_size=-1), "kv_offloading_size must be >= 0"),
        (dict(kv_offloading_size=1, kv_offloading_backend="lmcache"), "kv_offloading_backend='native'"),
        (dict(kv_offloading_size=1, kv_offloading_backend="other"), "kv_offloading_backend"),
        (dict(kv_offloading_backend="native"), "needs kv_offloading_size"),
        (dict(prefix_cache_dir=afile), "is a file"),
        (dict(prefix_cache_dir=afile / "below"), "cannot be made"),
        (dict(prefix_cache_dir=tmp_path, prefix_cache_dir_size=0), "prefix_cache_dir_size must be > 0"),
        (dict(kv_offloading_size=1, enable_prefix_caching=False), "enable_prefix_caching=False"),
        (dict(kv_offloading_size=10**6), "lower kv_offloading_size"),
        (dict(kv_offloading_size=1e-12), "holds no block"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            hybridkv.patch(model, max_model_len=256, **config)
        assert not hasattr(model, "_hybridkv_engine") or model._hybridkv_engine is None


class _Disk:
    def __init__(self) -> None:
        self.keys: set = set()

    def has(self, key):
        return key in self.keys

    def load(self, key, slot):
        return key in self.keys

    def save(self, key, block_id):
        self.keys.add(key)

    def counters(self):
        return {}


def test_block_tiers_lru_pins_and_staging():
    tiers = BlockTiers(2)
    tiers.evicted((0, b"a"), 5)
    tiers.evicted((0, b"b"), 6)
    # Both slots are pinned by this step's offloads: a third eviction finds no slot and keeps nothing.
    tiers.evicted((0, b"c"), 7)
    assert tiers.locate((0, b"c")) is None
    copies = tiers.take_copies()
    assert copies.offload == [(5, 1), (6, 0)] or copies.offload == [(5, 0), (6, 1)]
    tiers.evicted((0, b"c"), 7)  # the least recently used, b"a", goes
    assert tiers.locate((0, b"a")) is None and tiers.locate((0, b"c")) == "host"
    assert tiers.restore((0, b"b"), 9) == "host"
    tiers.check_integrity()
    tiers.forget()
    tiers.check_integrity()
    assert tiers.locate((0, b"b")) is None
    # Disk only: evictions keep nothing; a disk block is staged in a slot, free again after the step.
    disk = _Disk()
    staged = BlockTiers(1, disk, host_keeps=False)
    staged.evicted((0, b"x"), 3)
    assert staged.num_host_blocks == 0
    staged.cached((0, b"x"), 3)
    assert staged.restore((0, b"x"), 4) == "disk"
    assert staged.restore((0, b"x"), 5) is None  # its one slot is taken until the step's copies are made
    staged.take_copies()
    staged.check_integrity()
    assert staged.restore((0, b"x"), 5) == "disk"
    staged.model_changed(as_patched=False)
    assert staged.locate((0, b"x")) is None


def test_metrics_and_stats_split_hits_by_tier(tmp_path):
    from hybridkv.serving.metrics import ServerMetrics

    model = llama()
    llm = patched(model, num_blocks=24, kv_offloading_size=0.05, prefix_cache_dir=Path(tmp_path))
    results = run_turns(llm, sessions(num_sessions=4))
    stats = llm.stats()
    text = ServerMetrics(llm.stats).exposition().decode()
    hybridkv.unpatch(model)
    tiers = stats["prefix_cache_tiers"]
    assert set(tiers) == {"device", "host", "disk"}
    assert sum(t["hit_tokens"] for t in tiers.values()) == stats["prefix_cache_hits"] == sum(c for _, c in results)
    assert tiers["host"]["hit_tokens"] > 0
    assert 'hybridkv_prefix_cache_tier_hits_total{tier="host"}' in text


def test_tiers_keep_every_mode_exact(tmp_path):
    """Async scheduling, speculative decoding (n-gram), n > 1 and beam search on a small pool with both tiers: the
    tokens of a pool that holds everything, and prefixes found below the pool."""
    model = llama()
    docs = sessions(num_sessions=5, doc_tokens=80)
    prompts = [doc + [7, 8, 9] for doc in docs]
    sampled = hybridkv.SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    tiers = dict(kv_offloading_size=0.05, prefix_cache_dir=tmp_path)

    def outputs(llm, params):
        return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]

    def beams(llm):
        found = llm.beam_search([{"prompt_token_ids": p} for p in prompts[:2]], hybridkv.BeamSearchParams(2, 4))
        return [[seq.tokens for seq in out.sequences] for out in found]

    cases = [
        ("async", dict(async_scheduling=True), lambda llm: outputs(llm, GREEDY)),
        ("speculative", dict(speculative_config=ngram), lambda llm: outputs(llm, GREEDY)),
        ("n=2", {}, lambda llm: outputs(llm, sampled)),
        ("beams", {}, beams),
    ]
    for name, config, run in cases:
        reference = run(patched(model, num_blocks=4000, **config))
        hybridkv.unpatch(model)
        llm = patched(model, num_blocks=24, **config, **tiers)
        first, second = run(llm), run(llm)  # the second finds the prompts below the pool
        hits = llm.stats()["prefix_cache_tiers"]
        llm.core.coordinator.tiers.check_integrity()
        llm.core.coordinator.pool.check_integrity()
        hybridkv.unpatch(model)
        assert first == reference and second == reference, name
        assert hits["host"]["hit_tokens"] + hits["disk"]["hit_tokens"] > 0, name


def test_reset_prefix_cache_drops_the_host_tier_and_the_disk_on_request(tmp_path):
    model = llama()
    docs = sessions(num_sessions=4)
    llm = patched(model, num_blocks=24, kv_offloading_size=0.05, prefix_cache_dir=tmp_path)
    run_turns(llm, docs, turns=1)
    assert llm.core.coordinator.tiers.num_host_blocks > 0
    llm.reset_prefix_cache()
    assert llm.core.coordinator.tiers.num_host_blocks == 0
    again = run_turns(llm, docs, turns=1)
    assert all(cached == 0 for _, cached in again)  # nothing below the pool is read after a reset
    assert list(tmp_path.rglob("*.kvb"))  # the files stay, for a new process
    llm.reset_prefix_cache(reset_disk=True)
    hybridkv.unpatch(model)
    assert not list(tmp_path.rglob("*.kvb"))


def test_sleep_and_wake_up_with_tiers(tmp_path):
    model = llama()
    docs = sessions(num_sessions=4)
    reference = run_turns(patched(model, num_blocks=4000), docs, turns=1)
    hybridkv.unpatch(model)
    llm = patched(model, num_blocks=24, kv_offloading_size=0.05, prefix_cache_dir=tmp_path)
    run_turns(llm, docs, turns=1)
    llm.sleep()
    llm.wake_up()
    after = run_turns(llm, docs, turns=1)
    hybridkv.unpatch(model)
    assert [t for t, _ in after] == [t for t, _ in reference]
    assert sum(c for _, c in after) > 0  # the disk's files outlive the pages


def test_a_request_says_which_tier_gave_its_prefix_and_why_its_hit_stopped():
    model = tiny_model("gemma3", vocab_size=500, sliding_window=32, max_position_embeddings=1024)
    docs = sessions(num_sessions=6)
    llm = patched(model, num_blocks=24)
    first = llm.generate([docs[0] + [1, 2, 3]], GREEDY, use_tqdm=False)[0]
    # Group 0 holds the sliding layers (tiny Gemma 3 starts with them).
    assert first.metrics.prefix_cache_miss == {
        "group": 0,
        "kind": "sliding window",
        "tokens": 0,
        "reason": "never cached",
    }
    again = llm.generate([docs[0] + [4, 5, 6]], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 96 and again.metrics.prefix_cache_tiers == {"device": 96, "host": 0, "disk": 0}
    assert again.metrics.prefix_cache_miss is None  # every full block of the prompt was a hit
    for doc in docs[1:]:  # the cyclic workload evicts the first document
        llm.generate([doc + [1, 2, 3]], GREEDY, use_tqdm=False)
    lost = llm.generate([docs[0] + [7, 8, 9]], GREEDY, use_tqdm=False)[0]
    hybridkv.unpatch(model)
    assert lost.num_cached_tokens == 0
    assert lost.metrics.prefix_cache_miss["reason"] == "evicted" and lost.metrics.prefix_cache_miss["tokens"] == 0
    llm = patched(model, num_blocks=24, kv_offloading_size=0.05)
    for doc in docs:
        llm.generate([doc + [1, 2, 3]], GREEDY, use_tqdm=False)
    back = llm.generate([docs[0] + [7, 8, 9]], GREEDY, use_tqdm=False)[0]
    hybridkv.unpatch(model)
    assert back.metrics.prefix_cache_tiers == {"device": 0, "host": 96, "disk": 0}


def test_unpatch_with_tiers_frees_every_block_without_the_cycle_collector(tmp_path):
    """The pool's and the tiers' callbacks into the coordinator are dropped at unpatch: no cycle keeps the blocks."""
    import gc

    from hybridkv.memory.block_pool import KVBlock

    def live_blocks():
        return sum(type(o) is KVBlock for o in gc.get_objects())

    model = tiny_model("qwen3_5", vocab_size=500, max_position_embeddings=1024)
    gc.collect()
    gc.disable()
    try:
        before = live_blocks()
        llm = patched(model, num_blocks=24, num_state_checkpoints=4, kv_offloading_size=0.05, prefix_cache_dir=tmp_path)
        run_turns(llm, sessions(num_sessions=2), turns=1)
        assert live_blocks() >= before + 24
        hybridkv.unpatch(model)
        del llm
        assert live_blocks() == before
    finally:
        gc.enable()


def test_disk_tier_writes_when_the_engine_goes_idle_and_labels_a_damaged_chain_by_tier(tmp_path):
    """A request that stops at its first token has its blocks on disk when generate returns (no later step, no
    unpatch); a damaged file in the middle of a chain: the blocks before it still count as the disk's."""
    model = llama()
    prompt = sessions(num_sessions=1, doc_tokens=500)[0]
    one = hybridkv.SamplingParams(temperature=0, max_tokens=1)
    llm = hybridkv.patch(model, max_model_len=1024, prefix_cache_dir=tmp_path)
    expected = llm.generate([prompt], one, use_tqdm=False)[0].outputs[0].token_ids
    files = sorted(tmp_path.rglob("*.kvb"), key=lambda path: path.stat().st_mtime_ns)
    assert len(files) == 500 // 16 and llm.stats()["prefix_cache_tiers"]["disk"]["stored"] == 500 // 16
    hybridkv.unpatch(model)
    # The file of block 22 (written in chain order) damaged.
    damaged = files[22]
    damaged.write_bytes(damaged.read_bytes()[:-7] + b"garbage")
    llm = hybridkv.patch(model, max_model_len=1024, prefix_cache_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output = llm.generate([prompt], one, use_tqdm=False)[0]
    hybridkv.unpatch(model)
    assert output.outputs[0].token_ids == expected
    assert output.num_cached_tokens == 22 * 16
    assert output.metrics.prefix_cache_tiers == {"device": 0, "host": 0, "disk": 22 * 16}


def test_fp8_pages_go_below_the_pool_and_come_back_exact(tmp_path):
    """e4m3 pages (per-layer scales fixed at patch time) through both tiers: the tokens of an fp8 pool that holds
    everything, the second turn's prefixes from the host tier, and a new engine's from disk."""
    model = MODELS["gemma3"]()
    docs = sessions(num_sessions=6)
    fp8 = dict(kv_cache_dtype="fp8")
    reference = run_turns(patched(model, num_blocks=4000, **fp8), docs)
    hybridkv.unpatch(model)
    llm = patched(model, num_blocks=24, kv_offloading_size=0.05, prefix_cache_dir=tmp_path, **fp8)
    tiered = run_turns(llm, docs)
    host = llm.stats()["prefix_cache_tiers"]["host"]["hit_tokens"]
    hybridkv.unpatch(model)
    assert [t for t, _ in tiered] == [t for t, _ in reference] and host > 0
    assert sum(c for _, c in tiered[len(docs) :]) == sum(c for _, c in reference[len(docs) :])
    llm = patched(model, num_blocks=24, prefix_cache_dir=tmp_path, **fp8)
    again = run_turns(llm, docs, turns=1)
    disk = llm.stats()["prefix_cache_tiers"]["disk"]["hit_tokens"]
    hybridkv.unpatch(model)
    assert [t for t, _ in again] == [t for t, _ in reference[: len(docs)]] and disk > 0
    # 16-bit pages of the same model are another layout: nothing read from the fp8 files.
    llm = patched(model, num_blocks=24, prefix_cache_dir=tmp_path)
    plain = run_turns(llm, docs, turns=1)
    hybridkv.unpatch(model)
    assert all(cached == 0 for _, cached in plain)


def test_image_prompts_below_the_pool_hit_their_own_image_only():
    """Blocks are keyed by their images: a prompt evicted to the host tier comes back for the same image, and the
    same tokens with another image find nothing there; tokens equal `model.generate(pixel_values=...)`'s."""
    from test_images import image_inputs, mistral3, prompt_ids, reference

    model, placeholder, count, type_fields = mistral3()
    ids = [prompt_ids("mistral3", placeholder, count, "first", seed=seed) for seed in range(4)]
    images = [image_inputs("mistral3", 10 + seed, 1) for seed in range(4)]
    expected = [reference(model, p, d, type_fields, placeholder) for p, d in zip(ids, images, strict=True)]
    params = hybridkv.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = hybridkv.patch(model, max_model_len=48, block_size=4, num_blocks=14, kv_offloading_size=0.05)

    def run(prompt, data):
        (output,) = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": data}], params, use_tqdm=False)
        assert output.error is None
        return output

    try:
        for _ in range(2):
            outputs = [run(p, d) for p, d in zip(ids, images, strict=True)]
            assert [o.outputs[0].token_ids for o in outputs] == expected
        assert all(o.metrics.num_cached_tokens > 0 for o in outputs)
        assert llm.stats()["prefix_cache_tiers"]["host"]["hit_tokens"] > 0
        other = image_inputs("mistral3", 99, 1)
        swapped = run(ids[0], other)  # the first prompt's tokens, another image: it starts with the image
        assert swapped.metrics.num_cached_tokens == 0
        assert swapped.outputs[0].token_ids == reference(model, ids[0], other, type_fields, placeholder)
        llm.core.coordinator.tiers.check_integrity()
    finally:
        hybridkv.unpatch(model)
