"""/metrics as vLLM exports it: the families, types, labels and buckets vLLM's dashboards
read, and latencies stamped in the engine, so a request nobody streams (most RL rollouts)
has a real time to first token and real gaps between its tokens. A two-layer dummy model
(helpers.servers.start_tiny_server) keeps the server quick; every test reads /metrics around its
own requests, one at a time."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.servers import start_tiny_server, stop_server

PROMPT = "The capital of France is"
N = 8  # tokens per request


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    srv = start_tiny_server(tmp_path_factory.mktemp("metrics") / "server.log", "--enable-sleep-mode")
    yield srv
    stop_server(srv)


def scrape(srv) -> dict:
    text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, **labels: str) -> float:
    return sum(s.value for f in families.values() for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def complete(srv, **body) -> dict:
    r = httpx.post(f"{srv.url}/v1/completions", timeout=300,
                   json={"model": "m", "prompt": PROMPT, "max_tokens": N, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def streamed(srv) -> None:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


PHASES = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
          "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
          "vllm:request_time_per_output_token_seconds", "vllm:request_num_preemptions",
          "vllm:e2e_request_latency_seconds")


def deltas(before: dict, after: dict):
    return lambda name: value(after, name) - value(before, name)


def test_a_non_streamed_request_is_timed_by_the_engine(tiny):
    """Its tokens reach the front end all at once, at the end: its first token and the gaps
    between tokens are the engine's, not the arrival of that one message."""
    before = scrape(tiny)
    usage = complete(tiny)["usage"]
    d = deltas(before, scrape(tiny))
    assert d("vllm:time_to_first_token_seconds_count") == 1
    assert d("vllm:inter_token_latency_seconds_count") == N - 1
    ttft, itl, e2e = (d("vllm:time_to_first_token_seconds_sum"), d("vllm:inter_token_latency_seconds_sum"),
                      d("vllm:e2e_request_latency_seconds_sum"))
    decode = d("vllm:request_decode_time_seconds_sum")
    assert 0 < ttft < e2e and itl > 0
    assert ttft + itl <= e2e  # the last token was read back before the answer went out
    assert itl == pytest.approx(decode, rel=1e-6)  # N - 1 gaps whose sum is the decode phase
    assert ttft >= d("vllm:request_queue_time_seconds_sum") + d("vllm:request_prefill_time_seconds_sum")
    for name in PHASES:  # one observation each
        assert d(f"{name}_count") == 1, name
    assert d("vllm:request_num_preemptions_sum") == 0
    assert d("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(decode / (N - 1), rel=1e-6)
    assert (d("vllm:request_prefill_time_seconds_sum") + decode
            == pytest.approx(d("vllm:request_inference_time_seconds_sum"), rel=1e-6))
    # one step per token; the prompt counts in the step of the first token (as vLLM's)
    assert d("vllm:iteration_tokens_total_count") == N
    assert d("vllm:iteration_tokens_total_sum") == usage["prompt_tokens"] + N


def test_a_streamed_request_has_the_same_series(tiny):
    before = scrape(tiny)
    streamed(tiny)
    d = deltas(before, scrape(tiny))
    assert d("vllm:time_to_first_token_seconds_count") == 1
    assert d("vllm:inter_token_latency_seconds_count") == N - 1
    # the gaps are between the engine's stamps of its steps: together, the decode phase
    assert d("vllm:inter_token_latency_seconds_sum") == pytest.approx(
        d("vllm:request_decode_time_seconds_sum"), rel=1e-6)
    for name in PHASES:
        assert d(f"{name}_count") == 1, name


def _buckets(families: dict, name: str) -> list[float]:
    return [float(s.labels["le"]) for s in families[name].samples
            if s.name == f"{name}_bucket" and s.labels["le"] != "+Inf"]


def test_vllms_families_with_their_types_labels_and_buckets(tiny):
    complete(tiny, max_tokens=2)
    families = scrape(tiny)
    types = {"vllm:iteration_tokens_total": "histogram", "vllm:request_num_preemptions": "histogram",
             "vllm:num_requests_waiting_by_reason": "gauge", "vllm:cache_config_info": "gauge",
             "vllm:engine_sleep_state": "gauge", **{name: "histogram" for name in PHASES}}
    for name, kind in types.items():
        assert name in families and families[name].type == kind, name
    assert _buckets(families, "vllm:iteration_tokens_total") == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                                                 4096, 8192, 16384]
    assert _buckets(families, "vllm:request_num_preemptions") == [1, 2, 3, 4, 5, 10, 20]
    for name in PHASES[:4]:
        assert _buckets(families, name) == _buckets(families, "vllm:e2e_request_latency_seconds"), name
    assert (_buckets(families, "vllm:request_time_per_output_token_seconds")
            == _buckets(families, "vllm:inter_token_latency_seconds"))

    reasons = {s.labels["reason"]: s.value for s in families["vllm:num_requests_waiting_by_reason"].samples}
    assert set(reasons) == {"capacity", "deferred"}
    assert sum(reasons.values()) == value(families, "vllm:num_requests_waiting")
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1 and "model_name" not in info.labels  # vLLM's: the cache's settings, the engine
    assert info.labels["block_size"] == "16" and info.labels["enable_prefix_caching"] == "True"
    assert info.labels["engine"] == "0" and int(info.labels["num_gpu_blocks"]) > 0


def _sleep_state(srv) -> dict[str, float]:
    return {s.labels["sleep_state"]: s.value for s in scrape(srv)["vllm:engine_sleep_state"].samples
            if s.labels["model_name"] == "m"}


def test_engine_sleep_state_follows_sleep_and_wake_up(tiny):
    assert _sleep_state(tiny) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    assert httpx.post(f"{tiny.url}/sleep", params={"level": 1}, timeout=60).status_code == 200
    try:
        assert _sleep_state(tiny) == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
    finally:
        assert httpx.post(f"{tiny.url}/wake_up", timeout=60).status_code == 200
    assert _sleep_state(tiny) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
