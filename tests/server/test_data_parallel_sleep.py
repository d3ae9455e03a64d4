"""Sleep by tags across data-parallel replicas answers as one engine would (vLLM's
semantics): /is_sleeping stays true while any replica has any tag asleep, nothing is
generated until every tag is awake, and a replica restarted while the server sleeps
sleeps as the others do (it neither serves nor holds the memory they gave back).
On CPU, `--data-parallel-size 2`, the tiny model.
"""

from __future__ import annotations

import os
import re
import signal
import threading

import httpx
import pytest

from helpers.data_parallel import PROMPTS, complete, health, wait_for
from helpers.servers import start_tiny_server, stop_server


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("dp_sleep") / "server.log"
    srv = start_tiny_server(log, "--data-parallel-size", "2", "--enable-sleep-mode", "--max-num-seqs", "4")
    yield srv
    stop_server(srv)


def post(url: str, path: str, **params) -> dict:
    r = httpx.post(f"{url}{path}", params=params, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def is_sleeping(url: str) -> bool:
    return httpx.get(f"{url}/is_sleeping", timeout=30).json()["is_sleeping"]


def waiting(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(sum(float(v) for v in re.findall(r"^vllm:num_requests_waiting\{[^}]*\} (\S+)$", text, re.M)))


def held_requests(url: str, prompts: list[str]) -> tuple[list[threading.Thread], dict]:
    """Completions sent while the server sleeps; the test waits until each is held."""
    out: dict = {}
    before = waiting(url)
    threads = [threading.Thread(target=lambda p=p: out.__setitem__(p, complete(url, p))) for p in prompts]
    for t in threads:
        t.start()
    wait_for(lambda: waiting(url) >= before + len(prompts), 60, "every request held while asleep")
    assert not out, f"answered while /is_sleeping says true: {list(out)}"
    return threads, out


def kill_and_wait_back(url: str, index: int, states: tuple[str, ...]) -> None:
    pid = health(url).json()["replicas"][index]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: (lambda x: x["pid"] not in (None, pid) and x["state"] in states)(
        health(url).json()["replicas"][index]), 180, f"replica {index} restarted ({' or '.join(states)})")


def wake_kv_cache_and_check(url: str, threads: list[threading.Thread], out: dict, expected: dict) -> None:
    """The last tag woken, the server is awake and the held requests answer as before the sleep."""
    assert post(url, "/wake_up", tags="kv_cache") == {"status": "awake"}
    assert not is_sleeping(url)
    for t in threads:
        t.join(120)
    assert {p: out[p]["choices"][0]["token_ids"] for p in expected} == expected


def test_asleep_until_every_tag_is_awake(dp_server):
    url = dp_server.url
    expected = {p: complete(url, p)["choices"][0]["token_ids"] for p in PROMPTS[:2]}
    post(url, "/sleep", level=1)
    assert is_sleeping(url)
    assert post(url, "/wake_up", tags="weights") == {"status": "sleeping"}
    assert is_sleeping(url)
    threads, out = held_requests(url, PROMPTS[:2])
    assert is_sleeping(url)
    wake_kv_cache_and_check(url, threads, out, expected)


def test_replica_restarted_while_asleep_sleeps_like_the_others(dp_server):
    url = dp_server.url
    expected = {p: complete(url, p)["choices"][0]["token_ids"] for p in PROMPTS[:4]}
    post(url, "/sleep", level=1)
    kill_and_wait_back(url, 1, ("up", "stale"))
    assert is_sleeping(url)
    # Its weights awake again, it copies them from replica 0 and serves them, but only once
    # the KV cache is awake too: every replica sleeps until then.
    assert post(url, "/wake_up", tags="weights") == {"status": "sleeping"}
    wait_for(lambda: health(url).json()["serving"] == 2, 120, "replica 1 back in rotation")
    assert is_sleeping(url)
    taken = health(url).json()["replicas"][1]["requests_total"]
    threads, out = held_requests(url, PROMPTS[:4])
    wake_kv_cache_and_check(url, threads, out, expected)
    assert health(url).json()["replicas"][1]["requests_total"] > taken  # it served some


def test_replica_restarted_with_only_the_kv_cache_asleep_copies_then_sleeps(dp_server):
    url = dp_server.url
    wait_for(lambda: health(url).json()["serving"] == 2, 120, "both replicas up")
    expected = {p: complete(url, p)["choices"][0]["token_ids"] for p in PROMPTS[:4]}
    post(url, "/sleep", level=1)
    assert post(url, "/wake_up", tags="weights") == {"status": "sleeping"}
    kill_and_wait_back(url, 0, ("up",))  # up: it copied the weights from replica 1
    assert is_sleeping(url)
    threads, out = held_requests(url, PROMPTS[:4])
    wake_kv_cache_and_check(url, threads, out, expected)
