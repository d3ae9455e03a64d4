"""A choice's routed_experts as JSON text, fast: vLLM's nested lists of ints, written by numpy.

A 2,000-token completion of Qwen3-30B-A3B has 2,000 x 48 x 8 = 768,000 expert ids. As Python
lists through pydantic that costs hundreds of milliseconds of the API server's loop. Here
every id becomes one machine word of text: its digits right-aligned in the word (JSON allows
the spaces that pad them) and then its separator, `" 17,"` or `" 17]"` for a layer's last.
Each layer's row starts with one more word holding the brackets and comma before it. The
text is then one gather of words from a small table per id, a few milliseconds.

Pydantic cannot emit raw JSON, so the field holds a RoutesJSON, which serializes to a short
marker: a per-process random nonce around the object's key. `splice` puts each text in its
marker's place after the model is dumped, so pydantic never escapes the text. A request
cannot forge a marker: the nonce is never sent.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import weakref
from typing import Annotated, Any

import numpy as np
from pydantic import PlainSerializer

_NONCE = os.urandom(12).hex()
# A marker as pydantic writes it inside the JSON text (the NUL escaped): quote, NUL, nonce, key.
_OPEN_JSON = f'"\\u0000{_NONCE}:'
_CLOSE_JSON = '"'
_MAX_SPAN = 1 << 16  # ids spread wider than this (never expert ids) take json.dumps


class _Scratch(threading.local):
    """Buffers kept between calls, per thread: fresh multi-megabyte arrays cost a page fault
    every 4 KB on first touch, more than the gathers that fill them."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, n: int, dtype: np.dtype) -> np.ndarray:
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.size < n:
            buf = self.buffers[name] = np.empty(n, dtype)
        return buf[:n]


_SCRATCH = _Scratch()


def _words(values: range, width: int, sep: str, dtype: np.dtype) -> np.ndarray:
    return np.frombuffer("".join(f"{v:>{width}}{sep}" for v in values).encode(), dtype)


def encode(routes: np.ndarray) -> str:
    """`routes` ([tokens, layers, k] ints) as the JSON text of the nested lists."""
    t, layers, k = routes.shape
    if t == 0 or layers == 0 or k == 0:
        return json.dumps(routes.tolist(), separators=(",", ":"))
    lo, hi = int(routes.min()), int(routes.max())
    digits = max(len(str(lo)), len(str(hi)))
    size = 4 if digits < 4 else 8
    if digits >= 8 or hi - lo > _MAX_SPAN:
        return json.dumps(routes.tolist(), separators=(",", ":"))
    dtype = np.dtype(f"u{size}")
    ids = range(lo, hi + 1)
    mid, last = _words(ids, size - 1, ",", dtype), _words(ids, size - 1, "]", dtype)
    # Before a layer's ids: the array's, the token's and the layer's "[" (first token), the last
    # token's "]" and "," (a later token's first layer), or the "," between layers.
    first, token, layer = (np.frombuffer(s.rjust(size).encode(), dtype)[0] for s in ("[[[", "],[[", ",["))
    index = routes - lo if lo else routes
    # Gathers into contiguous arrays, then one copy past the prefix words (numpy gathers
    # into a strided output several times slower).
    body = np.take(mid, index, mode="clip", out=_SCRATCH.get("body", t * layers * k, dtype).reshape(t, layers, k))
    body[..., -1] = np.take(last, index[..., -1], mode="clip")
    flat = _SCRATCH.get("flat", t * layers * (k + 1) + 1, dtype)  # and a last word: the closing "]]"
    words = flat[:-1].reshape(t, layers, k + 1)
    words[..., 1:] = body
    words[:, :, 0] = layer
    words[:, 0, 0] = token
    words[0, 0, 0] = first
    flat[-1] = np.frombuffer("]]".rjust(size).encode(), dtype)[0]
    return str(flat.data, "ascii")  # decoded from the buffer: no bytes copy


class RoutesJSON:
    """routed_experts already encoded; written into the body as they are by `splice`."""

    __slots__ = ("text", "key", "__weakref__")
    _keys = itertools.count()

    def __init__(self, routes: np.ndarray):
        self.text = encode(routes)
        self.key = next(self._keys)
        _LIVE[self.key] = self


# A dumped marker's object, for as long as some response still holds it.
_LIVE: weakref.WeakValueDictionary[int, RoutesJSON] = weakref.WeakValueDictionary()


def _marked(value: RoutesJSON) -> str:
    return f"\x00{_NONCE}:{value.key}"


# The field's type: null, or a RoutesJSON (nested lists of ints, as clients read it).
RoutesField = Annotated[Any, PlainSerializer(_marked, return_type=str, when_used="json-unless-none")] | None


def splice(body: str) -> str:
    """A dumped model's JSON with every RoutesJSON's text in place (a no-op without one)."""
    start = body.find(_OPEN_JSON)
    if start < 0:
        return body
    parts, pos = [], 0
    while start >= 0:
        key_at = start + len(_OPEN_JSON)
        end = body.index(_CLOSE_JSON, key_at)
        parts += [body[pos:start], _LIVE[int(body[key_at:end])].text]
        pos = end + len(_CLOSE_JSON)
        start = body.find(_OPEN_JSON, pos)
    parts.append(body[pos:])
    return "".join(parts)
