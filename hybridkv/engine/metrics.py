"""The engine's counters as vLLM's metric objects (`vllm.v1.metrics.reader`): `LLMEngine.get_metrics()` returns them,
and the server's `/metrics` writes the same series for Prometheus (hybridkv/serving/metrics.py).

Each value is read from `stats()` when asked. A series has vLLM's name where vLLM has one
(`vllm:num_requests_running`, ...), hybridkv's otherwise (`hybridkv_kv_blocks_in_use`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# (hybridkv's name, vLLM's name or None, type, stats() key, help)
ENGINE_METRICS = (
    ("hybridkv_num_requests_running", "vllm:num_requests_running", "gauge", "num_running",
     "Requests (samples) being computed."),
    ("hybridkv_num_requests_waiting", "vllm:num_requests_waiting", "gauge", "num_waiting",
     "Requests waiting to be scheduled."),
    ("hybridkv_num_requests_swapped", "vllm:num_requests_swapped", "gauge", "num_swapped",
     "Requests swapped out to CPU memory."),
    ("hybridkv_kv_blocks_total", None, "gauge", "num_blocks", "KV blocks in the pool, the null block included."),
    ("hybridkv_kv_blocks_in_use", None, "gauge", "blocks_in_use", "KV blocks held by requests."),
    ("hybridkv_prefix_cache_queries", "vllm:prefix_cache_queries", "counter", "prefix_cache_queries",
     "Prompt tokens looked up."),
    ("hybridkv_prefix_cache_hits", "vllm:prefix_cache_hits", "counter", "prefix_cache_hits",
     "Prompt tokens found in the cache."),
    ("hybridkv_num_preemptions", "vllm:num_preemptions", "counter", "num_preemptions", "Requests preempted."),
    ("hybridkv_prompt_tokens", "vllm:prompt_tokens", "counter", "num_prompt_tokens",
     "Prompt tokens of the requests added."),
    ("hybridkv_generation_tokens", "vllm:generation_tokens", "counter", "num_generated_tokens", "Tokens generated."),
    ("hybridkv_structured_output_masks", None, "counter", "structured_output_masks",
     "Next-token grammar masks computed for structured outputs (one per constrained sample per step)."),
    ("hybridkv_structured_output_mask_seconds", None, "counter", "structured_output_mask_seconds",
     "Seconds spent computing and applying structured outputs' grammar masks."),
)  # fmt: skip


# vLLM's speculative decoding counters, where a speculative_config is set: (vLLM's name, stats() key, help); and its
# series of the checks that kept their proposal at each position (stats()' spec_accepted_per_position).
SPEC_DECODE_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "spec_num_drafts", "Checks of proposals (a request's step that checked any)."),
    ("vllm:spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Proposed tokens checked."),
    ("vllm:spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Proposed tokens kept."),
)
SPEC_DECODE_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def kv_cache_usage(stats: dict[str, Any]) -> float:
    """vLLM's `kv_cache_usage_perc`: the share of the pool's usable blocks in use (1 = all)."""
    return stats["blocks_in_use"] / max(stats["num_blocks"] - 1, 1)


@dataclass
class Metric:
    """One series: its name and labels (vLLM's `Metric`)."""

    name: str
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    """A count that only grows."""

    value: int = 0


@dataclass
class Gauge(Metric):
    """A value now."""

    value: float = 0.0


@dataclass
class Vector(Metric):
    """Counts by position (vLLM's, e.g. accepted tokens by speculative position)."""

    values: list[int] = field(default_factory=list)


@dataclass
class Histogram(Metric):
    """Observations counted into buckets by upper bound (`"+Inf"` last), with their count and sum."""

    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)


def engine_metrics(stats: dict[str, Any]) -> list[Metric]:
    """The engine's series from its `stats()` (the module docstring)."""
    metrics: list[Metric] = []
    for name, vllm_name, kind, key, _ in ENGINE_METRICS:
        kind_type = Gauge if kind == "gauge" else Counter
        metrics.append(kind_type(vllm_name or name, value=stats[key]))
    metrics.append(Gauge("vllm:kv_cache_usage_perc", value=kv_cache_usage(stats)))
    metrics.append(Vector("hybridkv_kv_blocks_in_use_per_group", values=list(stats["blocks_in_use_per_group"])))
    # The server's /metrics has its own request_success (hybridkv/serving/metrics.py): this one is get_metrics()'s.
    for reason, count in sorted(stats["finished_samples"].items()):
        metrics.append(Counter("vllm:request_success", {"finished_reason": reason}, value=count))
    for tier, counters in stats["prefix_cache_tiers"].items():
        metrics.append(Counter("hybridkv_prefix_cache_tier_hits", {"tier": tier}, value=counters["hit_tokens"]))
    if stats["spec_method"] is not None:  # vLLM's speculative decoding series, there only with a speculative_config
        metrics += [Counter(name, value=stats[key]) for name, key, _ in SPEC_DECODE_COUNTERS]
        metrics.append(Vector(SPEC_DECODE_PER_POSITION, values=list(stats["spec_accepted_per_position"])))
    return metrics
