"""Routing replay served (CPU, float32): `rlserve serve --enable-return-routed-experts` on
the tiny MoE preset's architecture, dummy weights at start, then a live gloo push of
transformers' weights; every choice's routed_experts (vLLM's field: [prompt + output - 1,
num_hidden_layers, top_k]) equals transformers' own top-k for the same tokens, row for
row, in /v1/completions and /v1/chat/completions, streamed or not, with n = 4 and with a
prefix-cache hit; `return_routed_experts: false` gives null. A dense model with the flag
starts (with a warning) and refuses `return_routed_experts: true` with a 400 naming it."""

from __future__ import annotations

import json
from functools import partial

import httpx
import numpy as np
import pytest
from openai import BadRequestError, OpenAI

from helpers.checkpoints import save_word_tokenizer, seeded_wide_model
from helpers.routes import hf_routes, preset_config
from helpers.servers import start_server, start_side_by_side, start_tiny_server, stop_server
from rlserve.weight_transfer import WeightSyncClient

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    hf = seeded_wide_model(preset_config()).eval()
    path = tmp_path_factory.mktemp("moe-replay")
    hf.save_pretrained(path)
    save_word_tokenizer(path, hf.config.vocab_size)
    return hf, str(path)


@pytest.fixture(scope="module")
def servers(trainer, tmp_path_factory):
    """The module's servers, started side by side, all with --enable-return-routed-experts:
    "moe" (dummy weights, for a push), "dense" (the tiny dense preset) and "dp" (the
    checkpoint on two data-parallel replicas)."""
    logs = tmp_path_factory.mktemp("replay")
    path = trainer[1]
    started = start_side_by_side(
        partial(start_server, path, logs / "server.log", "--load-format", "dummy",
                "--served-model-name", "m", "--max-model-len", "256", "--enable-return-routed-experts",
                "--chat-template", TEMPLATE,
                "--weight-transfer-config", json.dumps({"backend": "gloo", "timeout_s": 30})),
        partial(start_tiny_server, logs / "dense.log", "--enable-return-routed-experts"),
        partial(start_server, path, logs / "dp.log", "--served-model-name", "m", "--max-model-len", "256",
                "--data-parallel-size", "2", "--enable-return-routed-experts"))
    yield dict(zip(("moe", "dense", "dp"), started))
    for srv in started:
        stop_server(srv)


@pytest.fixture(scope="module")
def server(servers):
    return servers["moe"]


@pytest.fixture(scope="module")
def pushed(server, trainer):
    """The server after a live push of transformers' weights (it started on dummy ones)."""
    hf, _ = trainer
    client = WeightSyncClient(server.url, backend="gloo")
    client.init()
    client.push([(n, p.detach()) for n, p in hf.named_parameters()], packed=True)
    return OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)


def check(hf, prompt_ids: list[int], output_ids: list[int], routes) -> None:
    tokens = prompt_ids + output_ids
    got = np.asarray(routes, dtype=np.int32)
    assert got.shape == (len(tokens) - 1, hf.config.num_hidden_layers, hf.config.num_experts_per_tok)
    want = hf_routes(hf, tokens[:-1])
    bad = np.argwhere((got != want).any(axis=(1, 2))).ravel().tolist()
    assert not bad, f"rows {bad} differ from transformers' top-k"


def test_completions_routes_equal_transformers_with_n_4_and_a_prefix_hit(pushed, trainer):
    hf, _ = trainer
    prompt = " ".join(f"t{i}" for i in (5, 17, 3, 99, 64, 12, 7, 80, 41, 120, 33, 9, 200, 18, 2, 77, 6, 150))
    for attempt in range(2):  # the second hits the prefix cache
        r = pushed.completions.create(model="m", prompt=prompt, max_tokens=8, n=4, temperature=1.0, seed=attempt,
                                      extra_body={"return_token_ids": True})
        if attempt:
            assert r.usage.prompt_tokens_details.cached_tokens >= 16
        assert len({tuple(c.token_ids) for c in r.choices}) > 1
        for c in r.choices:
            check(hf, c.prompt_token_ids, c.token_ids, c.model_extra["routed_experts"])
    off = pushed.completions.create(model="m", prompt=prompt, max_tokens=2,
                                    extra_body={"return_routed_experts": False})
    assert "routed_experts" in off.choices[0].model_extra and off.choices[0].model_extra["routed_experts"] is None


def test_chat_and_streams_carry_the_routes_with_the_final_chunk(pushed, trainer):
    hf, _ = trainer
    messages = [{"role": "user", "content": "t8 t19 t200 t4 t4 t90"}]
    r = pushed.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True})
    check(hf, r.model_extra["prompt_token_ids"], r.choices[0].token_ids, r.choices[0].model_extra["routed_experts"])
    chunks = list(pushed.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    with_routes = [c for c in chunks if c.choices and (c.choices[0].model_extra or {}).get("routed_experts")]
    assert len(with_routes) == 1 and with_routes[0].choices[0].finish_reason is not None
    assert with_routes[0].choices[0].model_extra["routed_experts"] == r.choices[0].model_extra["routed_experts"]
    stream = list(pushed.completions.create(model="m", prompt="t8 t19 t200", max_tokens=5, temperature=0,
                                            stream=True, extra_body={"return_token_ids": True}))
    routes = [(c.choices[0].model_extra or {}).get("routed_experts") for c in stream if c.choices]
    assert all(x is None for x in routes[:-1]) and routes[-1] is not None
    prompt_ids = next(c.choices[0].prompt_token_ids for c in stream if c.choices and c.choices[0].prompt_token_ids)
    check(hf, prompt_ids, [t for c in stream if c.choices for t in (c.choices[0].token_ids or [])], routes[-1])


def test_dense_model_starts_with_the_flag_and_refuses_the_field(servers):
    srv = servers["dense"]
    assert "no mixture-of-experts layers" in srv.log.read_text()
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0)
    r = client.completions.create(model="m", prompt="Hello", max_tokens=2)
    assert r.choices[0].model_extra["routed_experts"] is None
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model="m", prompt="Hello", max_tokens=2,
                                  extra_body={"return_routed_experts": True})
    assert e.value.body["param"] == "return_routed_experts" and "mixture-of-experts" in e.value.body["message"]
    chat = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json=dict(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, return_routed_experts=True))
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "return_routed_experts"


def test_routes_json_text_is_the_nested_lists():
    """The fast encoding (fixed-width ids, spliced into the body) parses to vLLM's lists."""
    from rlserve.server.responses import CompletionChoice
    from rlserve.server.routes_json import RoutesJSON, splice
    g = np.random.default_rng(0)
    cases = [(shape, -1, 300) for shape in [(0, 3, 2), (1, 1, 1), (5, 3, 2), (40, 4, 8)]]
    cases += [((7, 3, 4), 990, 1200), ((7, 3, 4), -5, 9_000_000), ((3, 2, 2), 0, 2**31 - 1)]  # wider words
    for shape, lo, hi in cases:
        routes = g.integers(lo, hi, shape).astype(np.int32)
        choice = CompletionChoice(index=0, text="\x00 a text with a NUL")
        choice.routed_experts = RoutesJSON(routes)
        body = json.loads(splice(choice.model_dump_json()))
        assert body["routed_experts"] == routes.tolist() and body["text"] == "\x00 a text with a NUL"


def test_data_parallel_replicas_return_their_routes(trainer, servers):
    """Two replicas, each with its own route store: whichever serves a request returns its rows."""
    from helpers.data_parallel import complete_all, routed
    hf, _ = trainer
    srv = servers["dp"]
    prompts = [" ".join(f"t{(7 * i + j) % 250 + 2}" for j in range(5 + i)) for i in range(6)]
    out = complete_all(srv.url, prompts, max_tokens=6)
    assert len(routed(srv.url)) == 2 and all(n > 0 for n in routed(srv.url).values())
    for prompt in prompts:
        choice = out[prompt]["choices"][0]
        check(hf, choice["prompt_token_ids"], choice["token_ids"], choice["routed_experts"])
