"""Who may call the control plane, against real servers.

A "remote" client is a loopback connection carrying `X-Forwarded-For: 203.0.113.7`: the
server (uvicorn trusts that header from loopback peers, as a reverse proxy on the same
machine sends it) sees the client at 203.0.113.7, exactly as it would a client on another
machine. Every byte stays on the loopback interface; 203.0.113.7 is only a header value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial

import httpx
import pytest

from helpers.servers import start_side_by_side, start_tiny_server, stop_server
from rlserve.server.routes_control import router

API_KEY = "user-key"
ADMIN_KEY = "admin-key"
GLOO = json.dumps({"backend": "gloo", "timeout_s": 15})
REMOTE_IP = "203.0.113.7"  # a documentation address (RFC 5737): never a real peer
REMOTE = {"X-Forwarded-For": REMOTE_IP}
# Every control route, as registered: a new one is covered without editing this list.
CONTROL = sorted((method, route.path) for route in router.routes for method in route.methods)
POSTS = [path for method, path in CONTROL if method == "POST"]


def _client() -> httpx.Client:
    # trust_env=False: never through a proxy from the environment: only loopback traffic.
    return httpx.Client(trust_env=False, timeout=60)


def _state(http: httpx.Client, base: str) -> tuple[bool, bool]:
    return (http.get(f"{base}/is_paused").json()["is_paused"],
            http.get(f"{base}/is_sleeping").json()["is_sleeping"])


OPENED_BY = {"admin-key": ("--admin-key", ADMIN_KEY), "allow-remote-control": ("--allow-remote-control",)}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The module's servers, started side by side: "open" (weight transfer, an API key and no
    admin key), and one for each way of opening control to the network (OPENED_BY)."""
    logs = tmp_path_factory.mktemp("sec")
    starts = {"open": partial(start_tiny_server, logs / "server.log", "--weight-transfer-config", GLOO,
                              api_key=API_KEY)}
    for name, flags in OPENED_BY.items():
        starts[name] = partial(start_tiny_server, logs / f"{name}.log", "--weight-transfer-config", GLOO,
                               "--max-model-len", "64", *flags)
    started = dict(zip(starts, start_side_by_side(*starts.values())))
    yield started
    for srv in started.values():
        stop_server(srv)


@pytest.fixture(scope="module")
def open_server(servers):
    return servers["open"]


def test_startup_log_says_control_is_loopback_only(open_server):
    assert "control endpoints answer loopback clients only" in open_server.log.read_text()


def test_remote_client_gets_403_on_every_control_endpoint(open_server):
    """With --api-key alone (even when it is sent), a remote client is refused; loopback works."""
    base = open_server.url
    with _client() as http:
        for method, path in CONTROL:
            for headers in (REMOTE, REMOTE | open_server.headers):
                r = http.request(method, f"{base}{path}", json={}, headers=headers)
                assert r.status_code == 403, (method, path, r.text)
                message = r.json()["error"]["message"]
                assert "loopback clients only" in message and "--admin-key" in message, message
                assert REMOTE_IP in message  # the server saw the remote address
        assert _state(http, base) == (False, False)  # nothing was done
        # The OpenAI endpoints stay the API key's business.
        r = http.get(f"{base}/v1/models", headers=REMOTE | open_server.headers)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"


def test_loopback_json_posts_work(open_server):
    base = open_server.url
    own_origin = {"Origin": base}
    with _client() as http:
        assert http.post(f"{base}/pause", params={"mode": "abort"}).status_code == 200
        assert http.get(f"{base}/is_paused").json()["is_paused"] is True
        assert http.post(f"{base}/resume", json={}).status_code == 200
        # A browser's same-origin request carries the server's own Origin: allowed.
        r = http.post(f"{base}/reset_prefix_cache", json={}, headers=own_origin)
        assert r.status_code == 200, r.text
        # Past the access checks, a bad body is the route's 400, as before.
        r = http.post(f"{base}/init_weight_transfer_engine", json={"nope": 1})
        assert r.status_code == 400 and "init_info" in r.text
        assert _state(http, base) == (False, False)


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example", "Content-Type": "text/plain"},  # a page's simple POST
    {"Origin": "http://evil.example", "Content-Type": "application/json"},
    {"Origin": "null", "Content-Type": "application/json"},  # sandboxed frame, file:// page
    {"Content-Type": "text/plain"},
    {"Content-Type": "application/x-www-form-urlencoded"},
    {"Content-Type": "multipart/form-data; boundary=x"},
], ids=["simple-post", "json-cross-origin", "null-origin", "text-plain", "form", "multipart"])
def test_cross_origin_and_non_json_posts_get_403(open_server, headers):
    base = open_server.url
    with _client() as http:
        for path in POSTS:
            r = http.post(f"{base}{path}", params={"level": 2}, content=b"{}", headers=headers)
            assert r.status_code == 403, (path, headers, r.text)
            assert r.json()["error"]["type"] == "permission_error"
        assert _state(http, base) == (False, False)


def test_dns_rebinding_host_is_refused(open_server):
    """A page at evil.example that resolves to 127.0.0.1 is same-origin with itself; the Host
    it asks for is not this machine's name."""
    base = open_server.url
    with _client() as http:
        for path in POSTS:
            r = http.post(f"{base}{path}", json={}, headers={
                "Host": f"evil.example:{open_server.port}", "Origin": f"http://evil.example:{open_server.port}"})
            assert r.status_code == 403 and "Host" in r.json()["error"]["message"], (path, r.text)
        assert http.get(f"{base}/is_paused", headers={"Host": f"localhost:{open_server.port}"}).status_code == 200
        assert _state(http, base) == (False, False)


def test_responses_name_the_served_model_not_its_paths(open_server, demo_model):
    """Neither the weights' directory nor the tokenizer's shows in what clients get."""
    from rlserve.model.presets import model_dir
    with _client() as http:
        models = http.get(f"{open_server.url}/v1/models", headers=open_server.headers)
        r = http.post(f"{open_server.url}/v1/completions", headers=open_server.headers,
                      json={"model": "other", "prompt": "hi", "max_tokens": 1})
    assert models.json()["data"][0]["root"] == "m"
    assert r.status_code == 404 and "'m'" in r.text
    for text in (models.text, r.text):
        for path in (model_dir("tiny"), demo_model):
            assert path not in text and os.path.basename(path.rstrip("/")) not in text


@pytest.mark.parametrize("opened_by, remote_needs_key", [("admin-key", True), ("allow-remote-control", False)])
def test_admin_key_or_flag_opens_control_to_the_network(servers, opened_by, remote_needs_key):
    srv = servers[opened_by]
    base = srv.url
    with _client() as http:
        if remote_needs_key:
            assert http.get(f"{base}/is_paused", headers=REMOTE).status_code == 401
            assert http.get(f"{base}/is_paused").status_code == 401  # loopback needs it too
            wrong = REMOTE | {"Authorization": "Bearer wrong"}
            assert http.post(f"{base}/pause", headers=wrong).status_code == 401
            assert "need the admin key" in srv.log.read_text()
        else:
            assert "open to every client" in srv.log.read_text()
        headers = REMOTE | ({"Authorization": f"Bearer {ADMIN_KEY}"} if remote_needs_key else {})
        assert http.post(f"{base}/pause", headers=headers).status_code == 200
        assert http.get(f"{base}/is_paused", headers=headers).json()["is_paused"] is True
        assert http.post(f"{base}/resume", headers=headers, json={}).status_code == 200
        # Still no browser cross-origin request, key or not.
        r = http.post(f"{base}/pause", content=b"", headers={
            **headers, "Origin": "http://evil.example", "Content-Type": "text/plain"})
        assert r.status_code == 403
        assert http.get(f"{base}/is_paused", headers=headers).json()["is_paused"] is False


@pytest.mark.parametrize("argv, env", [
    (["--api-key", ""], {}),
    (["--admin-key", ""], {}),
    (["--admin-key", "  "], {}),
    ([], {"RLSERVE_API_KEY": ""}),
    ([], {"RLSERVE_ADMIN_KEY": ""}),
], ids=["api-key", "admin-key", "blank-admin-key", "api-key-env", "admin-key-env"])
def test_empty_key_is_a_startup_error(argv, env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RLSERVE_")} | env
    r = subprocess.run([sys.executable, "-m", "rlserve.cli", "serve", "--device", "cpu", *argv],
                       env=environ, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "the key is empty" in r.stderr and ("--api-key" in r.stderr or "--admin-key" in r.stderr)


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("192.0.2.2", False), ("::ffff:192.0.2.2", False), ("fd00::2", False), ("testclient", False), (None, False),
])
def test_loopback_addresses(host, loopback):
    from rlserve.server.security import _is_loopback
    assert _is_loopback(host) is loopback
