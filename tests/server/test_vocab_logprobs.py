"""Logprobs over the whole vocabulary, as vLLM counts them: a request may ask for up to
--max-logprobs alternatives (20 by default), -1 asks for every token, and a server started
with --max-logprobs -1 allows it (RL uses it for entropy and KL terms). Over HTTP with the
openai client and in the offline API."""

from __future__ import annotations

import math

import httpx
import pytest

from helpers.servers import start_server, stop_server
from rlserve import LLM, SamplingParams
from rlserve.sampling_params import InvalidRequestError

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
VOCAB = 49152  # the demo model's, and the tiny preset's (rlserve.model.presets)


def _client(server):
    from openai import OpenAI
    return OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "EMPTY", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def full_vocab(demo_model, tmp_path_factory):
    """The demo model (real weights: no ties at the top), any count of logprobs allowed."""
    srv = start_server(demo_model, tmp_path_factory.mktemp("vocab") / "server.log", "--max-logprobs", "-1")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def default_limit(server):
    """--max-logprobs left at its default (20): the session's server."""
    return server


def _assert_distribution(logprobs: list[float]) -> None:
    """The whole vocabulary's logprobs, once each: their probabilities sum to 1."""
    assert len(logprobs) == VOCAB
    assert math.fsum(math.exp(v) for v in logprobs) == pytest.approx(1.0, abs=1e-3)


def _greedy_ids(client, model: str) -> list[int]:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                      extra_body={"return_token_ids": True}).choices[0].token_ids


def test_completion_logprobs_minus_one_is_the_whole_vocabulary(full_vocab):
    client = _client(full_vocab)
    choice = client.completions.create(
        model=full_vocab.model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=-1,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}).choices[0]
    assert choice.token_ids == _greedy_ids(client, full_vocab.model)
    lp = choice.logprobs
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        _assert_distribution(list(top.values()))  # keyed "token_id:<id>": one key per token
        assert next(iter(top)) == token and top[token] == chosen == max(top.values())  # greedy: rank 1


def test_chat_top_logprobs_minus_one_and_prompt_logprobs(full_vocab):
    client = _client(full_vocab)
    chat = client.chat.completions.create(model=full_vocab.model, messages=CHAT, max_tokens=2, temperature=0,
                                          logprobs=True, top_logprobs=-1,
                                          extra_body={"return_tokens_as_token_ids": True})
    for entry in chat.choices[0].logprobs.content:
        assert len({t.token for t in entry.top_logprobs}) == VOCAB  # "token_id:<id>", each once
        _assert_distribution([t.logprob for t in entry.top_logprobs])
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": -1}
    r = httpx.post(f"{full_vocab.url}/v1/completions", json=body, timeout=600)
    prompt_lps = r.json()["choices"][0]["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) > 2
    for entry in prompt_lps[1:]:  # keyed by token id: the whole vocabulary, ranked
        _assert_distribution([e["logprob"] for e in entry.values()])
        assert sorted(e["rank"] for e in entry.values())[:3] == [1, 2, 3]


def test_limits_name_the_field_and_the_server_keeps_serving(full_vocab, default_limit):
    def refused(server, path: str, body: dict) -> dict:
        r = httpx.post(f"{server.url}{path}", json={"max_tokens": 1, **body}, headers=server.headers, timeout=60)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    for body, param in [({"prompt": PROMPT, "logprobs": -1}, "logprobs"),
                        ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
                        ({"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs")]:
        err = refused(default_limit, "/v1/completions", body)
        assert err["param"] == param and "--max-logprobs (20)" in err["message"], err
    # Chat's top_logprobs is named `logprobs`, as vLLM names it (both are the sampled tokens').
    err = refused(default_limit, "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1})
    assert err["param"] == "logprobs" and "top_logprobs" in err["message"] and "whole vocabulary" in err["message"], err
    err = refused(full_vocab, "/v1/completions", {"prompt": PROMPT, "logprobs": VOCAB + 1})
    assert err["param"] == "logprobs" and str(VOCAB) in err["message"], err
    assert refused(full_vocab, "/v1/completions", {"prompt": PROMPT, "logprobs": -2})["param"] == "logprobs"
    lp = _client(default_limit).completions.create(model=default_limit.model, prompt=PROMPT, max_tokens=2,
                                                   logprobs=20).choices[0]
    assert all(len(top) <= 21 for top in lp.logprobs.top_logprobs)  # 20 still allowed, by default


def test_offline_api_whole_vocabulary_and_its_limit(demo_model):
    llm = LLM(demo_model, max_logprobs=-1, device="cpu", dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=64 << 20)
    with pytest.raises(InvalidRequestError, match="max-logprobs") as e:
        llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=VOCAB + 1), use_tqdm=False)
    assert e.value.param == "prompt_logprobs" and str(VOCAB) in str(e.value)
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=-1, prompt_logprobs=-1)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    sample = out.outputs[0]
    assert sample.token_ids == greedy.outputs[0].token_ids
    for lp in sample.logprobs + out.prompt_logprobs[1:]:
        ids, logprobs = lp.top.arrays()
        assert sorted(ids.tolist()) == list(range(VOCAB))
        _assert_distribution(logprobs.tolist())
    for lp in sample.logprobs:
        assert lp.rank == 1 and lp.top[0] == (lp.token_id, lp.logprob)
