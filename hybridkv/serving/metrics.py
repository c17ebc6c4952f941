"""`GET /metrics`: the engine's counters and the server's latency histograms, written by `prometheus_client`.

Each series under hybridkv's name and, where vLLM has one, under vLLM's too (`vllm:num_requests_running`, ...),
so that dashboards made for vLLM read a hybridkv server. The engine's values are read from `stats()` when
scraped (`EngineCollector`); the server's own observations (time to first token, time per output token,
finished requests by reason and by LoRA adapter) are prometheus_client's histograms and counters, in a registry
of the server's own (two servers in one process do not mix their series).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridkv.engine.metrics import ENGINE_METRICS, SPEC_DECODE_COUNTERS, SPEC_DECODE_PER_POSITION, kv_cache_usage
from hybridkv.outputs import RequestOutput

TTFT_BUCKETS_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PER_TOKEN_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class EngineCollector(Collector):
    """The engine's counters, read from `stats()` at each scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        for name, vllm_name, kind, key, help_text in ENGINE_METRICS:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            for metric_name in (name, vllm_name) if vllm_name else (name,):
                yield family(metric_name, help_text, value=stats[key])
        in_use = GaugeMetricFamily(
            "hybridkv_kv_blocks_in_use_per_group",
            "KV blocks held by requests in each KV cache group.",
            labels=["group"],
        )
        for group, count in enumerate(stats["blocks_in_use_per_group"]):
            in_use.add_metric([str(group)], count)
        yield in_use
        tier_hits = CounterMetricFamily(
            "hybridkv_prefix_cache_tier_hits",
            "Prompt tokens found in the cache, by the tier their blocks came from (device, host, disk).",
            labels=["tier"],
        )
        tier_blocks = CounterMetricFamily(
            "hybridkv_prefix_cache_tier_blocks",
            "Blocks each tier below the pool stored, restored into the pool and evicted.",
            labels=["tier", "event"],
        )
        for tier, counters in stats["prefix_cache_tiers"].items():
            tier_hits.add_metric([tier], counters["hit_tokens"])
            for event in ("stored", "restored", "evicted"):
                if event in counters:
                    tier_blocks.add_metric([tier, event], counters[event])
        yield tier_hits
        yield tier_blocks
        yield GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "Share of the KV blocks in use (1 = all).", value=kv_cache_usage(stats)
        )
        if stats["spec_method"] is not None:  # vLLM's speculative decoding series, there only with a speculative_config
            for name, key, help_text in SPEC_DECODE_COUNTERS:
                yield CounterMetricFamily(name, help_text, value=stats[key])
            per_position = CounterMetricFamily(
                SPEC_DECODE_PER_POSITION,
                "Checks that kept their proposal at each position.",
                labels=["position"],
            )
            for position, count in enumerate(stats["spec_accepted_per_position"]):
                per_position.add_metric([str(position)], count)
            yield per_position


class ServerMetrics:
    """The server's own observations: time to first token and time per output token of each finished
    request, finished requests by finish reason, and by LoRA adapter; `exposition` adds the engine's
    (`EngineCollector`)."""

    def __init__(self, stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry()
        if stats is not None:
            self.registry.register(EngineCollector(stats))
        ttft = ("Time from arrival to a request's first token.", TTFT_BUCKETS_SECONDS)
        per_token = ("Mean time between a request's tokens after the first.", PER_TOKEN_BUCKETS_SECONDS)
        finished = "Finished samples by finish reason."
        self._time_to_first_token = [
            Histogram(name, ttft[0], buckets=ttft[1], registry=self.registry)
            for name in ("hybridkv_time_to_first_token_seconds", "vllm:time_to_first_token_seconds")
        ]
        self._time_per_output_token = [
            Histogram(name, per_token[0], buckets=per_token[1], registry=self.registry)
            for name in ("hybridkv_time_per_output_token_seconds", "vllm:time_per_output_token_seconds")
        ]
        self._finished = [
            Counter("hybridkv_request_finished", finished, ["finish_reason"], registry=self.registry),
            Counter("vllm:request_success", finished, ["finished_reason"], registry=self.registry),
        ]
        # prometheus_client writes a counter's samples with the suffix _total: hybridkv_lora_requests_total.
        self._lora_requests = Counter(
            "hybridkv_lora_requests",
            "Finished requests by the LoRA adapter they ran.",
            ["adapter"],
            registry=self.registry,
        )

    def record(self, output: RequestOutput, adapter: str | None = None) -> None:
        """Observe a finished request (its metrics are the engine's monotonic times) and the LoRA adapter it ran."""
        if adapter is not None:
            self._lora_requests.labels(adapter).inc()
        for sample in output.outputs:
            reason = sample.finish_reason or "unknown"
            for counter in self._finished:
                counter.labels(reason).inc()
        metrics = output.metrics
        if metrics.first_token_time is None:
            return
        for histogram in self._time_to_first_token:
            histogram.observe(metrics.first_token_time - metrics.arrival_time)
        # Samples run side by side: the longest one spans first_token_time to finished_time.
        num_tokens = max(len(sample.token_ids) for sample in output.outputs)
        if metrics.finished_time is not None and num_tokens > 1:
            per_token = (metrics.finished_time - metrics.first_token_time) / (num_tokens - 1)
            for histogram in self._time_per_output_token:
                histogram.observe(per_token)

    def exposition(self) -> bytes:
        """Everything in Prometheus' text format (prometheus_client's `generate_latest`)."""
        return generate_latest(self.registry)
