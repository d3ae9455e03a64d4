"""A vLLM user's requests mean the same here (issue 17), over HTTP against real servers:
every request field works or is refused with a 400 naming it; penalties, logit bias,
allow-lists and bad words sample what their definitions say (checked against torch on the
model's logits); prompt_logprobs in vLLM's shape; structured outputs and tool calls;
metrics under vLLM's names; generation-config defaults and vllm serve's flags."""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from helpers.sampling_reference import check_sample, model_logits
from helpers.servers import start_server, start_side_by_side, start_tiny_server, stop_server
from rlserve import SamplingParams
from rlserve.frontend.bad_words import convert_bad_words
from rlserve.sequence import TokenLogprob
from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest
from rlserve.server.token_strings import LOGPROB_FLOOR

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]

# A chat template in Qwen2.5's manner: tools in the system turn, tool calls and tool
# results in the conversation, reasoning in <think>.
TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{%- if message.reasoning_content %}
<think>{{ message.reasoning_content }}</think>
{%- endif %}
{%- if message.content %}
{{ message.content }}
{%- endif %}
{%- for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "[A-Za-z]{1,12}"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "The user wants the weather.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "[A-Z][a-z]{1,9}"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}

def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=300, **kw)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def error_param(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] and err["param"].split(".")[0] in err["message"], err
    return err["param"]


def openai_client(server):
    from openai import OpenAI
    return OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "EMPTY", max_retries=0,
                  timeout=300)


@pytest.fixture(scope="module")
def servers(demo_model, tmp_path_factory):
    """The module's three servers, started side by side at its first test that needs one.

    "tiny": a two-layer dummy model with the tool template, started with flags vllm serve
    command lines of RL scripts pass. "processed": the demo model with processed logprobs
    (the logprobs of what was sampled from). "configured": a model folder's
    generation_config.json given as --generation-config PATH, with --max-logprobs and
    --return-tokens-as-token-ids."""
    folder = tmp_path_factory.mktemp("genconfig")
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_k": 5, "max_new_tokens": 4, "do_sample": True}))
    started = start_side_by_side(
        partial(start_tiny_server, tmp_path_factory.mktemp("tiny") / "server.log", "--chat-template", TOOL_TEMPLATE,
                "--enable-sleep-mode", "--disable-log-requests", "--disable-log-stats",
                "--uvicorn-log-level", "warning", "--enable-auto-tool-choice",
                "--tool-call-parser", "hermes", "--disable-custom-all-reduce",
                "--enable-chunked-prefill"),
        partial(start_server, demo_model, tmp_path_factory.mktemp("processed") / "server.log",
                "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"),
        partial(start_tiny_server, folder / "server.log", "--generation-config", str(folder), "--max-logprobs", "3",
                "--return-tokens-as-token-ids"))
    yield dict(zip(("tiny", "processed", "configured"), started))
    for srv in started:
        stop_server(srv)


@pytest.fixture(scope="module")
def tiny(servers):
    return servers["tiny"]


@pytest.fixture(scope="module")
def tokenizer(demo_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(demo_model)


# ---------------------------------------------------------------- every field works or is refused

# Fields of vLLM's CompletionRequest and ChatCompletionRequest, each with a value that asks
# for something. Fields rlserve implements are tested elsewhere; every other must be refused.
VLLM_FIELDS = {
    "use_beam_search": True, "length_penalty": 0.5, "early_stopping": True, "watermarking": True,
    "spaces_between_special_tokens": False, "truncation_side": "right",
    "logits_processors": ["m.P"], "priority": 1, "session_id": "s",
    "return_token_offsets": True, "return_mm_kwargs": False, "kv_transfer_params": {"a": 1},
    "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "repetition_detection": {"n": 3},
    "thinking_token_budget": 10, "stream_interval": 4, "routed_experts_prompt_start": 2,
    "structural_tag": "{}", "guided_whitespace_pattern": " ", "guided_decoding_backend": "outlines",
}
COMPLETION_ONLY = {"prompt_embeds": "AAAA"}
CHAT_ONLY = {
    "best_of": 2, "echo": True, "chat_template": "{{ messages }}", "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"a": 1}, "reasoning_effort": "low",
    "return_prompt_text": True, "functions": [{"name": "f"}], "function_call": "auto",
    "audio": {"voice": "x"}, "modalities": ["audio"], "prediction": {"type": "content"},
    "store": True, "metadata": {"a": "b"}, "service_tier": "flex", "web_search_options": {},
    "verbosity": "low", "prompt_cache_key": "k", "safety_identifier": "u",
}


def test_every_vllm_field_rlserve_lacks_is_refused_naming_it(tiny):
    for endpoint, base, fields, model in (
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, {**VLLM_FIELDS, **COMPLETION_ONLY},
             CompletionRequest),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}, {**VLLM_FIELDS, **CHAT_ONLY},
             ChatCompletionRequest)):
        for name, value in fields.items():
            assert name not in model.model_fields, name
            r = post(tiny, endpoint, {**base, name: value})
            assert error_param(r) == name, (endpoint, name)
            assert "not supported" in r.json()["error"]["message"]
    # Nested objects too.
    r = post(tiny, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "stream": True,
                                       "stream_options": {"include_obfuscation": True}})
    assert error_param(r) == "stream_options" and "include_obfuscation" in r.json()["error"]["message"]
    r = post(tiny, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                       "structured_outputs": {"regex": "a", "whitespace_pattern": " "}})
    assert error_param(r) == "structured_outputs" and "whitespace_pattern" in r.json()["error"]["message"]


def test_neutral_values_of_unimplemented_fields_are_accepted(tiny):
    """What scripts written for vLLM send explicitly while asking for nothing."""
    body = {"prompt": PROMPT, "max_tokens": 2, "use_beam_search": False, "length_penalty": 1.0,
            "priority": 0, "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
            "guided_decoding_backend": "xgrammar", "bad_words": [], "stop_token_ids": []}
    ok(post(tiny, "/v1/completions", body))
    chat = {"messages": [*CHAT, {"role": "assistant", "content": "Red.", "refusal": None, "annotations": [],
                                  "audio": None, "function_call": None}, {"role": "user", "content": "More?"}],
            "max_tokens": 2, "echo": False, "include_reasoning": True, "store": False, "service_tier": "auto",
            "modalities": ["text"]}
    ok(post(tiny, "/v1/chat/completions", chat))


def test_unknown_fields_are_refused(tiny):
    for endpoint, body in (("/v1/completions", {"prompt": PROMPT, "temprature": 0.5}),
                           ("/v1/chat/completions", {"messages": CHAT, "max_token": 3})):
        r = post(tiny, endpoint, body)
        param = error_param(r)
        assert param in body and "unknown field" in r.json()["error"]["message"]
    r = post(tiny, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "mood": "x"}]})
    assert error_param(r) == "messages" and "messages.0.mood" in r.json()["error"]["message"]


def test_openai_client_requests_are_accepted(tiny):
    """The official client sends only the fields it is given, plus extra_body."""
    client = openai_client(tiny)
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0.5, top_p=0.9, n=2,
                                  stop=["\n"], seed=3, presence_penalty=0.5, frequency_penalty=0.5,
                                  logit_bias={"11": 2.0}, logprobs=2, user="u",
                                  extra_body={"repetition_penalty": 1.1, "top_k": 5, "use_beam_search": False})
    assert len(r.choices) == 2
    r = client.chat.completions.create(model="m", messages=CHAT, max_completion_tokens=2, logprobs=True,
                                       top_logprobs=1, stream=False, parallel_tool_calls=True,
                                       extra_body={"min_p": 0.1, "bad_words": ["red"]})
    assert r.choices[0].message.role == "assistant"


def test_request_id_names_the_response(tiny):
    assert ok(post(tiny, "/v1/completions",
                   {"prompt": PROMPT, "max_tokens": 1, "request_id": "abc"}))["id"] == "cmpl-abc"
    r = ok(post(tiny, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "request_id": "abc"}))
    assert r["id"] == "chatcmpl-abc"


def test_bad_sampling_values_name_the_field(tiny):
    cases = [
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ]
    for extra, param in cases:
        r = post(tiny, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **extra})
        assert error_param(r) == param, (extra, r.text)
    chat_cases = [
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": []}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]}, "messages"),
    ]
    for extra, param in chat_cases:
        r = post(tiny, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **extra})
        assert error_param(r) == param, (extra, r.text)


# ---------------------------------------------------------------- penalties, bias, masks: as defined


@pytest.fixture(scope="module")
def processed(servers):
    return servers["processed"]


@pytest.fixture(scope="module")
def hf(demo_model):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()


def _token_id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token[len("token_id:"):])


def _inf(logprob: float) -> float:
    """JSON has no -inf: a masked token's logprob is sent as the floor."""
    return -math.inf if logprob <= LOGPROB_FLOOR else logprob


def _completion_sample(choice: dict, k: int):
    """A choice's tokens and logprobs as the engine's CompletionOutput carries them. Each
    position's top_logprobs lists the chosen token first (vLLM's order): the k alternatives
    are its k largest."""
    lp = choice["logprobs"]
    logprobs = [TokenLogprob(_token_id(t), _inf(v), 0, tuple((_token_id(a), _inf(b)) for a, b in
                                                             sorted(top.items(), key=lambda kv: -kv[1])[:k]))
                for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]
    return _Sample(choice["token_ids"], logprobs)


def _chat_sample(choice: dict):
    logprobs = [TokenLogprob(_token_id(c["token"]), _inf(c["logprob"]), 0,
                             tuple((_token_id(t["token"]), _inf(t["logprob"])) for t in c["top_logprobs"]))
                for c in choice["logprobs"]["content"]]
    return _Sample(choice["token_ids"], logprobs)


class _Sample:
    def __init__(self, token_ids, logprobs):
        self.token_ids, self.logprobs = token_ids, logprobs


def test_penalties_bias_and_masks_sample_as_defined(processed, hf, tokenizer):
    """Each field, sent over HTTP, changes what is sampled from exactly as its definition
    says: every token's processed logprobs (the distribution sampled from) and top
    alternatives equal torch's computation on the model's logits for the same context.
    Seeded: the same noise as the unpenalized sample, so what changes is the field's doing."""
    prompt = tokenizer.encode(PROMPT)
    base = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": True,
            "logprobs": 5, "return_token_ids": True, "return_tokens_as_token_ids": True}
    plain = ok(post(processed, "/v1/completions", base))["choices"][0]
    o = plain["token_ids"]
    # Two words of that output (tokens that decode to letters).
    words = [w for w in (tokenizer.decode([t]).strip() for t in o) if w.isalpha()][:2]
    assert len(words) == 2, tokenizer.decode(o)
    cases = {
        "repetition > 1": dict(repetition_penalty=1.6),
        "repetition < 1": dict(repetition_penalty=0.6),
        "presence": dict(presence_penalty=1.8),
        "frequency": dict(frequency_penalty=2.0),
        "negative presence and frequency": dict(presence_penalty=-2.0, frequency_penalty=-2.0),
        "logit_bias": dict(logit_bias={str(o[0]): -100, str(o[4]): 7.5}),
        "allowed_token_ids": dict(allowed_token_ids=sorted(set(o[2:]))),
        "bad_words": dict(bad_words=words),
        "everything, greedy": dict(temperature=0, repetition_penalty=1.2, presence_penalty=0.5,
                                   logit_bias={str(o[1]): -5.0}, bad_words=words[:1]),
        "everything, sampled": dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=7,
                                    repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3,
                                    logit_bias={str(o[1]): -5.0}, bad_words=words[:1]),
    }
    for name, extra in cases.items():
        body = {**base, **extra}
        choice = ok(post(processed, "/v1/completions", body))["choices"][0]
        reference = _reference_params(body, tokenizer)
        sample = _completion_sample(choice, 5)
        check_sample(model_logits(hf, prompt, sample.token_ids), prompt, reference, sample, set(), True)
        if not name.startswith("everything"):  # the distribution sampled from moved
            assert (sample.token_ids, choice["logprobs"]["top_logprobs"]) != (o, plain["logprobs"]["top_logprobs"]), \
                f"{name} changed nothing"
    # The chat endpoint maps the same fields.
    chat = {"messages": CHAT, "max_tokens": 6, "temperature": 0.7, "seed": 1, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 5, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "presence_penalty": 1.5, "logit_bias": {str(o[0]): 3.0}, "repetition_penalty": 1.3}
    r = ok(post(processed, "/v1/chat/completions", chat))
    ids = r["prompt_token_ids"]
    sample = _chat_sample(r["choices"][0])
    check_sample(model_logits(hf, ids, sample.token_ids), ids, _reference_params(chat, tokenizer),
                 sample, set(), True)


def _reference_params(body: dict, tokenizer) -> SamplingParams:
    keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "logit_bias", "allowed_token_ids", "bad_words", "ignore_eos")
    p = SamplingParams(max_tokens=16, **{k: body[k] for k in keys if k in body})
    return convert_bad_words(p, tokenizer)


def test_raw_logprobs_stay_the_default(server, offline_llm, tokenizer):
    """Without --logprobs-mode, logprobs are the model's raw ones whatever the penalties."""
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0, "return_token_ids": True,
            "repetition_penalty": 1.5, "presence_penalty": 1.0, "logit_bias": {"11": 5}}
    choice = ok(post(server, "/v1/completions", body))["choices"][0]
    prompt = tokenizer.encode(PROMPT)
    ids = choice["token_ids"]
    out = offline_llm.generate([prompt + ids[:-1]], SamplingParams(max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)[0]
    raw = [lp.logprob for lp in out.prompt_logprobs[len(prompt):]] + [None]
    for got, want in zip(choice["logprobs"]["token_logprobs"][:-1], raw[:-1]):
        assert abs(got - want) < 1e-4


# ---------------------------------------------------------------- prompt_logprobs


def test_prompt_logprobs_in_vllms_shape(server, offline_llm, tokenizer):
    prompt = tokenizer.encode(PROMPT)
    ref = offline_llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3),
                               use_tqdm=False)[0].prompt_logprobs
    completion = ok(post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 2,
                                                     "prompt_logprobs": 3}))
    assert all(c["prompt_logprobs"] == completion["choices"][0]["prompt_logprobs"]
               for c in completion["choices"])
    got = completion["choices"][0]["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    for entry, want, token in zip(got[1:], ref[1:], prompt[1:]):
        assert str(token) in entry  # the prompt token itself, with its rank
        assert entry[str(token)]["rank"] == want.rank
        assert abs(entry[str(token)]["logprob"] - want.logprob) < 1e-4
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
        top = {str(t): v for t, v in want.top}
        assert set(top) <= set(entry) and len(entry) <= 4
        for t, v in top.items():
            assert abs(entry[t]["logprob"] - v) < 1e-4
        assert sorted(e["rank"] for t, e in entry.items() if t in top) == [1, 2, 3]
    chat = ok(post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0,
                                                    "return_token_ids": True}))
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"]) and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    # Not asked for: null, as vLLM sends it.
    assert ok(post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}))["prompt_logprobs"] is None


# ---------------------------------------------------------------- structured outputs


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


def _valid(text: str) -> bool:
    import jsonschema_rs
    try:
        return jsonschema_rs.is_valid(SCHEMA, json.loads(text))
    except ValueError:
        return False


def test_json_schema_outputs_parse_and_validate_for_20_seeds(server):
    """The demo model, response_format json_schema: 20 seeded samples per endpoint (sample i
    of n draws its own noise), every one parses and validates. The four requests are sent
    together, so the engine batches 40 grammars."""
    common = {"max_tokens": 60, "temperature": 0.8, "n": 10, "response_format": _json_schema_format(SCHEMA)}
    requests = [(path, dict(common, seed=seed, **body)) for seed in (0, 1) for path, body in (
        ("/v1/completions", {"prompt": "Describe a person as JSON:"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Describe a person as JSON."}]}))]
    with ThreadPoolExecutor(len(requests)) as pool:
        bodies = list(pool.map(lambda req: ok(post(server, *req)), requests))
    texts = [c["text"] if "text" in c else c["message"]["content"] for b in bodies for c in b["choices"]]
    assert len(texts) == 40
    assert all(_valid(t) for t in texts), [t for t in texts if not _valid(t)]


def test_choice_regex_and_json_always_match(tiny):
    """A random two-layer model, which would write anything: the grammar alone makes every
    sample match, through each of the names a request may use."""
    choices = ["Paris", "Rome", "Oslo"]
    regex = r"[A-Z][a-z]{2,8} is (hot|cold)\."
    compact = {"json": SCHEMA, "disable_any_whitespace": True}  # bounded: always finishes
    bodies = [
        ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
        ({"guided_choice": choices}, lambda t: t in choices),
        ({"structured_outputs": {"regex": regex}}, lambda t: re.fullmatch(regex, t) is not None),
        ({"guided_regex": regex}, lambda t: re.fullmatch(regex, t) is not None),
        ({"structured_outputs": compact}, _valid),
        ({"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "maybe"'}},
         lambda t: t in ("yes", "no", "maybe")),
    ]
    # json_object: any JSON object. Cheap here: a random model fills max_tokens with what
    # any JSON allows (whitespace, long strings), so only its start is checked.
    r = ok(post(tiny, "/v1/completions", {"prompt": "JSON:", "max_tokens": 6, "seed": 2, "n": 2,
                                          "response_format": {"type": "json_object"}}))
    for c in r["choices"]:
        assert c["text"].lstrip().startswith("{"), c
        assert c["finish_reason"] == "length" or isinstance(json.loads(c["text"]), dict), c
    for extra, matches in bodies:
        r = ok(post(tiny, "/v1/completions", {"prompt": "The city:", "max_tokens": 80, "temperature": 1.0,
                                              "seed": 1, "n": 4, **extra}))
        for c in r["choices"]:
            assert matches(c["text"]) and c["finish_reason"] == "stop", (extra, c)
        r = ok(post(tiny, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 80, "temperature": 1.0,
                                                   "seed": 1, "n": 2, **extra}))
        for c in r["choices"]:
            assert matches(c["message"]["content"]) and c["finish_reason"] == "stop", (extra, c)


# ---------------------------------------------------------------- stop strings and min_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_chat_text_is_the_detokenized_tokens_cut_at_a_matched_stop(tiny, tokenizer, stream):
    """Chat, every stop / min_tokens / include_stop_str_in_output combination: the content
    is the token ids decoded, cut only at a stop string matched after min_tokens tokens."""
    base = {"messages": CHAT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    ids = ok(post(tiny, "/v1/chat/completions", base))["choices"][0]["token_ids"]
    # Stop strings the greedy output holds: the text of its 2nd and 6th tokens.
    stops = [t for t in (tokenizer.decode([ids[1]]), tokenizer.decode([ids[5]])) if t.strip()]
    assert stops
    for min_tokens in (0, 3, 7):
        for include in (False, True):
            body = {**base, "stop": stops, "min_tokens": min_tokens, "include_stop_str_in_output": include,
                    "stream": stream}
            if stream:
                with httpx.stream("POST", f"{tiny.url}/v1/chat/completions", json=body, headers=tiny.headers,
                                  timeout=300) as r:
                    chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines()
                              if line.startswith("data: {")]
                text = "".join(c["delta"].get("content") or "" for c in chunks)
                got = [t for c in chunks for t in c.get("token_ids") or []]
                stop_reason = chunks[-1].get("stop_reason")
            else:
                choice = ok(post(tiny, "/v1/chat/completions", body))["choices"][0]
                text, got, stop_reason = choice["message"]["content"], choice["token_ids"], choice["stop_reason"]
            decoded = tokenizer.decode(got, skip_special_tokens=True)
            if stop_reason is None:
                assert text == decoded and got == ids, (min_tokens, include)
                continue
            start = len(tokenizer.decode(got[:min_tokens], skip_special_tokens=True))
            cut = min(i for i in (decoded.find(s, start) for s in stops) if i >= 0)
            assert decoded.startswith(stop_reason, cut)
            assert text == decoded[:cut + (len(stop_reason) if include else 0)], (min_tokens, include, text)
            assert len(got) > min_tokens and got == ids[:len(got)]


# ---------------------------------------------------------------- tools


def test_tool_history_reaches_the_chat_template(tiny, tokenizer):
    """Tool calls, tool results, reasoning and the tool definitions are rendered, as the
    template reads them (arguments as objects)."""
    r = ok(post(tiny, "/tokenize", {"messages": HISTORY, "tools": [WEATHER]}))
    text = tokenizer.decode(r["tokens"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response id="call_1">\n18 C, sunny\n</tool_response>' in text
    assert "<think>The user wants the weather.</think>" in text
    assert json.dumps(WEATHER) in text
    assert text.endswith("<|im_start|>assistant\n")
    # The chat endpoint renders the same prompt.
    chat = ok(post(tiny, "/v1/chat/completions", {"messages": HISTORY, "tools": [WEATHER], "max_tokens": 1,
                                                  "return_token_ids": True}))
    assert chat["prompt_token_ids"] == r["tokens"]
    # vLLM's newer name for reasoning_content reaches the template as it.
    renamed = [HISTORY[0], {**HISTORY[1], "reasoning": HISTORY[1]["reasoning_content"]}, HISTORY[2]]
    del renamed[1]["reasoning_content"]
    assert ok(post(tiny, "/tokenize", {"messages": renamed, "tools": [WEATHER]}))["tokens"] == r["tokens"]


def _tool_call_text(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def _literal_regex(text: str) -> str:
    """A regex matching exactly `text` (xgrammar's dialect: only metacharacters escaped)."""
    return re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", text).replace("\n", "\\n")


@pytest.mark.parametrize("stream", [False, True])
def test_qwen_format_tool_call_is_parsed_into_tool_calls(tiny, stream):
    """The model writes a Qwen-format tool call (a regex makes the dummy model write it);
    the response carries it as tool_calls, streamed or not, with finish_reason tool_calls."""
    text = "Let me check." + _tool_call_text("get_weather", {"city": "Paris"})
    body = dict(model="m", messages=HISTORY[:1], tools=[WEATHER], max_tokens=60, temperature=0,
                extra_body={"structured_outputs": {"regex": _literal_regex(text)}})
    client = openai_client(tiny)
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = choice.message.tool_calls
        content, finish = choice.message.content, choice.finish_reason
    else:
        content, calls, finish = _assemble(client.chat.completions.create(**body, stream=True))
    assert finish == "tool_calls"
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_") and calls[0].type == "function"


def _assemble(chunks):
    """A streamed choice as an OpenAI client assembles it."""
    from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageToolCall
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "type": d.type, "function": {"name": None, "arguments": ""}})
            call["function"]["name"] = call["function"]["name"] or d.function.name
            call["function"]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, [ChatCompletionMessageToolCall.model_validate(calls[i]) for i in sorted(calls)], finish


def test_named_tool_call_shapes_streamed_and_not(tiny):
    """tool_choice naming a function: the output is its call, in OpenAI's shapes; streamed
    arguments concatenate to the non-streamed ones (greedy, the same text)."""
    client = openai_client(tiny)
    body = dict(model="m", messages=HISTORY[:1], tools=[WEATHER, TIME], max_tokens=12, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    content, calls, finish = _assemble(client.chat.completions.create(**body, stream=True))
    assert content is None and [c.function.name for c in calls] == ["get_weather"]
    assert calls[0].function.arguments == call.function.arguments
    assert finish == whole.finish_reason


def test_named_and_required_tool_calls_are_valid_json(tiny):
    import jsonschema_rs
    client = openai_client(tiny)
    for seed in range(5):
        named = client.chat.completions.create(
            model="m", messages=HISTORY[:1], tools=[WEATHER, TIME], max_tokens=40, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
        args = json.loads(named.message.tool_calls[0].function.arguments)
        assert jsonschema_rs.is_valid(WEATHER["function"]["parameters"], args)
        required = client.chat.completions.create(
            model="m", messages=HISTORY[:1], tools=[WEATHER, TIME], max_tokens=200, temperature=1.0, seed=seed,
            tool_choice="required", parallel_tool_calls=seed % 2 == 0).choices[0]
        assert required.finish_reason == "tool_calls" and required.message.tool_calls
        for call in required.message.tool_calls:
            schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
            assert jsonschema_rs.is_valid(schema, json.loads(call.function.arguments))


# ---------------------------------------------------------------- metrics


def test_metrics_under_vllms_names_with_model_name(tiny):
    for _ in range(2):  # the second reads the first's blocks from the prefix cache
        ok(post(tiny, "/v1/completions", {"prompt": PROMPT * 8, "max_tokens": 3}))
    text = httpx.get(f"{tiny.url}/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
                 "rlserve_weight_version", "rlserve_weight_updates", "rlserve_weight_update_seconds",
                 "rlserve_kv_cache_capacity_tokens", "rlserve_client_disconnects"):
        assert name in families, name
    for family in families.values():
        assert family.samples, family.name
        if family.name == "vllm:cache_config_info":  # vLLM's labels: the cache's settings and the engine
            continue
        for s in family.samples:
            assert s.labels.get("model_name") == "m", (family.name, s)

    def value(name: str, **labels: str) -> float:
        return sum(s.value for f in families.values() for s in f.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("vllm:prefix_cache_hits_total") > 0
    assert value("vllm:prefix_cache_queries_total") >= value("vllm:prefix_cache_hits_total")
    assert value("vllm:request_success_total", finished_reason="length") >= 2
    assert value("vllm:request_generation_tokens_count") >= 2
    assert value("vllm:time_to_first_token_seconds_count") >= 2


# ---------------------------------------------------------------- generation config and flags


@pytest.fixture(scope="module")
def configured(servers):
    return servers["configured"]


def test_generation_config_defaults_and_limit(configured):
    body = {"prompt": PROMPT, "ignore_eos": True, "return_token_ids": True}
    first = ok(post(configured, "/v1/completions", {**body, "max_tokens": 10}))["choices"][0]
    assert len(first["token_ids"]) == 4  # max_new_tokens caps the request's max_tokens, as in vLLM
    again = ok(post(configured, "/v1/completions", {**body, "n": 3}))["choices"]
    assert all(c["token_ids"] == first["token_ids"] for c in again)  # temperature 0 by default
    sampled = ok(post(configured, "/v1/completions", {**body, "temperature": 1.0, "top_k": -1, "n": 6,
                                                      "seed": 3}))["choices"]
    assert len({tuple(c["token_ids"]) for c in sampled}) > 1  # the request's own fields win
    chat = ok(post(configured, "/v1/chat/completions", {"messages": CHAT, "ignore_eos": True}))
    assert chat["usage"]["completion_tokens"] == 4
    r = post(configured, "/v1/completions", {**body, "logprobs": 4})
    assert error_param(r) == "logprobs" and "--max-logprobs" in r.json()["error"]["message"]
    lp = ok(post(configured, "/v1/completions", {**body, "logprobs": 1}))["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"])


def test_generation_defaults_sources(tmp_path):
    from rlserve.server.generation_config import generation_defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 100, "eos_token_id": 7}))
    model = str(tmp_path)
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 100}
    assert generation_defaults("auto", model) == want
    assert generation_defaults(model, None) == want
    assert generation_defaults(str(tmp_path / "generation_config.json"), None) == want
    assert generation_defaults("vllm", model) == {}
    assert generation_defaults("auto", str(tmp_path / "none")) == {}
    assert generation_defaults("vllm", model, {"temperature": 0.5}) == {"temperature": 0.5}
    assert generation_defaults("auto", model, {"max_new_tokens": 8})["max_tokens"] == 8
    with pytest.raises(ValueError, match="generation-config"):
        generation_defaults(str(tmp_path / "missing"), None)
    with pytest.raises(ValueError, match="temperature"):
        generation_defaults("vllm", model, {"temperature": -1})


def test_vllm_serve_flags_are_accepted_and_unknown_ones_fail(capsys):
    from rlserve.cli import build_parser
    args = build_parser().parse_args([
        "serve", "m", "--enable-sleep-mode", "--disable-log-requests", "--disable-log-stats",
        "--uvicorn-log-level", "warning", "--max-logprobs", "5", "--generation-config", "vllm",
        "--override-generation-config", '{"temperature": 0.5}', "--logprobs-mode", "processed_logprobs",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--return-tokens-as-token-ids",
        "--enable-chunked-prefill", "--disable-custom-all-reduce"])
    assert args.enable_sleep_mode and args.max_logprobs == 5 and args.uvicorn_log_level == "warning"
    assert args.override_generation_config == {"temperature": 0.5}
    # vLLM's --max-logprobs takes any count, and -1 for no limit (the whole vocabulary).
    assert [build_parser().parse_args(["serve", "m", "--max-logprobs", n]).max_logprobs for n in ("50", "-1")] \
        == [50, -1]
    for bad in (["--no-such-flag"], ["--max-logprobs", "-2"], ["--tool-call-parser", "mistral"],
                ["--override-generation-config", "[1]"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", "m", *bad])
        assert e.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_sleep_mode_without_a_weight_transfer_backend(tiny, server):
    assert httpx.post(f"{server.url}/sleep", timeout=30).status_code == 404  # not enabled there
    assert httpx.post(f"{tiny.url}/sleep", params={"level": 1}, timeout=60).status_code == 200
    assert httpx.get(f"{tiny.url}/is_sleeping", timeout=30).json() == {"is_sleeping": True}
    with ThreadPoolExecutor(1) as pool:  # a request waits for the wake-up, then runs
        waiting = pool.submit(post, tiny, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert httpx.post(f"{tiny.url}/wake_up", timeout=60).status_code == 200
        assert ok(waiting.result())["choices"][0]["text"]
    assert httpx.get(f"{tiny.url}/is_sleeping", timeout=30).json() == {"is_sleeping": False}
    assert httpx.post(f"{tiny.url}/update_weights", json={"update_info": {}}, timeout=30).status_code == 404
