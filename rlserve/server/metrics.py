"""Prometheus metrics: engine gauges and counters read at scrape time, latency histograms
observed by the HTTP layer as outputs stream out."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

if TYPE_CHECKING:
    from rlserve.engine.outputs import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _EngineCollector:
    """The engine's gauges and counters, from the stats the /metrics handler just fetched."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        gauges = [
            ("rlserve_num_requests_running", "Sequences being generated.", s.num_running),
            ("rlserve_num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
            ("rlserve_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
             s.kv_cache_usage),
            ("rlserve_kv_cache_capacity_tokens", "Tokens the KV cache holds.",
             s.kv_cache_capacity_tokens),
            ("rlserve_weight_version", "Version of the weights being served.", s.weight_version),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("rlserve_prompt_tokens", "Prompt tokens processed.", s.prompt_tokens_total),
            ("rlserve_generation_tokens", "Tokens generated.", s.generation_tokens_total),
            ("rlserve_requests_aborted", "Requests aborted before they finished.",
             s.aborted_total),
            ("rlserve_preemptions", "Sequences preempted for lack of KV cache.",
             s.preemptions_total),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class _Histogram:
    """A Prometheus histogram fed from the event loop alone: an observation is a bisect and
    two additions, no lock, and `count` equal observations cost one (tokens that arrive
    together share their gap). prometheus_client's took a quarter of a busy API server's
    time at one observation per token."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def family(self) -> HistogramMetricFamily:
        cumulative, total = [], 0
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts):
            total += n
            cumulative.append((bound, total))
        return HistogramMetricFamily(self.name, self.documentation, buckets=cumulative,
                                     sum_value=self.sum)


class _HistogramCollector:
    def __init__(self, histograms: list[_Histogram]):
        self.histograms = histograms

    def collect(self) -> Iterator[Metric]:
        for h in self.histograms:
            yield h.family()


class ServerMetrics:
    """One registry per app, so several apps in one process never clash. Also the engine's
    latency observer (output_processor.LatencyObserver): it times tokens as they arrive."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        self.ttft = _Histogram(
            "rlserve_time_to_first_token_seconds", "Time from request arrival to first token.",
            _TTFT_BUCKETS)
        self.itl = _Histogram(
            "rlserve_inter_token_latency_seconds", "Time between consecutive tokens of a sample.",
            _ITL_BUCKETS)
        self.e2e = _Histogram(
            "rlserve_e2e_request_latency_seconds", "Time from request arrival to its last token.",
            _E2E_BUCKETS)
        self.registry.register(_HistogramCollector([self.ttft, self.itl, self.e2e]))
        self.finished_samples = Counter(
            "rlserve_request_finished", "Finished samples by finish reason.", ["finish_reason"],
            registry=self.registry)
        self.disconnects = Counter(
            "rlserve_client_disconnects", "Requests whose client left before the end.",
            registry=self.registry)

    def render(self, stats: "EngineStats | None") -> bytes:
        self._engine.stats = stats
        return generate_latest(self.registry)

    # -- LatencyObserver -------------------------------------------------------------------
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float, count: int) -> None:
        self.itl.observe(seconds, count)  # tokens that arrive together share the gap

    def finished(self, reason: str, seconds: float) -> None:
        self.e2e.observe(seconds)
        self.finished_samples.labels(finish_reason=reason).inc()
