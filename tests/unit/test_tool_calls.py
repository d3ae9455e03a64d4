"""Tool calls in a model's text: the Hermes parser Qwen's format needs, streamed and whole,
and what each tool_choice makes of a choice's text (content, tool calls, deltas)."""

from __future__ import annotations

import json

import pytest

from rlserve.server.protocol import ChatCompletionRequest
from rlserve.server.structured import required_tools_schema
from rlserve.server.tool_calls import ChoiceToolCalls
from rlserve.server.tool_parsers import HermesToolParser, ParsedToolCall

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]

QWEN_TEXT = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_qwen_tool_calls_are_parsed_out_of_the_text():
    content, calls = HermesToolParser.extract(QWEN_TEXT)
    assert calls == [ParsedToolCall("get_weather", '{"city": "Paris"}'), ParsedToolCall("get_time", "{}")]
    assert content.strip() == "I will look both up."


@pytest.mark.parametrize("text, calls, content", [
    ("no tools here", [], "no tools here"),
    # not JSON: kept as written, nothing lost
    ("<tool_call>{not json}</tool_call>", [], "<tool_call>{not json}</tool_call>"),
    ('<tool_call>{"arguments": {}}</tool_call>', [], '<tool_call>{"arguments": {}}</tool_call>'),
    # the closing tag cut off (a stop string, max_tokens): a whole JSON object still counts
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', [ParsedToolCall("f", '{"a": 1}')], ""),
    ('<tool_call>\n{"name": "f", "argu', [], '<tool_call>\n{"name": "f", "argu'),
    # arguments as JSON text, or under `parameters`, or absent
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"é\\"}"}</tool_call>',
     [ParsedToolCall("f", '{"a": "é"}')], ""),
    ('<tool_call>{"name": "f", "parameters": {"b": [1, 2]}}</tool_call>', [ParsedToolCall("f", '{"b": [1, 2]}')], ""),
    ('<tool_call>{"name": "f"}</tool_call>', [ParsedToolCall("f", "{}")], ""),
    ("a < b and <tool_ is not a tag", [], "a < b and <tool_ is not a tag"),
])
def test_parser_edge_cases(text, calls, content):
    got_content, got_calls = HermesToolParser.extract(text)
    assert got_calls == calls
    assert got_content == content


@pytest.mark.parametrize("text", [QWEN_TEXT, "a < b <tool_c", "plain", '<tool_call>{"name": "f"}'])
def test_any_chunking_of_a_stream_gives_the_whole_result(text):
    """Content is released as soon as it cannot be the start of a tag, calls whole: every
    split of the text into two or three chunks gives the same content and calls."""
    whole = HermesToolParser.extract(text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            stream = HermesToolParser.stream()
            pieces = stream.feed(text[:i]) + stream.feed(text[i:j]) + stream.feed(text[j:]) + stream.finish()
            content = "".join(p for p in pieces if isinstance(p, str))
            assert (content, [p for p in pieces if not isinstance(p, str)]) == whole, (i, j)


def test_stream_never_shows_part_of_a_tag():
    stream = HermesToolParser.stream()
    assert stream.feed("Sure.<tool") == ["Sure."]
    assert stream.feed("_call>{\"name\": \"f\"") == []
    assert stream.feed(", \"arguments\": {}}</tool_call> done") == [ParsedToolCall("f", "{}"), " done"]


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "tools": TOOLS, **kw})


def _streamed(calls: ChoiceToolCalls, text: str, chunk: int) -> tuple[str, list[dict]]:
    """Feed `text` in chunks as the chat stream does; assemble content and tool calls the
    way an OpenAI client does (arguments of one index concatenate)."""
    content, assembled = "", {}
    for start in range(0, len(text), chunk):
        piece = text[start:start + chunk]
        c, deltas = calls.stream(piece, start + chunk >= len(text))
        content += c
        for d in deltas:
            call = assembled.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] = call["name"] or d.function.name
            call["arguments"] += d.function.arguments or ""
    return content, [assembled[i] for i in sorted(assembled)]


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_auto_streamed_equals_whole(chunk):
    content, calls = ChoiceToolCalls(_request()).whole(QWEN_TEXT)
    assert content == "I will look both up." and [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2
    s = ChoiceToolCalls(_request())
    streamed_content, streamed = _streamed(s, QWEN_TEXT, chunk)
    assert s.called
    assert streamed_content.strip() == content
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    assert all(c["id"].startswith("call_") for c in streamed)


def test_parallel_tool_calls_false_keeps_the_first():
    _, calls = ChoiceToolCalls(_request(parallel_tool_calls=False)).whole(QWEN_TEXT)
    assert [c.function.name for c in calls] == ["get_weather"]
    _, streamed = _streamed(ChoiceToolCalls(_request(parallel_tool_calls=False)), QWEN_TEXT, 5)
    assert [c["name"] for c in streamed] == ["get_weather"]


def test_named_function_text_is_its_arguments():
    req = _request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    args = '{"city": "Rome"}'
    content, calls = ChoiceToolCalls(req).whole(args)
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", args)]
    content, streamed = _streamed(ChoiceToolCalls(req), args, 4)
    assert content == "" and streamed[0]["name"] == "get_weather" and streamed[0]["arguments"] == args


def test_required_text_is_an_array_of_calls():
    req = _request(tool_choice="required")
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    content, calls = ChoiceToolCalls(req).whole(text)
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    content, streamed = _streamed(ChoiceToolCalls(req), text, 6)
    assert content == "" and [c["name"] for c in streamed] == ["get_weather", "get_time"]
    # Output the grammar would not have allowed (no grammar, or cut by max_tokens): content.
    assert ChoiceToolCalls(req).whole('[{"name": "get_we') == ('[{"name": "get_we', [])


def test_no_tools_or_none_leave_the_text_alone():
    plain = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert ChoiceToolCalls(plain).whole(QWEN_TEXT) == (QWEN_TEXT, [])
    assert ChoiceToolCalls(_request(tool_choice="none")).stream(QWEN_TEXT, True) == (QWEN_TEXT, [])


def test_required_schema_names_each_tool_and_its_parameters():
    req = _request(tool_choice="required")
    schema = required_tools_schema(req.tools, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    variants = schema["items"]["anyOf"]
    assert [v["properties"]["name"]["enum"] for v in variants] == [["get_weather"], ["get_time"]]
    assert variants[0]["properties"]["parameters"] == TOOLS[0]["function"]["parameters"]
    assert variants[1]["properties"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_required_streams_each_call_as_it_is_generated(chunk):
    """As vLLM streams it: a call's name as soon as it is whole, then its arguments in
    pieces, long before the array closes; the pieces concatenate to the arguments."""
    req = _request(tool_choice="required")
    text = ('[{"name": "get_weather", "parameters": {"city": "Oslo \\"N\\""}},\n'
            ' {"name": "get_time", "parameters": {"zone": "UTC"}}]')
    _, whole = ChoiceToolCalls(req).whole(text)
    content, streamed = _streamed(ChoiceToolCalls(req), text, chunk)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole]
    # The first call is out, name and arguments, before the second one's text is read.
    calls = ChoiceToolCalls(req)
    cut = text.index('{"zone"')
    _, deltas = calls.stream(text[:cut], False)
    assert deltas[0].function.name == "get_weather" and deltas[1].function.name == "get_time"
    assert json.loads("".join(d.function.arguments or "" for d in deltas if d.index == 0)) == {"city": 'Oslo "N"'}


def test_required_cut_by_max_tokens_has_sent_the_call_so_far():
    calls = ChoiceToolCalls(_request(tool_choice="required"))
    content, deltas = calls.stream('[{"name": "get_weather", "parameters": {"ci', True)
    assert content == "" and calls.called
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("get_weather", '{"ci')]
    single = ChoiceToolCalls(_request(tool_choice="required", parallel_tool_calls=False))
    _, deltas = single.stream('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {}}]',
                              True)
    assert {d.index for d in deltas} == {0}
