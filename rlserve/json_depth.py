"""JSON carried inside a request as text (a schema, tool-call arguments, a model's own tool
call) is parsed only when its nesting is bounded: Python's parser, and what reads the result
afterwards (chat templates, xgrammar), recurse once per level, and a few thousand `[` end in
a RecursionError."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_JSON_DEPTH = 128  # real schemas and arguments nest a few tens of levels at most
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


class JSONTooDeepError(ValueError):
    """A ValueError, so that code which treats bad JSON as bad input treats this so too."""


def json_depth(text: str) -> int:
    """How deep `text`'s arrays and objects nest (brackets inside strings do not count)."""
    if text.count("[") + text.count("{") <= 1:
        return text.count("[") + text.count("{")
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def check_json_depth(text: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise JSONTooDeepError when `text` nests deeper than `max_depth`."""
    if text.count("[") + text.count("{") > max_depth and json_depth(text) > max_depth:
        raise JSONTooDeepError(f"nested deeper than {max_depth} levels (the limit)")


def loads(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads, refusing (JSONTooDeepError) text nested deeper than `max_depth`."""
    check_json_depth(text, max_depth)
    return json.loads(text)
