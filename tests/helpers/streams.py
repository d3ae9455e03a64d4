"""A streamed request held mid-way by a keep-pause, for the tests of what a pause spans."""

from __future__ import annotations

import re
import threading

import httpx
import pytest

from helpers.servers import stream_completion


def stream_frozen_mid_way(url: str, prompt: str) -> tuple[threading.Thread, list]:
    """A streamed request frozen by pause(keep) after its first token, still unfinished (the
    tiny model can finish 400 tokens before a pause sent by a busy test process lands: then
    the request is let finish and another one tried)."""
    for _ in range(5):
        results, progress = [None], [0]

        def freeze() -> None:  # from the stream's reader, after its first token
            assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=60).status_code == 200

        t = threading.Thread(target=stream_completion, args=(url, "m", prompt, 400, results, progress, 0,
                                                             (1, freeze)))
        t.start()
        while not paused(url) and t.is_alive():
            t.join(0.01)
        stats = httpx.get(f"{url}/metrics", timeout=30).text
        if re.search(r"^vllm:num_requests_(running|waiting)\{[^}]*\} [1-9]", stats, re.M):
            return t, results
        assert httpx.post(f"{url}/resume", timeout=60).status_code == 200
        t.join(120)
    pytest.fail("every request finished before its keep-pause landed")


def paused(url: str) -> bool:
    return httpx.get(f"{url}/is_paused", timeout=30).json()["is_paused"]
