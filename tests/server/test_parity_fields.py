"""Request fields RL users send to vLLM (logprob_token_ids, truncate_prompt_tokens),
streamed tool_choice "required", vLLM's admission and cache metrics, and the wording of
errors vLLM users match on; over HTTP against the server started with vLLM's flags (the
Qwen3 reasoning parser among them: a grammar's output stays content)."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.servers import MAX_MODEL_LEN, RunningServer

CHAT = [{"role": "user", "content": "Name three colors."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "[A-Za-z]{3,8}"}},
    "required": ["city"], "additionalProperties": False}}}


@pytest.fixture
def server(flags_server: RunningServer) -> RunningServer:
    return flags_server


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": "q", **body}, timeout=300)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def refused(r: httpx.Response, param: str, *words: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err
    return err["message"]


# ---------------------------------------------------------------- logprob_token_ids


def test_logprob_token_ids_are_the_chosen_tokens_logprobs_at_every_position(server):
    """Over HTTP: the chosen ids at every position, in the order asked for, the sampled
    token's own logprob unchanged (their values: the offline test below, on real logits)."""
    base = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "return_tokens_as_token_ids": True}
    top = ok(post(server, "/v1/chat/completions", {**base, "top_logprobs": 5}))["choices"][0]["logprobs"]["content"]
    first = [int(e["token"].removeprefix("token_id:")) for e in top[0]["top_logprobs"]]
    wanted = [first[2], first[0], 7]
    content = ok(post(server, "/v1/chat/completions", {**base, "logprob_token_ids": wanted})
                 )["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [e["token"] for e in top]
    for got, ref in zip(content, top):
        assert [e["token"] for e in got["top_logprobs"]] == [f"token_id:{t}" for t in wanted]
        assert got["logprob"] == pytest.approx(ref["logprob"], abs=1e-5)
        by_token = {e["token"]: e["logprob"] for e in ref["top_logprobs"]}
        for entry in got["top_logprobs"]:
            if entry["token"] in by_token:
                assert entry["logprob"] == pytest.approx(by_token[entry["token"]], abs=1e-5)
    assert [e["logprob"] for e in content[0]["top_logprobs"][:2]] == pytest.approx(
        [top[0]["top_logprobs"][2]["logprob"], top[0]["top_logprobs"][0]["logprob"]], abs=1e-5)
    # Completions: the chosen tokens (and the sampled one) at every position.
    body = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "logprob_token_ids": [7, 8], "return_tokens_as_token_ids": True}
    lps = ok(post(server, "/v1/completions", body))["choices"][0]["logprobs"]
    for sampled, top_lp in zip(lps["tokens"], lps["top_logprobs"]):
        assert {"token_id:7", "token_id:8"} <= set(top_lp) and set(top_lp) <= {"token_id:7", "token_id:8", sampled}


def test_logprob_token_ids_bad_values_are_named(server):
    base = {"messages": CHAT, "max_tokens": 1}
    refused(post(server, "/v1/chat/completions", {**base, "logprob_token_ids": [1]}), "logprob_token_ids", "logprobs")
    refused(post(server, "/v1/chat/completions", {**base, "logprobs": True, "logprob_token_ids": [1, 10**6]}),
            "logprob_token_ids", "1000000", "out of vocabulary")
    r = post(server, "/v1/chat/completions", {**base, "logprobs": True, "logprob_token_ids": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids"


# ---------------------------------------------------------------- truncate_prompt_tokens


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    prompt = list(range(10, 60))
    out = ok(post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 10,
                                            "return_token_ids": True}))
    assert out["usage"]["prompt_tokens"] == 10 and out["choices"][0]["prompt_token_ids"] == prompt[-10:]
    long_chat = [{"role": "user", "content": "word " * 100}]
    out = ok(post(server, "/v1/chat/completions", {"messages": long_chat, "max_tokens": 1,
                                                 "truncate_prompt_tokens": 8, "return_token_ids": True}))
    full = ok(post(server, "/v1/chat/completions", {"messages": long_chat, "max_tokens": 1, "return_token_ids": True}))
    assert out["prompt_token_ids"] == full["prompt_token_ids"][-8:]
    for bad in (0, MAX_MODEL_LEN + 1):
        refused(post(server, "/v1/completions", {"prompt": prompt, "truncate_prompt_tokens": bad}),
                "truncate_prompt_tokens", str(MAX_MODEL_LEN))


# ---------------------------------------------------------------- tool_choice required, streamed


def _stream(server, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={"model": "q", **body, "stream": True},
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return [c for c in chunks if c["choices"]]  # not the usage chunk (--enable-force-include-usage)


def test_required_tool_calls_stream_as_they_are_generated(server):
    body = {"messages": CHAT, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 60,
            "temperature": 0, "parallel_tool_calls": False}
    chunks = _stream(server, body)
    deltas = [(i, t) for i, c in enumerate(chunks) for t in c["choices"][0]["delta"].get("tool_calls") or []]
    named = [i for i, t in deltas if t["function"].get("name")]
    assert len(named) == 1 and deltas[0][1]["function"]["name"] == "get_weather"
    with_args = [i for i, t in deltas if t["function"].get("arguments")]
    assert len(set(with_args)) > 2, "arguments arrive in pieces, as they are generated"
    assert named[0] < len(chunks) - 2, "the name goes out before the end"
    arguments = json.loads("".join(t["function"].get("arguments") or "" for _, t in deltas))
    whole = ok(post(server, "/v1/chat/completions", {**body}))
    assert arguments == json.loads(whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
    # Cut by max_tokens inside the arguments: what was generated went out as the call, not as content.
    cut = _stream(server, {**body, "max_tokens": whole["usage"]["completion_tokens"] - 3})
    assert cut[-1]["choices"][0]["finish_reason"] == "length"
    assert not any(c["choices"][0]["delta"].get("content") for c in cut)
    assert any(t["function"].get("name") == "get_weather"
               for c in cut for t in c["choices"][0]["delta"].get("tool_calls") or [])


# ---------------------------------------------------------------- metrics


def _families(server) -> dict:
    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_admission_rejections_and_cache_config_info(server):
    before = _families(server)["vllm:admission_rejections"].samples[0].value
    refused(post(server, "/v1/completions", {"prompt": "hi", "temperature": -1}), "temperature")
    refused(post(server, "/v1/completions", {"prompt": [10**6]}), "prompt", "out of vocabulary")
    families = _families(server)
    assert families["vllm:admission_rejections"].samples[0].value == before + 2
    labels = families["vllm:cache_config_info"].samples[0].labels
    capacity = families["rlserve_kv_cache_capacity_tokens"].samples[0].value
    assert int(labels["kv_cache_size_tokens"]) == capacity > 0
    assert float(labels["kv_cache_max_concurrency"]) == pytest.approx(capacity / MAX_MODEL_LEN, abs=0.01)


# ---------------------------------------------------------------- wording


def test_error_wording_names_the_limit_and_every_bad_key(server):
    base = {"prompt": "hi", "max_tokens": 1}
    refused(post(server, "/v1/completions", {**base, "seed": 2**63}), "seed", str(2**63 - 1))
    refused(post(server, "/v1/completions", {**base, "seed": -(2**63) - 1}), "seed", str(-(2**63)))
    refused(post(server, "/v1/completions", {**base, "stop_token_ids": [10**6]}), "stop_token_ids",
            "out of vocabulary")
    refused(post(server, "/v1/completions", {**base, "logit_bias": {"a": 1, "1": 2, "b": 3}}), "logit_bias",
            "'a'", "'b'")
    refused(post(server, "/v1/completions", {**base, "logit_bias": {"900000": 1, "800000": 2}}), "logit_bias",
            "800000", "900000", "out of vocabulary")


def test_offline_seed_bound_is_named():
    from rlserve import SamplingParams
    from rlserve.sampling_params import InvalidRequestError
    with pytest.raises(InvalidRequestError, match=str(2**63 - 1)):
        SamplingParams(seed=2**63)


def test_logprob_token_ids_values_in_a_mixed_batch(offline_llm):
    """On the demo model's real logits (the server's random ones are near flat): rows asking
    for chosen tokens beside a row asking for the top k each get what they asked for, the
    chosen ids' values equal to what the top 20 say of them."""
    from rlserve import SamplingParams
    prompts = ["The capital of France is", "Water boils at", "One, two,"]
    base = dict(temperature=0, max_tokens=4, ignore_eos=True)
    ref = offline_llm.generate(prompts, SamplingParams(logprobs=20, **base), use_tqdm=False)
    wanted = [[t for t, _ in o.outputs[0].logprobs[0].top.head(20)][::-4] for o in ref]
    params = [SamplingParams(logprobs=0, logprob_token_ids=wanted[0], **base),
              SamplingParams(logprobs=2, **base),
              SamplingParams(logprob_token_ids=wanted[2], **base)]
    outs = offline_llm.generate(prompts, params, use_tqdm=False)
    compared = 0
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert out.outputs[0].token_ids == r.outputs[0].token_ids
        for got, top in zip(out.outputs[0].logprobs, r.outputs[0].logprobs):
            assert got.rank == top.rank and got.logprob == pytest.approx(top.logprob, abs=1e-4)
            if i == 1:
                assert [t for t, _ in got.top] == [t for t, _ in top.top.head(2)]
                continue
            assert [t for t, _ in got.top] == wanted[i]
            known = dict(top.top.head(20))
            for t, v in got.top:
                if t in known:
                    compared += 1
                    assert v == pytest.approx(known[t], abs=1e-4)
    assert compared >= 10
