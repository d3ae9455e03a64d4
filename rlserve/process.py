"""Child processes: started one way (`spawn`), and never outliving their parent.

The API server starts the engine-core process (and further API servers), which starts
one process per further tensor-parallel rank; a Ray replica starts an engine, a test or
trainer a whole server. Whatever kills a parent (SIGKILL included), its children must go
too: Linux's parent-death signal fires at once, and a watch thread covers the case
where the parent died before the child could arm it.

What a child's environment gets beyond its parent's (envs.py has what rlserve reads):

    PYTHONPATH            this rlserve's folder first: the child runs the same rlserve,
                          installed or not
    CUDA_VISIBLE_DEVICES  `gpus=`: the GPUs Ray gave a replica
    OMP_NUM_THREADS       `threads=`: CPU engine replicas share the cores (more threads
                          than cores makes every one spin); one the user set is kept

Also here: a process's loop profiled on request (`profiled`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

_prctl: Callable[..., int] | None
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


# The folder holding the rlserve package this process runs.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spawn(module: str, *args: str, stdin: bytes | None = None, pass_fds: Sequence[int] = (),
          parent_death: int | None = signal.SIGTERM, new_session: bool = False,
          log: str | Path | None = None, env: Mapping[str, str] | None = None,
          gpus: Sequence[str] | None = None, threads: int | None = None) -> subprocess.Popen:
    """`python -m module *args` in a child process, with this interpreter and this rlserve.

    stdin: written to the child's stdin, which is then closed (how a child gets its
    configuration: msgpack, never argv). pass_fds: descriptors it inherits (sockets).
    parent_death: the signal it gets when this process dies (SIGKILL for children that
    ignore SIGTERM; None: it may outlive this one). new_session: its own process group, so
    that stopping the group stops everything it starts. log: its stdout and stderr go to
    this file (default: this process's). env, gpus, threads: its environment beyond this
    process's (see the module docstring)."""
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, child_env.get("PYTHONPATH")) if p)
    if gpus is not None:
        child_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    if threads is not None:
        child_env.setdefault("OMP_NUM_THREADS", str(threads))
    out = open(log, "w") if log is not None else None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], env=child_env, pass_fds=tuple(pass_fds),
            stdin=subprocess.PIPE if stdin is not None else None, stdout=out,
            stderr=subprocess.STDOUT if out is not None else None, start_new_session=new_session,
            preexec_fn=None if parent_death is None else functools.partial(die_with_parent, parent_death))
    finally:
        if out is not None:
            out.close()  # the child has its own copy
    if stdin is not None:
        assert proc.stdin is not None  # a pipe: stdin=PIPE above
        proc.stdin.write(stdin)
        proc.stdin.close()
    return proc


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
