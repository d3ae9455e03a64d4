"""Bounds on what one HTTP request may ask of the server."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec

DEFAULT_MAX_BODY_BYTES = 64 << 20  # a few long prompts, or a large model's IPC handles
DEFAULT_MAX_PROMPTS = 2048  # prompts in one /v1/completions request
LARGE_TEXT_CHARS = 1 << 16  # text longer than this is tokenized off the event loop
BODY_JSON_DEPTH = 200  # pydantic-core's JSON parser refuses bodies nested deeper


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 before it is read
    (by its Content-Length), or as soon as the bytes pass the limit (chunked bodies), so one
    huge request cannot hold the server's memory or event loop."""

    def __init__(self, app: Callable, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None:
            try:
                too_big = int(length) > self.max_bytes
            except ValueError:
                too_big = False
            if too_big:
                await self._refuse(send)
                return
            await self.app(scope, receive, send)  # the server stops at the announced length
            return
        # No length announced (chunked): read up to the limit here, then hand it on.
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> dict[str, Any]:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Callable) -> None:
        body = json.dumps({"error": {
            "message": f"body: the request body is larger than the limit of {self.max_bytes} "
                       "bytes (--max-request-body-bytes)",
            "type": "invalid_request_error", "param": "body", "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def out_of_range_int(value: Any, where: str) -> str | None:
    """The path of the first integer in `value` (nested lists and objects) that does not
    fit 64 bits, or None. The engine's messages carry 64-bit integers: a larger one would
    fail there as an OverflowError, not as the caller's error. Walked without recursion."""
    stack = [(where, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            if not INT64_MIN <= item <= INT64_MAX:
                return path
        elif isinstance(item, dict):
            stack.extend((f"{path}.{k}", v) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(item))
    return None


_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_NINETEEN_DIGITS = b"0" * 19  # every integer below 10**18 fits 64 bits


def check_int_range(value: Any, where: str) -> None:
    """Raise InvalidRequestError naming the first integer in `value` beyond 64 bits.

    An IPC update of a per-expert MoE checkpoint is some 200,000 values, and a walk over
    them in Python took 300 ms, ten times the copy it announces. Only an integer of 19
    digits or more can be out of range, so the value is first encoded and searched for a
    run of 19 digits (both in C, a few ms); only a body with one (a string's digits count
    too) is walked, which names the offender or finds none."""
    from rlserve.sampling_params import InvalidRequestError
    if _NINETEEN_DIGITS not in msgspec.json.encode(value).translate(_DIGITS_TO_ZERO):
        return
    path = out_of_range_int(value, where)
    if path is not None:
        raise InvalidRequestError(f"{path}: must fit in 64 bits ({INT64_MIN}..{INT64_MAX})",
                                  where.split(".")[0])
