"""tool_choice "required", streamed as vLLM streams it: the grammar makes the text a JSON
array of {"name": ..., "parameters": {...}}; each call goes out as it is generated, its
name once the name is whole, then its arguments (the raw text of "parameters") a piece at
a time. A stream cut by max_tokens has sent the calls so far, the last one's arguments
unfinished, as a named call's are.

The text is scanned once, a character at a time, keeping only the JSON state that finds
the two keys of each element: the depth, whether inside a string, escapes."""

from __future__ import annotations

import json
from typing import NamedTuple


class CallPiece(NamedTuple):
    call: int  # which call of the array
    name: str | None  # set in a call's first piece
    arguments: str


class RequiredCallsStream:
    def __init__(self) -> None:
        self._depth = 0  # 1: in the array, 2: in a call, 3+: in its parameters
        self._in_string = self._escaped = False
        self._literal = ""  # the string being read at depth 2 (a key or the name)
        self._key: str | None = None  # the key read last at depth 2, its value not yet read
        self._in_arguments = False
        self._calls = 0
        self._named = False  # the current call's name was sent
        self._held = ""  # arguments written before the name (not in the grammar's order)

    def feed(self, text: str) -> list[CallPiece]:
        out: list[CallPiece] = []
        for ch in text:
            self._char(ch, out)
        return out

    def _char(self, ch: str, out: list[CallPiece]) -> None:
        if self._in_arguments:
            self._argument(ch, out)
        if self._in_string:
            if self._depth == 2:
                self._literal += ch
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 2:
                    self._string_read(out)
            return
        if ch == '"':
            self._in_string, self._literal = True, '"'
        elif ch in "[{":
            self._depth += 1
            if self._depth == 2:  # a new call
                self._calls += 1
                self._named, self._held, self._key = False, "", None
            elif self._depth == 3 and self._key == "parameters":
                self._key, self._in_arguments = None, True
                self._argument(ch, out)
        elif ch in "]}":
            self._depth -= 1
            if self._depth == 2:
                self._in_arguments = False

    def _string_read(self, out: list[CallPiece]) -> None:
        try:
            value = json.loads(self._literal)
        except ValueError:
            return
        if self._key is None:
            self._key = value
            return
        if self._key == "name" and not self._named and isinstance(value, str):
            self._named = True
            out.append(CallPiece(self._calls - 1, value, self._held))
            self._held = ""
        self._key = None

    def _argument(self, ch: str, out: list[CallPiece]) -> None:
        if not self._named:
            self._held += ch
        elif out and out[-1].call == self._calls - 1:
            out[-1] = out[-1]._replace(arguments=out[-1].arguments + ch)
        else:
            out.append(CallPiece(self._calls - 1, None, ch))
