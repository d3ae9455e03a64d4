"""Prometheus metrics under vLLM's names, so vLLM's dashboards and alerts work unchanged:
`vllm:*` with vLLM's labels (`model_name` and `engine`, and their own where vLLM has them)
and buckets. Engine gauges, counters and the per-step histogram are read at scrape time
(EngineStats); latency and per-request histograms are observed by the HTTP layer as outputs
arrive, from the engine's own stamps (outputs.RequestTiming, EngineCoreOutputs.timestamp).
rlserve's own metrics (weight updates, pause and sleep state) sit beside them as
`rlserve_*`, with the same labels.

With --api-server-count N, the histograms and the counters the HTTP layer keeps are per
API server process; the engine's numbers are the same in every one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from rlserve.wire.outputs import ITERATION_TOKENS_BUCKETS

if TYPE_CHECKING:
    from rlserve.config import EngineConfig
    from rlserve.frontend.output_processor import RequestState
    from rlserve.memory import MemoryProfile
    from rlserve.wire.outputs import EngineStats, RequestTiming

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's buckets.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)
_PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
_UPDATE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _1_2_5_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _Histogram:
    """A Prometheus histogram fed from the event loop alone: an observation is a bisect and
    two additions, no lock, and `count` equal observations cost one (tokens that arrive
    together share their gap). prometheus_client's took a quarter of a busy API server's
    time at one observation per token."""

    def __init__(self, name: str, documentation: str, buckets: Iterable[float]):
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def family(self, labels: tuple[str, ...]) -> HistogramMetricFamily:
        return _histogram_family(self.name, self.documentation, labels, self.bounds, self.counts, self.sum)


def _histogram_family(name: str, documentation: str, labels: Iterable[str], bounds: Iterable[float],
                      counts: Iterable[int], total_sum: float) -> HistogramMetricFamily:
    """Per-bucket counts (the last one above every bound) as a Prometheus histogram."""
    cumulative, total = [], 0
    for bound, n in zip([*map(str, bounds), "+Inf"], counts):
        total += n
        cumulative.append((bound, total))
    family = HistogramMetricFamily(name, documentation, labels=LABELS)
    family.add_metric(list(labels), cumulative, sum_value=total_sum)
    return family


class ServerMetrics:
    """One registry per app, so several apps in one process never clash. Also the engine's
    latency observer (output_processor.LatencyObserver): it takes each sample's timings as its
    outputs arrive."""

    def __init__(self, model_name: str, max_model_len: int = 1 << 20, config: EngineConfig | None = None):
        self.model_name = model_name
        self.labels = (model_name, "0")
        self.config = config  # its cache settings label vllm:cache_config_info
        self.stats: EngineStats | None = None  # fetched by the /metrics handler
        self.memory: MemoryProfile | None = None  # the engine's measured split, set at start
        self.ttft = _Histogram("vllm:time_to_first_token_seconds",
                               "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = _Histogram("vllm:inter_token_latency_seconds",
                              "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e = _Histogram("vllm:e2e_request_latency_seconds",
                              "Histogram of e2e request latency in seconds.", _E2E_BUCKETS)
        # A finished request's phases in the engine (vLLM's definitions, outputs.RequestTiming).
        self.queue_time = _Histogram("vllm:request_queue_time_seconds",
                                     "Histogram of time spent in WAITING phase for request.", _E2E_BUCKETS)
        self.inference_time = _Histogram("vllm:request_inference_time_seconds",
                                         "Histogram of time spent in RUNNING phase for request.", _E2E_BUCKETS)
        self.prefill_time = _Histogram("vllm:request_prefill_time_seconds",
                                       "Histogram of time spent in PREFILL phase for request.", _E2E_BUCKETS)
        self.decode_time = _Histogram("vllm:request_decode_time_seconds",
                                      "Histogram of time spent in DECODE phase for request.", _E2E_BUCKETS)
        self.time_per_output_token = _Histogram("vllm:request_time_per_output_token_seconds",
                                                "Histogram of time_per_output_token_seconds per request.",
                                                _ITL_BUCKETS)
        self.preemptions = _Histogram("vllm:request_num_preemptions",
                                      "Histogram of the number of preemptions per finished request.",
                                      _PREEMPTION_BUCKETS)
        self.set_max_model_len(max_model_len)
        self.update_seconds = _Histogram(
            "rlserve_weight_update_seconds", "Time a weight update took (receive and apply).",
            _UPDATE_BUCKETS)
        self.finished_samples = dict.fromkeys(FINISH_REASONS, 0)
        self.disconnects = 0
        self.admission_rejections = 0  # generation requests refused before the engine queued them
        self.updates = {"ok": 0, "failed": 0}
        self.update_bytes = 0
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)

    def set_max_model_len(self, max_model_len: int) -> None:
        """Token-count buckets reach the model's length (known once the engine is up)."""
        tokens = _1_2_5_buckets(max_model_len)
        self.max_model_len = max_model_len
        self.prompt_tokens = _Histogram("vllm:request_prompt_tokens",
                                        "Number of prefill tokens processed.", tokens)
        self.generation_tokens = _Histogram("vllm:request_generation_tokens",
                                            "Number of generation tokens processed.", tokens)
        self.params_n = _Histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                   _N_BUCKETS)
        self.params_max_tokens = _Histogram("vllm:request_params_max_tokens",
                                            "Histogram of the max_tokens request parameter.", tokens)

    def render(self, stats: EngineStats | None) -> bytes:
        self.stats = stats
        return generate_latest(self.registry)

    # -- what the HTTP layer observes ------------------------------------------------------
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float, count: int) -> None:
        self.itl.observe(seconds, count)  # tokens that arrive together share the gap

    def finished(self, reason: str, seconds: float) -> None:
        self.e2e.observe(seconds)
        self.finished_samples[reason] = self.finished_samples.get(reason, 0) + 1

    def request_phases(self, timing: RequestTiming, num_tokens: int) -> None:
        self.queue_time.observe(timing.queued)
        self.prefill_time.observe(timing.prefill)
        self.decode_time.observe(timing.decode)
        self.inference_time.observe(timing.inference)
        # as vLLM: the first token is the prefill's, so the mean is over the others (0 if none)
        self.time_per_output_token.observe(timing.decode / (num_tokens - 1) if num_tokens > 1 else 0.0)
        self.preemptions.observe(timing.num_preemptions)

    def client_left(self) -> None:
        self.disconnects += 1

    def requests_done(self, states: Iterable[RequestState]) -> None:
        """Per-prompt histograms, once a prompt's samples have all finished."""
        for st in states:
            self.prompt_tokens.observe(len(st.prompt_token_ids))
            for s in st.samples:
                self.generation_tokens.observe(len(s.token_ids))
            self.params_n.observe(st.params.n)
            if st.params.max_tokens is not None:
                self.params_max_tokens.observe(st.params.max_tokens)

    def weight_update(self, ok: bool, seconds: float, num_bytes: int = 0) -> None:
        self.updates["ok" if ok else "failed"] += 1
        if ok:
            self.update_seconds.observe(seconds)
            self.update_bytes += num_bytes

    # -- the collector ---------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        labels = list(self.labels)
        if self.stats is not None:
            yield from _engine_families(self.stats, labels)
            if self.config is not None:
                yield _cache_config_info(self.config, self.stats, self.max_model_len)
        if self.memory is not None:
            yield _memory_family(self.memory, labels)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=(*LABELS, "finished_reason"))
        for reason, n in self.finished_samples.items():
            success.add_metric([*labels, reason], n)
        yield success
        for h in (self.ttft, self.itl, self.e2e, self.queue_time, self.inference_time, self.prefill_time,
                  self.decode_time, self.time_per_output_token, self.preemptions, self.prompt_tokens,
                  self.generation_tokens, self.params_n, self.params_max_tokens, self.update_seconds):
            yield h.family(self.labels)
        yield _counter("vllm:admission_rejections", "Generation requests refused before they were "
                       "admitted (invalid, too long, unknown model, asleep with --reject-while-asleep).",
                       labels, self.admission_rejections)
        yield _counter("rlserve_client_disconnects", "Requests whose client left before the end.",
                       labels, self.disconnects)
        updates = CounterMetricFamily("rlserve_weight_updates", "Weight updates, by outcome.",
                                      labels=(*LABELS, "outcome"))
        for outcome, n in self.updates.items():
            updates.add_metric([*labels, outcome], n)
        yield updates
        yield _counter("rlserve_weight_update_bytes", "Bytes of weights received by updates.",
                       labels, self.update_bytes)


# The engine's statistics (EngineStats) as vLLM's and rlserve's gauges and counters:
# (metric name, help, EngineStats attribute).
_ENGINE_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    ("rlserve_kv_cache_capacity_tokens", "Tokens the KV cache holds.", "kv_cache_capacity_tokens"),
    ("rlserve_weight_version", "Version of the weights being served.", "weight_version"),
    ("rlserve_is_paused", "1 while generation is paused (/pause).", "paused"),
    ("rlserve_is_sleeping", "1 while the engine sleeps (/sleep).", "sleeping"),
)
_ENGINE_COUNTERS = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     "prefix_cache_hit_tokens"),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "preemptions_total"),
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens_total"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens_total"),
    ("rlserve_requests_aborted", "Requests aborted before they finished.", "aborted_total"),
)


def _engine_families(stats: EngineStats, labels: list[str]) -> Iterator[Metric]:
    for name, doc, attr in _ENGINE_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric(labels, float(getattr(stats, attr)))
        yield family
    for name, doc, attr in _ENGINE_COUNTERS:
        yield _counter(name, doc, labels, getattr(stats, attr))
    yield _labelled_gauge(
        "vllm:num_requests_waiting_by_reason",
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
        "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, "
        "blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
        labels, "reason", {"capacity": stats.num_waiting - stats.num_waiting_deferred,
                           "deferred": stats.num_waiting_deferred})
    level = stats.sleep_level
    yield _labelled_gauge(
        "vllm:engine_sleep_state",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
        "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        labels, "sleep_state", {"awake": int(level == 0), "weights_offloaded": int(level == 1),
                                "discard_all": int(level == 2)})
    if stats.iteration_tokens:
        yield _histogram_family("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                labels, ITERATION_TOKENS_BUCKETS, stats.iteration_tokens,
                                stats.iteration_tokens_sum)


def _labelled_gauge(name: str, doc: str, labels: list[str], label: str, values: dict[str, float]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=(*LABELS, label))
    for key, value in values.items():
        family.add_metric([*labels, key], value)
    return family


def _cache_config_info(config: EngineConfig, stats: EngineStats, max_model_len: int) -> GaugeMetricFamily:
    """vLLM's info gauge (always 1): its labels are the KV cache's settings, named and
    written (str of the value) as vLLM's CacheConfig fields, and the engine; no model_name.
    kv_cache_max_concurrency: how many requests of max_model_len tokens the cache holds at once."""
    info = {"block_size": config.block_size, "cache_dtype": config.kv_cache_dtype,
            "enable_prefix_caching": config.enable_prefix_caching,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "kv_cache_memory_bytes": config.kv_cache_memory_bytes,
            "num_cpu_blocks": None, "num_gpu_blocks": stats.kv_cache_capacity_tokens // config.block_size,
            "num_gpu_blocks_override": config.num_kv_blocks,
            "kv_cache_size_tokens": stats.kv_cache_capacity_tokens,
            "kv_cache_max_concurrency": round(stats.kv_cache_capacity_tokens / max(max_model_len, 1), 2),
            "engine": 0}
    family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                               labels=list(info))
    family.add_metric([str(v) for v in info.values()], 1)
    return family


def _counter(name: str, doc: str, labels: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=LABELS)
    family.add_metric(labels, value)
    return family


def _memory_family(memory: MemoryProfile, labels: list[str]) -> GaugeMetricFamily:
    """The device memory split measured at start (rank 0): what sized the KV cache."""
    family = GaugeMetricFamily("rlserve_device_memory_bytes",
                               "Device memory at start, by part (weights, peak activations, CUDA graphs, "
                               "non-torch, KV cache) and the device's total.", labels=(*LABELS, "part"))
    for part in ("total", "weights", "activations", "cuda_graphs", "non_torch", "kv_cache"):
        family.add_metric([*labels, part], getattr(memory, part))
    return family
