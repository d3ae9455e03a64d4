"""Bounds on what one HTTP request may ask of the server."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

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
