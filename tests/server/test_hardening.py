"""Hostile input to the server: every nesting and integer bound is checked before use and
answered with a 400 naming the field, never a 500; grammars are bounded in size and compile
time; the server keeps serving throughout. One module-scoped tiny server (its API key from
VLLM_API_KEY, as vLLM reads it) serves them all."""

from __future__ import annotations

import json
import re
import threading
import time
from functools import partial

import httpx
import pytest

from helpers.servers import start_side_by_side, start_tiny_server, stop_server
from helpers.silent_master import SilentMaster
from helpers.waiting import wait_until

KEY = "from-the-environment"
GLOO = '{"backend": "gloo"}'
GRAMMAR_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The module's two servers, started side by side: "hardened" (the key from the
    environment, LoRA, a grammar compile bound) and "sigterm" (the one the SIGTERM test ends)."""
    logs = tmp_path_factory.mktemp("hardening")
    started = start_side_by_side(
        partial(start_tiny_server, logs / "server.log", "--weight-transfer-config", GLOO, "--enable-lora",
                "--grammar-compile-timeout-s", str(GRAMMAR_TIMEOUT_S), env={"VLLM_API_KEY": KEY}),
        partial(start_tiny_server, logs / "sigterm.log", "--weight-transfer-config", GLOO))
    started[0].api_key = KEY
    yield dict(zip(("hardened", "sigterm"), started))
    for srv in started:
        stop_server(srv)


@pytest.fixture(scope="module")
def server(servers):
    return servers["hardened"]


def _post(server, path: str, body, timeout: float = 120) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=timeout,
                      headers={**server.headers, "Content-Type": "application/json"})


def _refused(r: httpx.Response, *words: str) -> str:
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message
    return message


def _gauge(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def _still_serving(server) -> None:
    r = _post(server, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


def _history(arguments: str) -> dict:
    return {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c", "content": "r"}]}


def test_the_api_key_comes_from_vllm_api_key_and_the_log_says_so_without_it(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 401
    _still_serving(server)
    log = server.log.read_text()
    assert "api key: from VLLM_API_KEY" in log and KEY not in log


def test_structured_outputs_json_nested_1200_deep_is_a_400(server):
    schema = '{"type":"object","properties":{"a":' * 1200 + '{"type":"string"}' + "}}" * 1200
    as_object = '{"model":"m","prompt":"hi","max_tokens":2,"structured_outputs":{"json":' + schema + "}}"
    _refused(_post(server, "/v1/completions", as_object), "nested deeper than", "levels")
    as_text = {"model": "m", "prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": schema}}
    _refused(_post(server, "/v1/completions", as_text), "structured_outputs.json", "nested deeper than 128")
    _still_serving(server)


def test_guided_json_of_100000_brackets_is_a_400(server):
    r = _post(server, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2,
                                          "guided_json": "[" * 100000})
    assert r.json()["error"]["param"] == "guided_json"
    _refused(r, "guided_json", "nested deeper than 128")
    _still_serving(server)


@pytest.mark.parametrize("arguments", ["[" * 100000, '{"a":' * 5000 + "1" + "}" * 5000],
                         ids=["100000-brackets", "objects-5000-deep"])
def test_tool_call_arguments_in_the_history_nested_deep_are_a_400(server, arguments):
    _refused(_post(server, "/v1/chat/completions", _history(arguments)),
             "messages.1.tool_calls.0.function.arguments", "nested deeper than 128")
    _still_serving(server)


def test_world_size_10_to_the_20_is_a_400(server):
    r = _post(server, "/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 10**20}})
    _refused(r, "init_info.world_size", "64 bits")
    r = _post(server, "/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2**40}})
    _refused(r, "world_size must be an integer up to 1024 (weight-transfer-config max_world_size)")
    assert r.json()["error"]["param"] == "init_info"  # the field at fault, not update_info


def test_the_integer_check_names_what_is_past_64_bits_and_passes_long_digit_runs_in_text():
    from rlserve.sampling_params import InvalidRequestError
    from rlserve.wire.limits import check_int_range
    # Edges that fit, and a 22-digit run inside a name (the fast check's false alarm: walked).
    check_int_range({"names": ["layers.1234567890123456789012.w"], "top": 2**63 - 1, "bottom": -(2**63),
                     "float": 1e300, "flag": True}, "update_info")
    for value, path in (({"a": [1, {"b": 2**63}]}, "update_info.a[1].b"),
                        ({"s": [[-(2**63) - 1]]}, "update_info.s[0][0]"), ({"x": 10**30}, "update_info.x")):
        with pytest.raises(InvalidRequestError, match=re.escape(f"{path}: must fit in 64 bits")):
            check_int_range(value, "update_info")


def test_weight_version_2_to_the_70_is_a_400_and_the_old_weights_serve(server):
    r = _post(server, "/update_weights", {"update_info": {
        "names": ["x"], "dtype_names": ["float32"], "shapes": [[1]], "weight_version": 2**70}})
    _refused(r, "update_info.weight_version", "64-bit")
    for version, words in (("9" * 30, "0..9223372036854775807"), ("9" * 5000, "at most 256 characters")):
        r = _post(server, "/update_weights", {"update_info": {
            "names": ["x"], "dtype_names": ["float32"], "shapes": [[1]], "weight_version": version}})
        _refused(r, "update_info.weight_version", words)
    assert httpx.get(f"{server.url}/weight_version", timeout=30).json() == {"weight_version": 0}
    _still_serving(server)


def _adapter(tmp_path, config: str):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "adapter_config.json").write_text(config)
    return str(tmp_path)


@pytest.mark.parametrize("config, words", [
    ('{"r": 8, "x":' + "[" * 5000 + "]" * 5000 + "}", ["adapter_config.json", "nested deeper than 128"]),
    ('{"r": 8, "target_modules": "q_proj|(v_proj"}', ["target_modules is not a valid regex"]),
    ('{"r": 8, "rank_pattern": {"(q": 4}}', ["rank_pattern", "not valid regexes"]),
], ids=["nested-deep", "bad-target-modules-regex", "bad-rank-pattern-regex"])
def test_a_lora_adapter_config_nested_deep_or_with_a_bad_regex_is_a_400(server, tmp_path, config, words):
    path = _adapter(tmp_path / "adapter", config)
    _refused(_post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": path}), *words)
    _still_serving(server)


def _properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def _json_schema_request(schema: dict) -> dict:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def test_a_10000_property_schema_is_refused_at_once_naming_the_size_limit(server):
    t0 = time.monotonic()
    r = _post(server, "/v1/chat/completions", _json_schema_request(_properties(10000)))
    assert time.monotonic() - t0 < 10
    assert r.json()["error"]["param"] == "response_format"
    _refused(r, "response_format.json_schema.schema", "more than the limit of 1048576", "--max-grammar-size")
    _still_serving(server)


def test_a_grammar_whose_compile_runs_past_the_bound_is_refused_and_others_are_served(server):
    """3000 optional properties: under the size limit, but minutes to compile. The compile
    is stopped at the bound; requests meanwhile are served."""
    answer = {}
    slow = threading.Thread(target=lambda: answer.setdefault("r", _post(
        server, "/v1/chat/completions", _json_schema_request(_properties(3000)))))
    t0 = time.monotonic()
    slow.start()
    _still_serving(server)
    slow.join(timeout=60)
    assert time.monotonic() - t0 < GRAMMAR_TIMEOUT_S + 30
    _refused(answer["r"], "response_format.json_schema.schema: compiling it takes longer than the "
                          "limit of 2 s", "--grammar-compile-timeout-s")
    assert answer["r"].json()["error"]["param"] == "response_format"
    small = _post(server, "/v1/chat/completions", _json_schema_request(_properties(3)))
    assert small.status_code == 200, small.text
    json_text = small.json()["choices"][0]["message"]["content"]
    assert json_text.startswith("{")


def test_a_grammar_compile_is_abandoned_when_its_client_goes_away(server):
    try:
        _post(server, "/v1/chat/completions", _json_schema_request(_properties(2500)), timeout=0.5)
    except httpx.ReadTimeout:
        pass
    # The abort reaches the engine: nothing waits for a grammar, its trial compile is killed.
    wait_until(lambda: _gauge(server, "vllm:num_requests_waiting") == 0, 60, "the abandoned request leaves the engine")
    _still_serving(server)
    # The abandoned spec is not cached as refused or compiled: asked again, it runs again.
    r = _post(server, "/v1/chat/completions", _json_schema_request(_properties(2500)))
    _refused(r, "longer than the limit")


# Integer fields of the control plane, each with values a fuzzer tries first.
_INIT = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
_UPDATE = {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}
_HOSTILE = [10**30, 2**64, 2**63, -(2**63) - 1, -1, 0, 1.5, float("1e308"), "12", "9" * 30, "9" * 5000, None,
            True, [1], {"a": 1}]


def _fuzz_cases():
    for key in ("master_port", "rank_offset", "world_size"):
        for v in _HOSTILE:
            yield "/init_weight_transfer_engine", {"init_info": {**_INIT, key: v}}
    for key in ("packed_buffer_size_bytes", "packed_num_buffers", "weight_version"):
        for v in _HOSTILE:
            yield "/update_weights", {"update_info": {**_UPDATE, key: v}}
    for v in _HOSTILE:
        yield "/update_weights", {"update_info": {**_UPDATE, "shapes": [[v]]}}


def test_fuzzing_the_control_planes_integer_fields_never_gives_a_500(server):
    statuses = {}
    for path, body in _fuzz_cases():
        r = _post(server, path, body, timeout=60)
        statuses.setdefault(r.status_code, []).append(body)
        assert r.status_code < 500 or r.status_code == 502, (path, body, r.text)
    for level in ("3", "-1", "1e9", "x", str(10**30)):
        r = httpx.post(f"{server.url}/sleep", params={"level": level}, timeout=30)
        assert r.status_code == 400, (level, r.text)
    for mode in ("", "x" * 10000, "wait;"):
        assert httpx.post(f"{server.url}/pause", params={"mode": mode}, timeout=30).status_code == 400
    assert httpx.get(f"{server.url}/is_paused", timeout=30).json() == {"is_paused": False}
    _still_serving(server)


def test_the_server_log_has_no_traceback(server):
    assert "Traceback" not in server.log.read_text()


def test_sigterm_during_a_pending_init_answers_it_and_exits_0_quietly(servers):
    """No trainer ever joins: the init waits; a shutdown answers it with a 503 at once,
    and the server exits 0 with no traceback in its log."""
    srv = servers["sigterm"]
    answer = {}
    silent = SilentMaster()  # the trainer's address: it accepts and never answers
    body = {"init_info": {**_INIT, "master_port": silent.port}}
    pending = threading.Thread(target=lambda: answer.setdefault("r", _post(srv, "/init_weight_transfer_engine", body)))
    pending.start()
    wait_until(lambda: silent.connections, 60, "the init reaches the trainer's address")
    assert pending.is_alive()
    t0 = time.monotonic()
    srv.process.send_signal(15)
    pending.join(timeout=30)
    r = answer["r"]
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
    assert srv.process.wait(timeout=60) == 0
    assert time.monotonic() - t0 < 30
    log = srv.log.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    silent.close()
