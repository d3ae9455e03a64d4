"""Child processes start one way (rlserve.process.spawn): this interpreter and this rlserve,
their input on stdin, their output where asked, the environment a child needs."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlserve.process import spawn

ROOT = Path(__file__).resolve().parents[2]
# A module that reports what its process was given.
PROBE = """
import json, os, sys
keys = ("PYTHONPATH", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "FROM_CALLER")
print(json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:],
                  "stdin": sys.stdin.read() if "--read-stdin" in sys.argv else None}))
"""


def _probe(tmp_path: Path, name: str, *args: str, **kw) -> dict:
    (tmp_path / "spawn_probe.py").write_text(PROBE)
    log = tmp_path / f"{name}.log"
    proc = spawn("spawn_probe", *args, log=log, env={"PYTHONPATH": str(tmp_path), "FROM_CALLER": "x"}, **kw)
    assert proc.wait(timeout=60) == 0, log.read_text()
    return json.loads(log.read_text())


def test_a_child_runs_this_rlserve_with_its_input_and_its_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    seen = _probe(tmp_path, "first", "a", "--read-stdin", stdin=b"config bytes", gpus=["2", "3"], threads=5)
    assert seen["argv"] == ["a", "--read-stdin"] and seen["stdin"] == "config bytes"
    env = seen["env"]
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), str(tmp_path)]
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["OMP_NUM_THREADS"] == "5"
    assert env["FROM_CALLER"] == "x"


def test_a_thread_count_the_user_set_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = _probe(tmp_path, "second", threads=5, parent_death=None, new_session=True)["env"]
    assert env["OMP_NUM_THREADS"] == "3" and env["CUDA_VISIBLE_DEVICES"] is None
