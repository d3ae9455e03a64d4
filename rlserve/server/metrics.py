"""Prometheus metrics: engine gauges and counters read at scrape time, latency histograms
observed by the HTTP layer as outputs stream out."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from rlserve.engine.request import RequestOutput

if TYPE_CHECKING:
    from rlserve.engine.async_engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _EngineCollector:
    """Reads `engine.stats()` on every scrape, so the numbers are never stale."""

    def __init__(self, engine: "AsyncEngine"):
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
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


class ServerMetrics:
    """One registry per app, so several apps in one process never clash."""

    def __init__(self, engine: "AsyncEngine"):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram(
            "rlserve_time_to_first_token_seconds", "Time from request arrival to first token.",
            buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(
            "rlserve_inter_token_latency_seconds", "Time between consecutive tokens of a sample.",
            buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(
            "rlserve_e2e_request_latency_seconds", "Time from request arrival to its last token.",
            buckets=_E2E_BUCKETS, registry=self.registry)
        self.finished = Counter(
            "rlserve_request_finished", "Finished samples by finish reason.", ["finish_reason"],
            registry=self.registry)
        self.disconnects = Counter(
            "rlserve_client_disconnects", "Requests whose client left before the end.",
            registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, arrival: float) -> "RequestTimer":
        return RequestTimer(self, arrival)


class RequestTimer:
    """Latency bookkeeping of one engine request (all n samples of one prompt)."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self._m = metrics
        self._start = arrival  # time.monotonic() when the HTTP request came in
        self._first_token = False
        self._seen: dict[int, tuple[int, float]] = {}  # sample index -> (tokens, last arrival)

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        for c in out.outputs:
            count, last = self._seen.get(c.index, (0, self._start))
            new = len(c.token_ids) - count
            if new <= 0:
                continue
            if count == 0:
                if not self._first_token:
                    self._first_token = True
                    self._m.ttft.observe(now - self._start)
                new, last = new - 1, now  # the first token's latency is the TTFT, not a gap
            if new > 0:
                gap = (now - last) / new  # tokens that arrive together share the gap
                for _ in range(new):
                    self._m.itl.observe(gap)
            self._seen[c.index] = (len(c.token_ids), now)
        if out.finished:
            self._m.e2e.observe(now - self._start)
            for c in out.outputs:
                if c.finish_reason:
                    reason = getattr(c.finish_reason, "value", c.finish_reason)
                    self._m.finished.labels(finish_reason=reason).inc()
