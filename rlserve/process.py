"""Child processes that never outlive their parent.

The API server starts the engine-core process, which starts one process per further
tensor-parallel rank. Whatever kills a parent (SIGKILL included), its children must go
too: Linux's parent-death signal fires at once, and a watch thread covers the case
where the parent died before the child could arm it.

Also here: a process's loop profiled on request (`profiled`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from typing import Iterator

try:  # loaded here, not in a forked child, where loading a library is unsafe
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except OSError:
    _prctl = None

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: this process gets `sig` when its parent exits (a Popen preexec_fn)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, sig)


def watch_parent(parent: int, exit_code: int = 1, interval_s: float = 1.0) -> None:
    """Exit at once when the process `parent` is no longer this one's parent, even while
    the main thread is blocked (in a collective, say)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(exit_code)

    threading.Thread(target=watch, name="rlserve-parent-watch", daemon=True).start()


@contextlib.contextmanager
def profiled(path: str | None) -> Iterator[None]:
    """A cProfile of what runs inside, written to `path` when it ends; nothing without a
    path (RLSERVE_ENGINE_PROFILE and RLSERVE_API_PROFILE give one)."""
    if not path:
        yield
        return
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        profiler.dump_stats(path)
