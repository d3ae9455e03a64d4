"""A choice's routed_experts as JSON text, fast: vLLM's nested lists of ints, written by numpy.

A 2,000-token completion of Qwen3-30B-A3B has 2,000 x 48 x 8 = 768,000 expert ids. As Python
lists through pydantic that costs hundreds of milliseconds of the API server's loop; here
each id is written at a fixed width (JSON allows the spaces that pad it: `[  3,127, -1]`), so
the text is one array of bytes filled by whole-array arithmetic, a few milliseconds.

Pydantic cannot emit raw JSON, so the field holds a RoutesJSON, which serializes to a string
that carries the text between two markers of a per-process random nonce; `splice` turns
that string back into the bare text after the model is dumped. A request cannot forge a
marker: the nonce is never sent.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import numpy as np
from pydantic import PlainSerializer

_NONCE = os.urandom(12).hex()
# What the markers look like inside a JSON string, as pydantic escapes them.
_OPEN, _CLOSE = f"\x00{_NONCE}\x00", f"\x00{_NONCE}\x01"
_OPEN_JSON, _CLOSE_JSON = f'"\\u0000{_NONCE}\\u0000', f'\\u0000{_NONCE}\\u0001"'


def encode(routes: np.ndarray) -> str:
    """`routes` ([tokens, layers, k] ints) as the JSON text of the nested lists."""
    t, layers, k = routes.shape
    if t == 0:
        return "[]"
    lo, hi = int(routes.min()), int(routes.max())
    width = max(len(str(lo)), len(str(hi)))
    # Every id's fixed-width text, looked up: one gather writes all the digits.
    table = np.frombuffer("".join(str(v).rjust(width) for v in range(lo, hi + 1)).encode(), np.uint8)
    table = table.reshape(-1, width)
    # One token's row: "[" + per layer "[" + k x (id + "," or "]") + ("," or "]") + ",".
    layer = "[" + ("#" * width + ",") * (k - 1) + "#" * width + "]"
    row = np.frombuffer(("[" + ",".join([layer] * layers) + "],").encode(), np.uint8)
    flat = np.empty(1 + t * row.size, np.uint8)  # "[" + rows, the last row's "," made "]"
    flat[0] = ord("[")
    out = flat[1:].reshape(t, row.size)
    out[:] = row
    # The "#"s as one strided view [tokens, layers, k, width]; filled a digit column at a time
    # (byte gathers and strided byte stores, which numpy runs as tight loops).
    ids = np.lib.stride_tricks.as_strided(out.reshape(-1)[2:], (t, layers, k, width),
                                          (row.size, len(layer) + 1, width + 1, 1), writeable=True)
    index = (routes - lo).astype(np.intp)
    for c in range(width):
        ids[..., c] = table[:, c][index]
    flat[-1] = ord("]")
    return str(flat.data, "ascii")


class RoutesJSON:
    """routed_experts already encoded; written into the body as they are by `splice`."""

    __slots__ = ("text",)

    def __init__(self, routes: np.ndarray):
        self.text = encode(routes)


def _marked(value: RoutesJSON) -> str:
    return f"{_OPEN}{value.text}{_CLOSE}"


# The field's type: null, or a RoutesJSON (nested lists of ints, as clients read it).
RoutesField = Annotated[Any, PlainSerializer(_marked, return_type=str, when_used="json-unless-none")] | None


def splice(body: str) -> str:
    """A dumped model's JSON with every RoutesJSON's text in place (a no-op without one)."""
    if _OPEN_JSON not in body:
        return body
    return body.replace(_OPEN_JSON, "").replace(_CLOSE_JSON, "")
