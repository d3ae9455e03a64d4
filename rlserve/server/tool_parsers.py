"""Tool calls written in a model's text, parsed out of it.

The Hermes format, which Qwen2.5, Qwen3 and Hermes models write (vLLM's `hermes` parser):

    Some text.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A stream is parsed as it grows: text outside the tags is content, released as soon as it
cannot be the start of a tag; each tool call is released whole once its closing tag (or
the end of the text) arrives. A block that is not a JSON object with a `name` stays in the
content as written, so nothing the model wrote is lost. Parsing a whole text is parsing it
as one stream: streamed and non-streamed responses agree.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from rlserve import json_depth


class ParsedToolCall(NamedTuple):
    name: str
    arguments: str  # JSON text of an object


Piece = str | ParsedToolCall  # content text, or a whole tool call


def parse_call(text: str) -> ParsedToolCall | None:
    """`{"name": ..., "arguments": {...}}` (or `parameters`), else None."""
    try:
        obj = json_depth.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json_depth.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesStream:
    """One sample's text, fed as it grows; yields content and whole tool calls."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False  # after a START whose END has not come yet

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if not self._inside:
                i = self._buf.find(self.START)
                if i < 0:
                    keep = _partial_suffix(self._buf, self.START)
                    _content(out, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                _content(out, self._buf[:i])
                self._buf = self._buf[i + len(self.START):]
                self._inside = True
            else:
                j = self._buf.find(self.END)
                if j < 0:
                    return out
                body, self._buf = self._buf[:j], self._buf[j + len(self.END):]
                self._inside = False
                self._block(out, body, closed=True)

    def finish(self) -> list[Piece]:
        """The end of the text: what was held back. An unclosed last call still counts when
        its JSON is whole (a stop string may have cut the closing tag), as in vLLM."""
        out: list[Piece] = []
        if self._inside:
            self._block(out, self._buf, closed=False)
        else:
            _content(out, self._buf)
        self._buf, self._inside = "", False
        return out

    def _block(self, out: list[Piece], body: str, closed: bool) -> None:
        call = parse_call(body.strip())
        if call is not None:
            out.append(call)
        else:
            _content(out, self.START + body + (self.END if closed else ""))


def _content(out: list[Piece], text: str) -> None:
    if not text:
        return
    if out and isinstance(out[-1], str):
        out[-1] += text
    else:
        out.append(text)


class HermesToolParser:
    name = "hermes"

    @staticmethod
    def stream() -> HermesStream:
        return HermesStream()

    @staticmethod
    def extract(text: str) -> tuple[str, list[ParsedToolCall]]:
        """(content, tool calls) of a whole text; the content is the text outside the calls."""
        stream = HermesStream()
        pieces = stream.feed(text) + stream.finish()
        return ("".join(p for p in pieces if isinstance(p, str)),
                [p for p in pieces if isinstance(p, ParsedToolCall)])


TOOL_PARSERS = {"hermes": HermesToolParser}
