"""A chat choice's text as content and tool calls, as the request's tool_choice says.

    none (or no tools)  the text is the content
    auto                tool calls are parsed out of the text (tool_parsers: Hermes)
    a named function    the text is that function's arguments (a grammar over its
                        parameters makes it valid JSON): one call, no content
    required            the text is a JSON array of {"name", "parameters"} (a grammar
                        makes it one): one call per element, no content

Output the grammar did not finish (cut short by max_tokens) is no call, as in vLLM: the
choice keeps the text as its content and finishes with "length". Streamed, a named call's
arguments, and each required call's name and arguments (required_calls.py), go out as they
are generated, as vLLM streams them, so a cut stream has sent part of them.

One `ChoiceToolCalls` per sample. `whole` gives a finished sample's message; `stream`
gives what a streamed chunk carries, as the text grows, in OpenAI's delta shape: a call's
first piece carries its id, type and name; its `arguments` pieces concatenate to the JSON.
"""

from __future__ import annotations

import json
import uuid

from rlserve import json_depth
from rlserve.server.protocol import ChatCompletionRequest, NamedToolChoice
from rlserve.server.required_calls import RequiredCallsStream
from rlserve.server.responses import DeltaFunctionCall, DeltaToolCall, FunctionCallOut, ToolCallOut
from rlserve.server.tool_parsers import TOOL_PARSERS, ParsedToolCall


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_choice_mode(body: ChatCompletionRequest) -> str:
    """none | auto | required | named: what the request asks of tool calls."""
    if not body.tools:
        return "none"
    choice = body.tool_choice or "auto"  # tools without a tool_choice: auto (OpenAI, vLLM)
    return "named" if isinstance(choice, NamedToolChoice) else choice


def _is_object(text: str) -> bool:
    try:
        return isinstance(json_depth.loads(text), dict)
    except ValueError:
        return False


def _required_calls(text: str) -> list[ParsedToolCall] | None:
    try:
        items = json_depth.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                and isinstance(item.get("parameters", {}), dict)):
            return None
        calls.append(ParsedToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
    return calls


class ChoiceToolCalls:
    def __init__(self, body: ChatCompletionRequest, parser: str = "hermes"):
        self.mode = tool_choice_mode(body)
        self.single = body.parallel_tool_calls is False
        choice = body.tool_choice
        self.name = choice.function.name if isinstance(choice, NamedToolChoice) else ""  # read in named mode alone
        self.parser = TOOL_PARSERS[parser]
        self._stream = self.parser.stream() if self.mode == "auto" else None
        self._required = RequiredCallsStream() if self.mode == "required" else None
        self._ids: list[str] = []  # of the calls streamed so far

    @property
    def called(self) -> bool:
        """A tool call was streamed (the choice's finish_reason is then tool_calls)."""
        return bool(self._ids)

    def whole(self, text: str) -> tuple[str | None, list[ToolCallOut]]:
        """A finished sample's (content, tool calls). With tool calls, content is None when
        only whitespace is left of it."""
        if self.mode == "none":
            return text, []
        calls: list[ParsedToolCall] | None
        if self.mode == "named":
            if not _is_object(text):  # cut short by max_tokens
                return text or None, []
            calls = [ParsedToolCall(self.name, text)]
            content = ""
        elif self.mode == "required":
            calls = _required_calls(text)
            if calls is None:  # not what the grammar allows (cut by max_tokens, or no grammar)
                return text, []
            content = ""
        else:
            content, calls = self.parser.extract(text)
            if not calls:
                return text, []
        calls = calls[:1] if self.single else calls
        return content.strip() or None, [
            ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in calls]

    def stream(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """What the next chunk carries for `text` (new since the last call); `final`: the
        sample ended with it, so nothing is held back any more."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            if not self._ids:
                self._ids.append(new_call_id())
                return "", [DeltaToolCall(index=0, id=self._ids[0], type="function",
                                          function=DeltaFunctionCall(name=self.name, arguments=text))]
            return "", [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))] if text else []
        if self._required is not None:
            return "", self._required_deltas(text)
        assert self._stream is not None  # auto, the mode left, has one
        pieces = self._stream.feed(text) + (self._stream.finish() if final else [])
        content = "".join(p for p in pieces if isinstance(p, str))
        return content, self._whole_calls([p for p in pieces if isinstance(p, ParsedToolCall)])

    def _required_deltas(self, text: str) -> list[DeltaToolCall]:
        assert self._required is not None
        out = []
        for piece in self._required.feed(text):
            if self.single and piece.call > 0:
                break
            if piece.name is not None:
                self._ids.append(new_call_id())
                out.append(DeltaToolCall(index=piece.call, id=self._ids[-1], type="function",
                                         function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments)))
            elif piece.arguments:
                out.append(DeltaToolCall(index=piece.call, function=DeltaFunctionCall(arguments=piece.arguments)))
        return out

    def _whole_calls(self, calls: list[ParsedToolCall]) -> list[DeltaToolCall]:
        out = []
        for call in calls:
            if self.single and self._ids:
                break
            self._ids.append(new_call_id())
            out.append(DeltaToolCall(index=len(self._ids) - 1, id=self._ids[-1], type="function",
                                     function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
        return out
