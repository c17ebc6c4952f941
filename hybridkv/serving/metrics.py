"""`GET /metrics`: the engine's counters and the server's latency histograms in Prometheus' text format.

Written by hand (the exposition format is a few lines per metric), so serving needs no
prometheus_client. Histograms are updated and read on the server's event loop only.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from hybridkv.outputs import RequestOutput

TTFT_BUCKETS_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PER_TOKEN_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """Cumulative buckets with upper bounds `buckets` (and +Inf), a sum and a count."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.help_text = help_text
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def exposition(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*map(str, self.buckets), "+Inf"), self.counts, strict=True):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines += [f"{self.name}_sum {self.total}", f"{self.name}_count {cumulative}"]
        return lines


# (metric name, type, stats() key, help)
ENGINE_METRICS = (
    ("hybridkv_num_requests_running", "gauge", "num_running", "Requests (samples) being computed."),
    ("hybridkv_num_requests_waiting", "gauge", "num_waiting", "Requests waiting to be scheduled."),
    ("hybridkv_num_requests_swapped", "gauge", "num_swapped", "Requests swapped out to CPU memory."),
    ("hybridkv_kv_blocks_total", "gauge", "num_blocks", "KV blocks in the pool, the null block included."),
    ("hybridkv_kv_blocks_in_use", "gauge", "blocks_in_use", "KV blocks held by requests."),
    ("hybridkv_prefix_cache_queries_total", "counter", "prefix_cache_queries", "Prompt tokens looked up."),
    ("hybridkv_prefix_cache_hits_total", "counter", "prefix_cache_hits", "Prompt tokens found in the cache."),
    ("hybridkv_num_preemptions_total", "counter", "num_preemptions", "Requests preempted."),
    ("hybridkv_generation_tokens_total", "counter", "num_generated_tokens", "Tokens generated."),
)


class ServerMetrics:
    """The server's own observations: time to first token and time per output token of each finished
    request, and finished requests by finish reason."""

    def __init__(self) -> None:
        self.time_to_first_token = Histogram(
            "hybridkv_time_to_first_token_seconds",
            "Time from arrival to a request's first token.",
            TTFT_BUCKETS_SECONDS,
        )
        self.time_per_output_token = Histogram(
            "hybridkv_time_per_output_token_seconds",
            "Mean time between a request's tokens after the first.",
            PER_TOKEN_BUCKETS_SECONDS,
        )
        self.finished: dict[str, int] = {}

    def record(self, output: RequestOutput) -> None:
        """Observe a finished request (its metrics are the engine's monotonic times)."""
        for sample in output.outputs:
            reason = sample.finish_reason or "unknown"
            self.finished[reason] = self.finished.get(reason, 0) + 1
        metrics = output.metrics
        if metrics.first_token_time is None:
            return
        self.time_to_first_token.observe(metrics.first_token_time - metrics.arrival_time)
        # Samples run side by side: the longest one spans first_token_time to finished_time.
        num_tokens = max(len(sample.token_ids) for sample in output.outputs)
        if metrics.finished_time is not None and num_tokens > 1:
            self.time_per_output_token.observe((metrics.finished_time - metrics.first_token_time) / (num_tokens - 1))

    def exposition(self, stats: dict[str, Any]) -> str:
        """Everything in Prometheus' text format (version 0.0.4)."""
        lines = []
        for name, kind, key, help_text in ENGINE_METRICS:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {stats[key]}"]
        name = "hybridkv_kv_blocks_in_use_per_group"
        lines += [f"# HELP {name} KV blocks held by requests in each KV cache group.", f"# TYPE {name} gauge"]
        lines += [f'{name}{{group="{group}"}} {count}' for group, count in enumerate(stats["blocks_in_use_per_group"])]
        name = "hybridkv_request_finished_total"
        lines += [f"# HELP {name} Finished samples by finish reason.", f"# TYPE {name} counter"]
        lines += [f'{name}{{finish_reason="{reason}"}} {count}' for reason, count in sorted(self.finished.items())]
        lines += self.time_to_first_token.exposition() + self.time_per_output_token.exposition()
        return "\n".join(lines) + "\n"
