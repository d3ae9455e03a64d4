"""Reasoning split from the answer (--reasoning-parser qwen3, deepseek_r1), served and
offline, on a tiny random Qwen3 with a chat template that writes <think>...</think>.

The random model's text is forced where a test needs a given one: a `structured_outputs`
choice makes the engine generate exactly that text, token by token, through the real
sampler and detokenizer; the stream then splits it wherever the tokens fall."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers.reasoning import THINK_TEMPLATE
from helpers.servers import RunningServer
from rlserve.frontend.reasoning_parsers import REASONING_PARSERS, ThinkStream, split_whole

CHAT = [{"role": "user", "content": "What is two plus two?"}]
THOUGHT = "\nTwo and two make four.\n"
ANSWER = "\n\nIt is four."
FORCED = f"<think>{THOUGHT}</think>{ANSWER}"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

@pytest.fixture
def server(flags_server: RunningServer) -> RunningServer:
    return flags_server


@pytest.fixture
def qwen3_dir(think_model: str) -> str:
    return think_model


def chat(server, **kw) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 40, **kw},
                   timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, **kw) -> list[dict]:
    chunks = []
    body = {"messages": CHAT, "max_tokens": 40, "stream": True, **kw}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


def joined(chunks: list[dict], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


def forced(text: str) -> dict:
    return {"structured_outputs": {"choice": [text]}, "temperature": 0}


# ---------------------------------------------------------------- the splitter itself


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text", [FORCED, THOUGHT + "</think>" + ANSWER, "<think>cut short", "no tags at all",
                                  "<thi", "a</thi", "<think></think>", FORCED + CALL])
def test_any_chunking_splits_as_the_whole_text(name, text):
    parser = REASONING_PARSERS[name]
    whole = parser.split("<|im_start|>assistant\n", None, False, text)
    for size in (1, 2, 3, 7):
        s = parser.stream("<|im_start|>assistant\n", None, False)
        pieces = [s.feed(text[i:i + size]) for i in range(0, len(text), size)] + [s.finish()]
        got = ("".join(p.reasoning for p in pieces) or None, "".join(p.content for p in pieces) or None)
        assert got == whole, (size, got, whole)


def test_split_rules():
    qwen3, r1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
    gen = "<|im_start|>assistant\n"
    assert qwen3.split(gen, None, False, FORCED) == (THOUGHT, ANSWER)
    # The template put <think> in the prompt: only </think> shows.
    assert r1.split(gen + "<think>\n", None, False, "Sum it.</think>Four.") == ("Sum it.", "Four.")
    # Cut short while thinking: all of it is reasoning.
    assert qwen3.split(gen, None, False, "Let me see") == ("Let me see", None)
    # The prompt closed the thinking; enable_thinking false (qwen3 only).
    assert qwen3.split(gen + "<think>\n\n</think>\n\n", None, False, "Four.") == (None, "Four.")
    assert qwen3.split(gen, {"enable_thinking": False}, False, "Four.") == (None, "Four.")
    assert r1.split(gen, {"enable_thinking": False}, False, "Hm.") == ("Hm.", None)
    # Under a grammar the output is reasoning only when it opens with <think>.
    assert qwen3.split(gen, None, True, '{"a": 1}') == (None, '{"a": 1}')
    assert qwen3.split(gen, None, True, FORCED) == (THOUGHT, ANSWER)
    assert split_whole(ThinkStream("content"), FORCED) == (None, FORCED)


# ---------------------------------------------------------------- served


def test_message_reasoning_and_content(server):
    out = chat(server, **forced(FORCED))
    message = out["choices"][0]["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == (THOUGHT, THOUGHT, ANSWER)
    assert out["choices"][0]["finish_reason"] == "stop"


def test_streamed_deltas_split_the_same_way(server):
    chunks = stream(server, **forced(FORCED))
    assert joined(chunks, "reasoning") == joined(chunks, "reasoning_content") == THOUGHT
    assert joined(chunks, "content") == ANSWER
    kinds = [k for c in chunks if c["choices"] for k in ("reasoning", "content")
             if c["choices"][0]["delta"].get(k)]
    assert kinds == sorted(kinds, key=("reasoning", "content").index), "reasoning comes first"


def test_include_reasoning_false_drops_it(server):
    message = chat(server, include_reasoning=False, **forced(FORCED))["choices"][0]["message"]
    assert message["reasoning"] is None and "reasoning_content" not in message
    assert message["content"] == ANSWER
    chunks = stream(server, include_reasoning=False, **forced(FORCED))
    assert joined(chunks, "reasoning") == "" and joined(chunks, "content") == ANSWER


def test_tool_calls_after_the_reasoning(server):
    text = f"<think>{THOUGHT}</think>\n\n{CALL}"
    out = chat(server, tools=[WEATHER], max_tokens=100, **forced(text))
    choice = out["choices"][0]
    assert choice["message"]["reasoning"] == THOUGHT and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == "tool_calls"
    chunks = stream(server, tools=[WEATHER], max_tokens=100, **forced(text))
    assert joined(chunks, "reasoning") == THOUGHT and joined(chunks, "content").strip() == ""
    calls = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls if c["function"].get("name")] == ["get_weather"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_unclosed_thinking_is_reasoning_and_enable_thinking_false_is_content(server):
    """Free (random) text: a text cut by max_tokens before </think> is all reasoning; with
    enable_thinking false the template closed the thinking, so it is all content."""
    out = chat(server, max_tokens=6, temperature=0, ignore_eos=True, bad_words=["</think>"])["choices"][0]
    assert out["message"]["content"] is None and out["message"]["reasoning"]
    off = chat(server, max_tokens=6, temperature=0, ignore_eos=True, chat_template_kwargs={"enable_thinking": False})
    message = off["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"]


def test_offline_chat_splits_reasoning(qwen3_dir):
    from rlserve import LLM, SamplingParams
    from rlserve.sampling_params import StructuredOutputsParams
    with LLM(qwen3_dir, device="cpu", dtype="float32", max_model_len=256,
             reasoning_parser="deepseek_r1") as llm:
        params = SamplingParams(max_tokens=40, temperature=0,
                                structured_outputs=StructuredOutputsParams(choice=[FORCED]))
        (out,) = llm.chat(CHAT, params, use_tqdm=False)
        sample = out.outputs[0]
        assert sample.text == FORCED and (sample.reasoning, sample.content) == (THOUGHT, ANSWER)
        # R1 reads no template variables, but the template's empty think block closed the thinking.
        (off,) = llm.chat(CHAT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False,
                          chat_template_kwargs={"enable_thinking": False})
        assert off.outputs[0].content == off.outputs[0].text and off.outputs[0].reasoning is None
    with pytest.raises(ValueError, match="reasoning_parser"):
        LLM(qwen3_dir, device="cpu", reasoning_parser="granite")


# ---------------------------------------------------------------- the rest of the command line
# The server above runs with VLLM_FLAGS: what each of them does here.


def test_root_path_serves_with_and_without_the_prefix(server):
    for prefix in ("", "/gateway"):
        r = httpx.get(f"{server.url}{prefix}/v1/models", timeout=60)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "q"
    schema = httpx.get(f"{server.url}/openapi.json", timeout=60).json()
    assert {"url": "/gateway"} in schema["servers"]


def test_force_include_usage_and_continuous_usage_stats(server):
    plain = stream(server, max_tokens=4, ignore_eos=True)  # no stream_options: usage all the same
    assert plain[-1]["choices"] == [] and plain[-1]["usage"]["completion_tokens"] == 4
    assert all("usage" not in c for c in plain[:-1])
    chunks = stream(server, max_tokens=4, ignore_eos=True,
                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    running = [c["usage"]["completion_tokens"] for c in chunks[1:-1]]
    assert running == sorted(running) and running[-1] == 4, running
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in chunks[1:])
    body = {"model": "q", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
        usages = [json.loads(line[6:]).get("usage") for line in r.iter_lines() if line.startswith("data: {")]
    # A chunk may carry two steps' tokens when the client reads late: the counts only grow.
    counts = [u["completion_tokens"] for u in usages]
    assert counts[:-1] == sorted(set(counts[:-1])) and counts[-2:] == [3, 3] and counts[0] >= 1, counts


def test_tokenizer_info_endpoint(server):
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=60).json()
    assert info["tokenizer_class"] and info["chat_template"] == THINK_TEMPLATE
    assert {"content": "<think>", "special": False} in info["added_tokens_decoder"].values()


def test_server_load_counts_requests_in_flight(server):
    """A request waits while the server sleeps: it is in flight until woken and answered."""
    def load() -> int:
        return httpx.get(f"{server.url}/load", timeout=60).json()["server_load"]

    def until(value: int) -> int:
        for _ in range(300):
            if (now := load()) == value:
                break
        return now

    assert load() == 0
    assert httpx.post(f"{server.url}/sleep", timeout=60).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        try:
            answer = pool.submit(chat, server, max_tokens=2)
            assert until(1) == 1
        finally:
            assert httpx.post(f"{server.url}/wake_up", timeout=60).status_code == 200
        assert answer.result()["usage"]["completion_tokens"] == 2
    assert until(0) == 0


def test_collective_rpc_says_what_to_use(server):
    r = httpx.post(f"{server.url}/collective_rpc", json={"method": "report_device_id"}, timeout=60)
    assert r.status_code == 501, r.text
    assert "worker extensions" in r.json()["error"]["message"] and "/update_weights" in r.json()["error"]["message"]


def test_accepted_flags_say_why_in_the_log(server):
    log = server.log.read_text()
    for name in ("--enable-prompt-tokens-details", "--enable-per-request-metrics",
                 "--show-hidden-metrics-for-version", "--structured-outputs-config.backend",
                 "--watermark-config"):
        assert f"{name}: accepted, nothing to do" in log, name
