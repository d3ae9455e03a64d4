"""The OpenAI-compatible server, end to end: a real `rlserve serve` process on the demo model
(CPU, float32), driven by the official openai client and compared with the offline API."""

from __future__ import annotations

import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.servers import MAX_MODEL_LEN, RunningServer
from rlserve import SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is"]
CHAT = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 16
LOGPROB_TOL = 1e-4


def metric_samples(server: RunningServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    # One engine, one model: every sample but the per-reason ones has one label set.
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if set(s.labels) == {"model_name", "engine"}}


def post(server: RunningServer, path: str, body: dict | str, **headers: str) -> httpx.Response:
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    return httpx.post(f"{server.url}{path}", headers={**server.headers, **headers},
                      timeout=300, **kw)


def assert_logprobs_close(server_lps: list[float], offline_lps: list[float]) -> None:
    assert len(server_lps) == len(offline_lps)
    for a, b in zip(server_lps, offline_lps):
        assert abs(a - b) < LOGPROB_TOL, (server_lps, offline_lps)


# ---------------------------------------------------------------- offline references


def like_the_server(fn, *args):
    """Run fn in a worker thread, as the server's engine loop runs its steps: the same
    thread setup gives the same kernels, and on a busy CPU the main thread's OpenMP pool
    is many times slower."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


@pytest.fixture(scope="module")
def offline_completions(offline_llm):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    return like_the_server(offline_llm.generate, PROMPTS, params)


@pytest.fixture(scope="module")
def offline_chat(offline_llm):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    return like_the_server(offline_llm.chat, CHAT, params)[0]


# ---------------------------------------------------------------- service endpoints


def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert models[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_the_model_answers_to_its_path_and_its_directory_name(server, client):
    """Listed as given (a path here, as vLLM lists it); requests may name the path or the
    directory's name, and the response echoes the name asked for (as vLLM's does); any
    other name is a 404 naming the field."""
    import openai
    short = os.path.basename(os.path.normpath(server.model))
    for name in (server.model, short):
        assert client.completions.create(model=name, prompt="Hi", max_tokens=1).model == name
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model=short + "-other", prompt="Hi", max_tokens=1)
    assert err.value.body["param"] == "model"


def test_tokenize_detokenize(server, offline_llm):
    r = post(server, "/tokenize", {"prompt": PROMPTS[0]})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == offline_llm.tokenizer.encode(PROMPTS[0])
    assert r.json()["count"] == len(ids) and r.json()["max_model_len"] == MAX_MODEL_LEN
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == PROMPTS[0]
    chat = post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    assert chat == offline_llm.apply_chat_template(CHAT)


# ---------------------------------------------------------------- equality with offline


def test_greedy_completion_matches_offline(server, client, offline_completions):
    resp = client.completions.create(
        model=server.model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
        extra_body={"return_token_ids": True, "return_weight_versions": True})
    assert isinstance(resp.weight_version, int)
    assert [c.index for c in resp.choices] == [0, 1]
    for choice, ref in zip(resp.choices, offline_completions):
        out = ref.outputs[0]
        assert choice.text == out.text
        assert choice.token_ids == out.token_ids
        assert choice.prompt_token_ids == ref.prompt_token_ids
        assert choice.finish_reason == out.finish_reason
        assert choice.weight_version_spans == [
            {"version": resp.weight_version, "start": 0, "end": len(out.token_ids)}]
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.text_offset) == len(lp.top_logprobs) == len(out.token_ids)
        assert "".join(lp.tokens) == out.text
        assert lp.text_offset[0] == 0
        assert_logprobs_close(lp.token_logprobs, [t.logprob for t in out.logprobs])
        for top, t in zip(lp.top_logprobs, out.logprobs):
            assert_logprobs_close(sorted(top.values(), reverse=True)[:2], [v for _, v in t.top])
    usage = resp.usage
    assert usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in offline_completions)
    assert usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in offline_completions)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_greedy_chat_matches_offline(server, client, offline_chat):
    resp = client.chat.completions.create(
        model=server.model, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
    out = offline_chat.outputs[0]
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == out.text
    assert choice.token_ids == out.token_ids
    assert resp.prompt_token_ids == offline_chat.prompt_token_ids
    assert isinstance(resp.weight_version, int)
    content = choice.logprobs.content
    assert_logprobs_close([c.logprob for c in content], [t.logprob for t in out.logprobs])
    for c, t in zip(content, out.logprobs):
        assert len(c.top_logprobs) == 2
        assert_logprobs_close([x.logprob for x in c.top_logprobs], [v for _, v in t.top])
    # Bytes are each token's own: together they spell the text (the end-of-turn token,
    # a special token, is not part of the text).
    spelled = content[:-1] if choice.finish_reason == "stop" else content
    assert bytes(b for c in spelled for b in c.bytes).decode() == out.text
    assert resp.usage.prompt_tokens == len(offline_chat.prompt_token_ids)


# ---------------------------------------------------------------- streaming


def test_completion_stream_equals_non_streamed(server, client, offline_completions):
    chunks = list(client.completions.create(
        model=server.model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=1, stream=True, stream_options={"include_usage": True}))
    assert all(isinstance(c.weight_version, int) for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline_completions[0].outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    offsets = [o for c in chunks if c.choices for o in c.choices[0].logprobs.text_offset]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_stream_equals_non_streamed(server, client, offline_chat):
    stream = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline_chat.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(offline_chat.outputs[0].token_ids)


def test_stream_ends_with_done(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers=server.headers, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert all("weight_version" in json.loads(e[6:]) for e in events[:-1])


# ---------------------------------------------------------------- sampling options


def test_n_samples_and_seed(server, client):
    kw = dict(model=server.model, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=4,
              seed=1234)
    resp = client.completions.create(**kw)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in resp.choices)
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    chat = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=4, n=4)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2, 3]


def test_token_prompts_echo_and_stop(server, client, offline_llm, offline_completions):
    ref = offline_completions[0]
    ids = ref.prompt_token_ids
    resp = client.completions.create(model=server.model, prompt=[ids, ids], max_tokens=MAX_TOKENS,
                                     temperature=0, echo=True)
    assert len(resp.choices) == 2
    assert all(c.text == PROMPTS[0] + ref.outputs[0].text for c in resp.choices)
    # A stop string cuts the text before it and is reported as the stop reason.
    stop = ref.outputs[0].text[8:11]
    cut = client.completions.create(model=server.model, prompt=ids, max_tokens=MAX_TOKENS,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert ref.outputs[0].text.startswith(cut.choices[0].text)
    assert stop not in cut.choices[0].text
    assert cut.choices[0].stop_reason == stop


def test_echo_logprobs_cover_the_prompt(server):
    r = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2,
                                         "temperature": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert len(lp["tokens"]) == len(lp["text_offset"]) >= 7


def test_extensions_min_tokens_ignore_eos(server):
    r = post(server, "/v1/completions", {
        "prompt": PROMPTS[0], "max_tokens": 6, "min_tokens": 6, "ignore_eos": True,
        "top_k": 5, "min_p": 0.05, "temperature": 0.7, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"


def test_detokenize_false_returns_the_same_tokens_and_logprobs(server):
    """Token-only rollouts: nothing is decoded, ids and logprobs are the normal request's."""
    body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "logprobs": 2,
            "return_token_ids": True}
    normal = post(server, "/v1/completions", body).json()["choices"][0]
    bare = post(server, "/v1/completions", {**body, "detokenize": False}).json()["choices"][0]
    assert bare["text"] == "" and normal["text"]
    assert bare["token_ids"] == normal["token_ids"]
    assert bare["logprobs"]["token_logprobs"] == normal["logprobs"]["token_logprobs"]
    assert bare["logprobs"]["tokens"] == [f"token_id:{t}" for t in normal["token_ids"]]
    r = post(server, "/v1/completions", {**body, "detokenize": False, "stop": ["."]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_text_is_the_detokenized_tokens_up_to_a_matched_stop(server, stream):
    """The text is what the token ids decode to, cut only at a matched stop string. A stop
    string is looked for only in text after the first min_tokens tokens (as vLLM does), so
    one met earlier stays in the text, as its tokens stay in token_ids."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(server.model)
    seen = set()
    for min_tokens in (0, 2, 5, 9):
        for include in (False, True):
            body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "stop": ["."],
                    "min_tokens": min_tokens, "include_stop_str_in_output": include,
                    "return_token_ids": True, "stream": stream}
            if stream:
                with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                                  headers=server.headers, timeout=300) as r:
                    chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines()
                              if line.startswith("data: {")]
                text = "".join(c["text"] for c in chunks)
                ids = [t for c in chunks for t in c.get("token_ids") or []]
                stop_reason = chunks[-1].get("stop_reason")
            else:
                choice = post(server, "/v1/completions", body).json()["choices"][0]
                text, ids, stop_reason = choice["text"], choice["token_ids"], choice.get("stop_reason")
            decoded = tok.decode(ids, skip_special_tokens=True)
            if stop_reason == ".":
                cut = decoded.index(".", len(tok.decode(ids[:min_tokens], skip_special_tokens=True)))
                assert text == decoded[:cut + (1 if include else 0)], (min_tokens, include, text, decoded)
                # the stop string is in the last token's text
                assert cut >= len(tok.decode(ids[:-1], skip_special_tokens=True)) - 1
            else:
                assert text == decoded, (min_tokens, text, decoded)
            seen.add((min_tokens > 0 and "." in decoded[:-1], stop_reason))
    assert (True, ".") in seen or (True, None) in seen  # a "." before min_tokens was kept


# ---------------------------------------------------------------- concurrency


def test_32_concurrent_requests_match_sequential(server):
    from openai import AsyncOpenAI

    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(8)]

    async def run() -> tuple[list[str], list[str]]:
        aclient = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key,
                              max_retries=0, timeout=300)

        async def one(p: str) -> str:
            r = await aclient.completions.create(model=server.model, prompt=p, max_tokens=8,
                                                 temperature=0)
            return r.choices[0].text

        sequential = [await one(p) for p in prompts]
        concurrent = await asyncio.gather(*(one(prompts[i % 8]) for i in range(32)))
        await aclient.close()
        return sequential, list(concurrent)

    sequential, concurrent = asyncio.run(run())
    assert concurrent == [sequential[i % 8] for i in range(32)]


def test_streams_progress_together(server):
    """Two streams in flight at once both make progress before either ends."""
    from openai import AsyncOpenAI

    async def run() -> list[int]:
        aclient = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key,
                              max_retries=0, timeout=300)
        order: list[int] = []

        async def one(i: int) -> None:
            stream = await aclient.completions.create(
                model=server.model, prompt=PROMPTS[i], max_tokens=12, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    order.append(i)

        await asyncio.gather(one(0), one(1))
        await aclient.close()
        return order

    order = asyncio.run(run())
    first_end = min(max(j for j, i in enumerate(order) if i == k) for k in (0, 1))
    assert {0, 1} <= set(order[:first_end + 1])


def test_client_disconnect_aborts_request(server, client):
    before = metric_samples(server)
    body = {"prompt": PROMPTS[0], "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers=server.headers, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        while got < 3:
            got += next(lines).startswith("data: ")
    # Leaving the block closed the connection mid-stream.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = metric_samples(server)
        if (after["rlserve_requests_aborted_total"] > before["rlserve_requests_aborted_total"]
                and after["vllm:num_requests_running"] == 0):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no abort seen in /metrics: {after}")
    assert after["rlserve_client_disconnects_total"] > before["rlserve_client_disconnects_total"]
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < 900
    # ... and the server keeps serving.
    resp = client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=2)
    assert resp.choices[0].text


# ---------------------------------------------------------------- metrics


def test_metrics_parse(server, client):
    client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "rlserve_requests_aborted",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
        assert name in families, name
    samples = metric_samples(server)
    assert samples["vllm:time_to_first_token_seconds_count"] >= 1
    assert samples["vllm:inter_token_latency_seconds_count"] >= 2
    assert samples["vllm:prompt_tokens_total"] > 0
    assert 0 <= samples["vllm:kv_cache_usage_perc"] <= 1


# ---------------------------------------------------------------- errors


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_prompt_too_long_is_400_naming_max_model_len(server):
    err = error_of(post(server, "/v1/completions",
                        {"prompt": [1] * (MAX_MODEL_LEN + 10), "max_tokens": 4}), 400)
    assert "max_model_len" in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    err = error_of(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 10**6}), 400)
    assert err["param"] == "max_tokens" and "max_model_len" in err["message"]


def test_bad_parameters_are_400_naming_the_field(server):
    cases = [
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "logprobs": 99}, "logprobs"),
        ({"prompt": "hi", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [10**7]}, "prompt"),
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": "hi", "temprature": 0.5}, "temprature"),
        ({"max_tokens": 4}, "prompt"),
    ]
    for body, param in cases:
        err = error_of(post(server, "/v1/completions", body), 400)
        assert err["param"] == param, (body, err)
        assert param in err["message"], (body, err)
    err = error_of(post(server, "/v1/chat/completions",
                        {"messages": CHAT, "top_logprobs": 2}), 400)
    assert err["param"] == "top_logprobs"
    err = error_of(post(server, "/v1/chat/completions", {"messages": []}), 400)
    assert err["param"] == "messages"
    error_of(post(server, "/v1/completions", "{not json", **{"content-type": "application/json"}),
             400)
    # NaN is valid for Python's JSON parser, never for a sampler.
    err = error_of(post(server, "/v1/completions", '{"prompt": "hi", "temperature": NaN}',
                        **{"content-type": "application/json"}), 400)
    assert err["param"] == "temperature"


def test_errors_through_the_openai_client(server, client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="hi", temperature=-0.5)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)


def test_api_key_is_enforced(server):
    from openai import AuthenticationError, OpenAI

    wrong = OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(AuthenticationError):
        wrong.completions.create(model=server.model, prompt="hi", max_tokens=2)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert error_of(r, 401)["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key


def test_unknown_route_is_openai_shaped_404(server):
    error_of(httpx.get(f"{server.url}/v1/nothing-here", headers=server.headers), 404)


# ---------------------------------------------------------------- fuzzing


import schemathesis  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.config import SchemathesisConfig  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance  # noqa: E402

FUZZ_EXAMPLES = 40
FUZZ_MAX_TOKENS = 4  # every generated request stays cheap on a CPU


@pytest.fixture(scope="module")
def api_schema(server):
    # The coverage phase sends every boundary case the schema defines (hundreds per
    # generation endpoint), unbounded by max_examples: too slow for a CPU model in CI, so
    # the generation endpoints get the bounded fuzzing phase only.
    config = SchemathesisConfig.from_dict({"operations": [
        {"include-path-regex": "completions(/batch)?$", "phases": {"coverage": {"enabled": False}}}]})
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config)


openapi = schemathesis.pytest.from_fixture("api_schema")


def _cheap(body: object) -> None:
    """Bound a fuzzed generation request's cost; leave everything else as generated.

    A missing or null max_tokens means "up to max_model_len", so it is bounded too.
    """
    if not isinstance(body, dict) or not ("prompt" in body or "messages" in body):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is None or (isinstance(value, int) and value > FUZZ_MAX_TOKENS):
            body[key] = FUZZ_MAX_TOKENS
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > FUZZ_MAX_TOKENS:
        body["min_tokens"] = FUZZ_MAX_TOKENS
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        body["prompt"] = prompt[:2]  # at most two prompts per request
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], list):
        body["messages"] = messages[:2]  # /v1/chat/completions/batch: at most two conversations


@openapi.parametrize()
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True)
def test_openapi_fuzz_never_5xx(case, server):
    _cheap(case.body)
    case.call_and_validate(headers=server.headers, timeout=120,
                          checks=[not_a_server_error, response_schema_conformance])
