"""`rlserve serve --data-parallel-size 2` on CPU over gloo: two engine replicas behind one
endpoint. Requests spread over both, greedy output is a single replica's, one push reaches
both, and a replica killed with SIGKILL leaves the endpoint serving and comes back with
the current weights. One server for the module (the tiny model: replicas load in seconds).
"""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from helpers.data_parallel import (
    PROMPTS,
    TOKENS,
    assert_replica_serves,
    complete,
    complete_all,
    health,
    hf_greedy,
    routed,
    trainer_model,
    wait_for,
)
from helpers.servers import start_tiny_server, stop_server
from rlserve.weight_transfer import WeightSyncClient

# -- the module's server --------------------------------------------------------------------

# The kill test's streams ask for almost all of a long context (~40 s of tokens), so each is
# still in flight when the server pauses however late the last one started (on a loaded
# two-core machine one replica's streams of 480 tokens, ~2.5 s, all ended before the other
# replica's last stream showed its first token); the test closes them itself.
DP_MAX_MODEL_LEN = 8192
STREAM_TOKENS = DP_MAX_MODEL_LEN - 64


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("dp") / "server.log"
    cfg = json.dumps({"backend": "gloo", "timeout_s": 30})
    srv = start_tiny_server(log, "--data-parallel-size", "2", "--weight-transfer-config", cfg,
                            "--dp-retry-on-failure", "--max-num-seqs", "16",
                            "--max-model-len", str(DP_MAX_MODEL_LEN))
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rlserve.model.demo_model import demo_model_path
    return AutoTokenizer.from_pretrained(demo_model_path())


@pytest.fixture(scope="module")
def trainer():
    from rlserve.model.presets import model_dir
    return trainer_model(model_dir("tiny"))


@pytest.fixture(scope="module")
def sync(dp_server):
    client = WeightSyncClient(dp_server.url, backend="gloo", timeout_s=30)
    client.init()
    return client


def test_world_size_and_health_list_both_replicas(dp_server):
    assert httpx.get(f"{dp_server.url}/get_world_size").json() == {"world_size": 2}
    r = health(dp_server.url)
    assert r.status_code == 200
    body = r.json()
    assert body["serving"] == 2 and [x["state"] for x in body["replicas"]] == ["up", "up"]


def test_requests_spread_and_greedy_matches_one_replica(dp_server):
    from rlserve import LLM, SamplingParams
    from rlserve.model.demo_model import demo_model_path
    from rlserve.model.presets import model_dir
    before = routed(dp_server.url)
    got = complete_all(dp_server.url, PROMPTS)
    after = routed(dp_server.url)
    assert all(after[i] > before.get(i, 0) for i in (0, 1)), (before, after)
    assert sum(after.values()) - sum(before.values()) == len(PROMPTS)
    # One replica of the same configuration, in process.
    llm = LLM(model_dir("tiny"), load_format="dummy", tokenizer=demo_model_path(), device="cpu",
              dtype="float32", max_model_len=256)
    ref = llm.generate([got[p]["choices"][0]["prompt_token_ids"] for p in PROMPTS],
                       SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    for p, r in zip(PROMPTS, ref):
        assert got[p]["choices"][0]["token_ids"] == r.outputs[0].token_ids, p


def test_one_push_updates_both_replicas(dp_server, sync, trainer, tokenizer):
    result = sync.push(trainer.named_parameters(), version=7)
    assert result.weight_versions == [7]
    per_replica = result.answers[0]["replicas"]
    assert [(r["replica"], r["weight_version"]) for r in per_replica] == [(0, 7), (1, 7)]
    assert [x["weight_version"] for x in health(dp_server.url).json()["replicas"]] == [7, 7]
    before = routed(dp_server.url)
    got = complete_all(dp_server.url, PROMPTS)
    after = routed(dp_server.url)
    assert all(after[i] > before[i] for i in (0, 1))  # both replicas answered some
    for p in PROMPTS:
        assert got[p]["weight_version"] == 7
        assert got[p]["choices"][0]["token_ids"] == hf_greedy(trainer, tokenizer.encode(p)), p


# Tokens a request of the retry test asks for: enough that it is surely still running when
# the test pauses the server (the two-layer model makes 64 in well under a second, 480 in
# about three seconds).
IN_FLIGHT_TOKENS = 480


def _stream(url: str, prompt: str, record: dict, started: threading.Event, stop: threading.Event) -> None:
    """A streamed completion into `record` (events as they come, then its error, if any,
    and done), closed early once `stop` is set."""
    body = dict(model="m", prompt=prompt, max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True,
                stream=True)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    if "error" in data:
                        record["error"] = data["error"]
                    else:
                        record["events"].append(data)
                        started.set()
                if stop.is_set():
                    break
    except httpx.HTTPError as e:
        record["error"] = {"message": str(e)}
    record["done"] = True


def kill_while_paused(url: str, index: int) -> int:
    """SIGKILL replica `index` while every request in flight is frozen (pause keep), so
    the test does not race the requests' end; returns its pid."""
    wait_for(lambda: all(x["requests_in_flight"] > 0 for x in health(url).json()["replicas"]),
             60, "requests in flight on both replicas")
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=60).status_code == 200
    pid = health(url).json()["replicas"][index]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: health(url).json()["replicas"][index]["state"] != "up", 30, f"replica {index} out")
    assert httpx.post(f"{url}/resume", timeout=60).status_code == 200
    return pid


def test_killed_replica_leaves_rotation_and_comes_back_current(dp_server, sync, trainer, tokenizer):
    url = dp_server.url
    # Streams on both replicas, each with tokens out when the replica dies.
    records = [dict(events=[], error=None, done=False) for _ in range(6)]
    started = [threading.Event() for _ in range(6)]
    stop = threading.Event()
    threads = [threading.Thread(target=_stream, args=(url, f"{PROMPTS[i]} {i}", records[i], started[i], stop))
               for i in range(6)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(120), [r["error"] for r in records]
    victim = kill_while_paused(url, 1)
    seen = [len(r["events"]) for r in records]

    # The endpoint keeps serving; /health says which replica is gone.
    r = health(url)
    assert r.status_code == 200 and r.json()["serving"] == 1
    assert r.json()["replicas"][1]["state"] in ("down", "starting", "stale")
    assert complete(url, PROMPTS[0])["choices"][0]["token_ids"] == hf_greedy(trainer, tokenizer.encode(PROMPTS[0]))
    # The dead replica's streams end with an error; the others go on streaming.
    wait_for(lambda: all(r["done"] or len(r["events"]) > n + 8 for r, n in zip(records, seen)),
             120, "every stream ended or going on after the kill")
    stop.set()
    for t in threads:
        t.join(timeout=60)
    failed = [r["error"] for r in records if r["error"] is not None]
    going = [r for r, n in zip(records, seen) if r["error"] is None and len(r["events"]) > n]
    assert failed and len(failed) + len(going) == 6, [(len(r["events"]), n, r["error"]) for r, n in zip(records, seen)]
    for error in failed:
        assert error["code"] == 503 and "replica 1 died" in error["message"]

    # It restarts, copies the current weights (version 7) from replica 0, and serves them.
    body = wait_for(lambda: (lambda b: b if b["replicas"][1]["state"] == "up" else None)(health(url).json()),
                    180, "replica 1 back in rotation")
    back = body["replicas"][1]
    assert back["pid"] != victim and back["restarts"] == 1 and back["weight_version"] == 7
    assert_replica_serves(url, 1, 7, trainer, tokenizer)

    # Its ranks left the trainer's group: an update without a new init is refused at once,
    # and after one the next push reaches both replicas again.
    r = httpx.post(f"{url}/update_weights", timeout=30, json={"update_info": dict(
        names=["model.norm.weight"], dtype_names=["float32"], shapes=[[128]])})
    assert r.status_code == 409 and "init_weight_transfer_engine" in r.json()["error"]["message"]
    sync.init()
    result = sync.push(trainer.named_parameters(), version=8)
    assert [r["weight_version"] for r in result.answers[0]["replicas"]] == [8, 8]


def test_dead_replica_retries_requests_that_produced_nothing(dp_server):
    """--dp-retry-on-failure: a non-streamed request has shown nothing, so it runs again
    on the other replica and succeeds."""
    url = dp_server.url
    wait_for(lambda: health(url).json()["serving"] == 2, 180, "both replicas up")
    out: dict = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, httpx.post(
        f"{url}/v1/completions", timeout=300, json=dict(model="m", prompt=f"{PROMPTS[i]} again",
                                                        max_tokens=IN_FLIGHT_TOKENS, temperature=0,
                                                        ignore_eos=True))))
               for i in range(4)]
    for t in threads:
        t.start()
    kill_while_paused(url, 0)
    for t in threads:
        t.join(timeout=300)
    assert all(out[i].status_code == 200 for i in range(4)), [out[i].text for i in range(4)]
    assert all(len(out[i].json()["choices"][0]["text"]) > 0 for i in range(4))
