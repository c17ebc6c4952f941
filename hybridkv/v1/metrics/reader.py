"""vLLM's `vllm.v1.metrics.reader` path: the metric types `get_metrics()` returns (hybridkv/engine/metrics.py)."""

from hybridkv.engine.metrics import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]
