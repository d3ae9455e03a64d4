"""The control plane answers every input with a 2xx or a 4xx, never a 500: 10,000 calls
over every route's numeric, version and id fields, with values at and past every bound
(64-bit edges, floats, non-ASCII digits, random unicode, wrong types). One tiny server,
one kept-alive client; no trainer joins, so a refusal never waits on one."""

from __future__ import annotations

import json
import random
from collections import Counter

import httpx
import pytest

from helpers.servers import start_tiny_server, stop_server

CASES = 10_000

EDGE_NUMBERS = [0, 1, -1, 2, 7, 2**15, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, -(2**63),
                -(2**63) - 1, 2**64 - 1, 2**64, 2**70, 10**30, 1.5, -0.0, 1e308, 1e-300]
EDGE_STRINGS = ["", " ", "0", "01", "-1", "+1", "1e3", "²", "①", "٣", "１", "9" * 19, "9" * 20, "1" * 400,
                "x" * 300, "step-100", "\x00", "a\nb", "\u200b", "NaN", "null", "true", "weights", "kv_cache",
                "abort", "wait", "keep", "checksum", "compare", "reset"]
EDGE_OTHER = [None, True, False, [], {}, [1], ["a"], {"a": 1}, [[[]]]]


def value(rng: random.Random):
    pick = rng.random()
    if pick < 0.35:
        return rng.choice(EDGE_NUMBERS)
    if pick < 0.65:
        return rng.choice(EDGE_STRINGS)
    if pick < 0.8:
        return rng.choice(EDGE_OTHER)
    alphabet = [chr(c) for c in (*range(0x20, 0x7f), 0xb2, 0x2460, 0x663, 0xff11, 0x1d7ce, 0x7, 0x0, 0xe9)]
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))


def query_value(rng: random.Random) -> str:
    v = value(rng)
    return v if isinstance(v, str) else json.dumps(v)


def case(rng: random.Random) -> tuple[str, str, dict]:
    """(method, path, httpx keyword arguments) for one call."""
    v = lambda: value(rng)  # noqa: E731
    kind = rng.randrange(13)
    if kind == 0:
        return "POST", "/update_weight_version", {"json": {"new_version": v()}}
    if kind == 1:
        return "POST", "/finish_weight_update", {"json": {"weight_version": v(), "transaction_id": v()}}
    if kind == 2:
        return "POST", "/start_weight_update", {"json": {"is_checkpoint_format": rng.choice([True, v()]),
                                                         "transaction_id": v()}}
    if kind == 3:
        info = {"names": rng.choice([[], ["model.norm.weight"], v()]), "dtype_names": ["float32"],
                "shapes": rng.choice([[[128]], [[v()]], v()]), "packed": rng.choice([True, v()]),
                "packed_buffer_size_bytes": v(), "packed_num_buffers": v(), "weight_version": v(),
                "transaction_id": v()}
        for key in rng.sample(sorted(info), rng.randrange(len(info))):
            del info[key]
        return "POST", "/update_weights", {"json": {"update_info": info}}
    if kind == 4:
        # master_port is never a real one: a valid init would wait on a trainer
        info = {"master_address": rng.choice(["127.0.0.1", v()]), "rank_offset": v(), "world_size": v(),
                "master_port": rng.choice([0, -1, 65536, 2**64, "x", None, 1.5])}
        return "POST", "/init_weight_transfer_engine", {"json": {"init_info": info}}
    if kind == 5:
        return "POST", "/sleep", {"params": {"level": query_value(rng)}}
    if kind == 6:
        return "POST", "/wake_up", {"params": [("tags", query_value(rng)) for _ in range(rng.randrange(3))]}
    if kind == 7:
        return "POST", "/pause", {"params": {"mode": query_value(rng), "clear_cache": query_value(rng)}}
    if kind == 8:
        return "POST", "/abort_requests", {"json": {"request_ids": v()}}
    if kind == 9:
        return "POST", "/weight_checker", {"json": {"action": v(), "baseline": v()}}
    if kind == 10:
        return "GET", "/get_world_size", {"params": {"include_dp": query_value(rng)}}
    if kind == 11:
        return "POST", rng.choice(["/resume", "/release_kv_cache_memory", "/reset_prefix_cache"]), {}
    return "GET", rng.choice(["/is_sleeping", "/is_paused", "/weight_info", "/weight_version"]), {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_tiny_server(tmp_path_factory.mktemp("fuzz") / "s.log", "--weight-transfer-config",
                            json.dumps({"backend": "gloo", "timeout_s": 5}))
    yield srv
    stop_server(srv)


def test_ten_thousand_control_calls_and_not_one_500(server):
    rng = random.Random(20261207)
    statuses: Counter[int] = Counter()
    errors = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for i in range(CASES):
            method, path, kw = case(rng)
            try:
                r = client.request(method, path, **kw)
            except ValueError:  # a body httpx itself will not encode (NaN-free JSON only)
                continue
            except httpx.TransportError as e:  # the server dropped the connection: a crash
                errors.append(f"#{i} {method} {path} {kw}: {e!r}")
                continue
            statuses[r.status_code] += 1
            if r.status_code >= 500 or r.status_code == 422:
                errors.append(f"#{i} {method} {path} {kw}: {r.status_code} {r.text[:300]}")
    assert not errors, f"{len(errors)} answers were 5xx (or FastAPI's raw 422):\n" + "\n".join(errors[:20])
    assert sum(statuses.values()) > CASES * 0.95, statuses
    assert statuses[200] > 100 and statuses[400] > 1000, statuses  # both kinds of answer were reached
    # The server still serves, whatever state the calls left it in.
    client = httpx.Client(base_url=server.url, timeout=60)
    assert client.post("/wake_up").status_code == 200 and client.post("/resume").status_code == 200
