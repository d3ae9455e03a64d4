"""A choice's routed_experts written by numpy (rlserve/server/routes_json.py) parse as the
nested lists vLLM sends: any shape, the -1 of a dense layer, 512 experts; a text stays as it
was when later, larger or smaller, routes reuse the encoder's buffers, on any thread."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from rlserve.server.routes_json import encode


@pytest.mark.parametrize("shape,low,high", [((2000, 48, 8), 0, 128), ((7, 3, 2), -1, 8), ((300, 4, 10), 0, 512),
                                            ((1, 1, 1), 0, 1), ((0, 48, 8), 0, 128)])
def test_the_text_parses_as_the_nested_lists(shape, low, high):
    routes = np.random.default_rng(0).integers(low, high, shape).astype(np.int32)
    assert json.loads(encode(routes)) == routes.tolist()


def test_a_text_is_its_own_when_later_routes_reuse_the_buffers():
    rng = np.random.default_rng(1)
    first, second, third = (rng.integers(0, 128, (n, 48, 8)).astype(np.int32) for n in (500, 2000, 20))
    texts = [encode(first), encode(second), encode(third)]
    assert [json.loads(t) for t in texts] == [first.tolist(), second.tolist(), third.tolist()]


def test_threads_encode_side_by_side():
    rng = np.random.default_rng(2)
    routes = [rng.integers(-1, 64, (int(n), 8, 4)).astype(np.int32) for n in rng.integers(1, 400, 8)]
    texts: list[str | None] = [None] * len(routes)

    def work(i: int) -> None:
        for _ in range(20):
            texts[i] = encode(routes[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(routes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [json.loads(t) for t in texts if t is not None] == [r.tolist() for r in routes]
