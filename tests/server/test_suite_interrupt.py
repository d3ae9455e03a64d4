"""Ctrl-C stops the test suite promptly: KeyboardInterrupt reaches pytest while a test runs
against a server, the fixture's teardown stops that server, and no server is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

INNER = textwrap.dedent('''
    import sys
    import time
    import pytest
    sys.path.insert(0, TESTS)
    from helpers.servers import start_tiny_server, stop_server

    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        print("STARTING", flush=True)
        srv = start_tiny_server(tmp_path_factory.mktemp("s") / "server.log")
        print("SERVER-PID", srv.process.pid, flush=True)
        yield srv
        stop_server(srv)

    def test_a_long_one(server):
        print("RUNNING", flush=True)
        time.sleep(600)

    def test_never_reached(server):
        time.sleep(600)
''')


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone, only not reaped yet
        return f.read().split(")")[-1].split()[0] != "Z"


def _signal_state(pid: int) -> str:
    """Whether `pid` ignores, blocks or catches SIGINT (/proc's masks): an ignored SIGINT is
    inherited from whoever started the process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    bit = 1 << (signal.SIGINT - 1)
    return ", ".join(f"SIGINT {name} {bool(int(fields[key], 16) & bit)}"
                     for key, name in (("SigIgn", "ignored"), ("SigBlk", "blocked"), ("SigCgt", "caught")))


def _children(pid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


@pytest.mark.parametrize("when", ["RUNNING", "STARTING"], ids=["during-a-test", "while-the-server-starts"])
def test_sigint_stops_pytest_and_its_servers_within_seconds(tmp_path, when):
    (tmp_path / "test_inner.py").write_text(INNER.replace("TESTS", repr(str(TESTS))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    # As a terminal runs it: pytest leads its own process group, Ctrl-C goes to the group, and
    # SIGINT raises KeyboardInterrupt (a suite started in the background, `make test &`, hands
    # its children an ignored SIGINT, which Python then leaves ignored).
    run_pytest = ("import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
                  f"sys.exit(pytest.main(['-q', '-s', '-p', 'no:cacheprovider', {str(tmp_path / 'test_inner.py')!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", run_pytest], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines, server_pid = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("SERVER-PID"):
                server_pid = int(line.split()[1])
            if line.startswith(when):
                break
        if when == "STARTING":  # the server process exists, and is loading
            deadline = time.monotonic() + 30
            while not _children(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            server_pid = min(_children(proc.pid))
        assert server_pid is not None, "".join(lines)
        time.sleep(1)
        signals = _signal_state(proc.pid)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rest, _ = proc.communicate()
            pytest.fail(f"pytest did not stop within 30 s of SIGINT ({signals}):\n{''.join(lines)}{rest}")
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines) + rest
    assert "KeyboardInterrupt" in out, out
    assert elapsed < 15, f"pytest took {elapsed:.1f} s to stop:\n{out}"
    assert "test_never_reached" not in out or "passed" not in out
    deadline = time.monotonic() + 10
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(server_pid), f"the server (pid {server_pid}) outlived the suite"
