"""Waiting on what a test can observe, never on the clock: a bounded loop that fails with
what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """predicate()'s first true value, polled every interval_s; an AssertionError naming
    `what` when none comes within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g}s: {what}")
        time.sleep(interval_s)
