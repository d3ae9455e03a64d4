"""What running vLLM's own OpenAI-server tests against rlserve found (issue 41, "Differences
found by vLLM's tests"), each answered as vLLM answers it, over HTTP and the official
openai client against a real server: weight versions as strings, vLLM's null fields and
chunk shapes, 503 during an abort or wait pause, /pause clearing the prefix cache, no tool
call from a cut named tool_choice, stream_options without stream, the batch and SageMaker
routes, echo's top_logprobs order, a missing LoRA path, and vLLM's error params and shape."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from helpers.servers import start_tiny_server, stop_server

CHAT = [{"role": "user", "content": "Name three colors."}]
TOKENS = list(range(100, 164))  # four full KV blocks: enough for the prefix cache to hold
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "pattern": "[A-Za-z]{3,12}"}},
        "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_tiny_server(tmp_path_factory.mktemp("vllm_parity") / "s.log",
                            "--weight-transfer-config", '{"backend": "gloo", "timeout_s": 30}',
                            "--enable-lora", "--max-model-len", "2048")
    yield srv
    stop_server(srv)


def post(server, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=kw.pop("timeout", 300), **kw)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def openai_client(server):
    from openai import OpenAI
    return OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=300)


# ---------------------------------------------------------------- 2: weight versions


def test_weight_versions_are_vllms_strings_streamed_and_not(server):
    assert post(server, "/update_weight_version", {"new_version": "41"}).status_code == 200
    label = httpx.get(f"{server.url}/weight_info").json()["weight_version"]
    assert label == "41"
    for path, body in (("/v1/completions", {"prompt": TOKENS, "max_tokens": 5}),
                       ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5})):
        body = {**body, "ignore_eos": True, "return_weight_versions": True}
        choice = ok(post(server, path, body))["choices"][0]
        assert choice["weight_versions"] == [{"version": label, "start": 0, "end": 5}]
        assert choice["weight_version_spans"] == [{"version": 41, "start": 0, "end": 5}]  # the older name
        last = [c for e in events(server, path, body) for c in e["choices"]][-1]
        assert last["finish_reason"] == "length"
        assert last["weight_versions"] == [{"version": label, "start": 0, "end": 5}]
        plain = ok(post(server, path, {**body, "return_weight_versions": False}))["choices"][0]
        assert "weight_versions" not in plain and "weight_version_spans" not in plain


# ---------------------------------------------------------------- 3: null fields, chunk shapes


def test_fields_vllm_sends_as_null_are_present(server):
    completion = ok(post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}))["choices"][0]
    for name in ("stop_reason", "prompt_logprobs", "prompt_token_ids", "token_ids", "logprobs"):
        assert name in completion and completion[name] is None, name
    chat = ok(post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}))
    assert chat["prompt_logprobs"] is None and chat["prompt_token_ids"] is None
    choice = chat["choices"][0]
    assert choice["message"]["reasoning"] is None and "tool_calls" not in choice["message"]
    assert choice["stop_reason"] is None and choice["token_ids"] is None
    client = openai_client(server)
    assert client.completions.create(model="m", prompt="Hi", max_tokens=2).choices[0].stop_reason is None
    assert client.chat.completions.create(model="m", messages=CHAT, max_tokens=2).choices[0].stop_reason is None
    (base,) = [c for c in ok(httpx.get(f"{server.url}/v1/models"))["data"] if c["id"] == "m"]
    assert "parent" in base and base["parent"] is None
    tokenized = ok(post(server, "/tokenize", {"prompt": "Hi"}))
    assert "token_strs" in tokenized and tokenized["token_strs"] is None


def test_stream_chunks_have_vllms_fields(server):
    """Completion chunks carry every field of vLLM's stream choice; chat chunks only those
    set: logprobs and finish_reason always, token_ids with tokens, stop_reason at the end."""
    chunks = events(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    for c in (c for e in chunks for c in e["choices"]):
        assert set(c) == {"index", "text", "logprobs", "finish_reason", "stop_reason",
                          "prompt_token_ids", "token_ids"}, c
    chunks = events(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "ignore_eos": True})
    first, *rest = chunks
    assert set(first) == {"id", "object", "created", "model", "choices", "prompt_token_ids", "weight_version"}
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    *middle, last = [c for e in rest for c in e["choices"]]
    assert all(set(c) == {"index", "delta", "logprobs", "finish_reason", "token_ids"} for c in middle), middle
    assert set(last) == {"index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"}
    assert last["finish_reason"] == "length" and last["stop_reason"] is None


# ---------------------------------------------------------------- 4, 8: pause


def _pause(server, **params) -> None:
    assert httpx.post(f"{server.url}/pause", params=params, timeout=60).status_code == 200


def _resume(server) -> None:
    assert httpx.post(f"{server.url}/resume", timeout=60).status_code == 200


def _num_waiting(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_waiting{"))


def test_requests_during_an_abort_or_wait_pause_get_503_and_a_keep_pause_holds_them(server):
    body = {"prompt": "Hi", "max_tokens": 2}
    for mode in ("abort", "wait"):
        _pause(server, mode=mode)
        try:
            # Answered at once: a request that waited for /resume would time out here.
            err = error(post(server, "/v1/completions", body, timeout=60), 503)
            assert err["type"] == "ServiceUnavailableError" and err["code"] == 503
            assert f"mode {mode}" in err["message"] and "/resume" in err["message"]
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                              json={"messages": CHAT, "max_tokens": 2, "stream": True}) as r:
                assert r.status_code == 503
        finally:
            _resume(server)
        ok(post(server, "/v1/completions", body))
    _pause(server, mode="keep")
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", post(server, "/v1/completions", body)))
    try:
        t.start()
        deadline = time.monotonic() + 60
        while _num_waiting(server) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _num_waiting(server) >= 1 and t.is_alive()  # held until /resume
    finally:
        _resume(server)
    t.join(timeout=120)
    ok(out["r"])


def _cached(server) -> int:
    r = ok(post(server, "/v1/completions", {"prompt": TOKENS, "max_tokens": 1}))
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_clears_the_prefix_cache_by_default(server, mode):
    _cached(server)
    assert _cached(server) > 0  # the prompt's blocks are cached
    _pause(server, mode=mode, clear_cache="false")
    _resume(server)
    assert _cached(server) > 0
    _pause(server, mode=mode)  # clear_cache defaults to true, as in vLLM
    _resume(server)
    assert _cached(server) == 0


# ---------------------------------------------------------------- 9, 11, 12, 13, 14


def test_named_tool_choice_cut_short_by_max_tokens_is_no_call(server):
    client = openai_client(server)
    body = dict(model="m", messages=CHAT, tools=[WEATHER], max_tokens=2, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls
    whole = client.chat.completions.create(**{**body, "max_tokens": 40}).choices[0]
    (call,) = whole.message.tool_calls  # the same request with room: a call with JSON arguments
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)


def test_stream_options_without_stream_is_400(server):
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        err = error(post(server, path, {**body, "max_tokens": 2, "stream_options": {"include_usage": True}}), 400)
        assert err["param"] == "stream_options" and "stream=True" in err["message"]
        ok(post(server, path, {**body, "max_tokens": 2, "stream_options": {}}))  # empty: as in vLLM


def test_batch_chat_completions_and_sagemaker_invocations(server):
    other = [{"role": "user", "content": "Count to three."}]
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    singles = [ok(post(server, "/v1/chat/completions", {"messages": m, **greedy}))["choices"][0]
               for m in (CHAT, other)]
    batch = ok(post(server, "/v1/chat/completions/batch", {"messages": [CHAT, other], **greedy,
                                                            "return_token_ids": True}))
    assert batch["object"] == "chat.completion" and [c["index"] for c in batch["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in batch["choices"]] == [c["message"]["content"] for c in singles]
    assert batch["usage"]["completion_tokens"] == 12 and all(len(c["token_ids"]) == 6 for c in batch["choices"])
    assert error(post(server, "/v1/chat/completions/batch", {"messages": [CHAT], "stream": True}), 400)["param"] \
        == "stream"
    assert error(post(server, "/v1/chat/completions/batch", {"messages": [CHAT], "n": 2}), 400)["param"] == "n"

    chat = ok(post(server, "/invocations", {"messages": CHAT, **greedy}))
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == singles[0]["message"]["content"]
    assert ok(post(server, "/invocations", {"prompt": "Hi", "max_tokens": 2}))["object"] == "text_completion"
    assert error(post(server, "/invocations", {"messages": CHAT, "temperature": -1}), 400)["param"] == "temperature"
    assert "Cannot find suitable handler" in error(post(server, "/invocations", {"input": "Hi"}), 400)["message"]
    assert httpx.get(f"{server.url}/ping").status_code == 200


def test_echo_top_logprobs_list_the_chosen_token_first(server):
    r = ok(post(server, "/v1/completions", {"prompt": TOKENS[:24], "max_tokens": 4, "echo": True,
                                            "logprobs": 1, "temperature": 1.0, "seed": 7}))
    lp = r["choices"][0]["logprobs"]
    assert lp["top_logprobs"][0] is None
    for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]):
        assert next(iter(top)) == token and 1 <= len(top) <= 2


def test_a_missing_lora_path_is_404(server):
    err = error(post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/adapter"}), 404)
    assert err["type"] == "NotFoundError" and err["code"] == 404 and "/no/such/adapter" in err["message"]


# ---------------------------------------------------------------- 15: error params and shape


def test_validation_errors_name_vllms_params_in_vllms_shape(server):
    err = error(post(server, "/v1/completions", {"prompt": [5] * 2000, "max_tokens": 100}), 400)
    assert err["param"] == "input_tokens" and err["type"] == "BadRequestError" and err["code"] == 400
    assert "2048" in err["message"]
    err = error(post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4000}), 400)
    assert err["param"] == "max_tokens" and err["code"] == 400
    err = error(post(server, "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}), 400)
    assert err["param"] == "logprobs"
    err = error(post(server, "/v1/completions", {"model": "nope", "prompt": "Hi"}), 404)
    assert (err["type"], err["code"], err["param"]) == ("NotFoundError", 404, "model")
    err = error(post(server, "/v1/completions", {"prompt": "Hi", "temperature": -1}), 400)
    assert (err["type"], err["code"], err["param"]) == ("BadRequestError", 400, "temperature")
    # What vLLM accepts: top_logprobs 0 without logprobs, prompt_logprobs 0 with stream.
    ok(post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "top_logprobs": 0}))
    assert events(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 0})
