"""The package's layers: rlserve.engine sits above rlserve.worker, and the values they share
(rlserve.sequence, rlserve.sampling_params) sit below both."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import rlserve.worker

_BELOW_THE_ENGINE = ["rlserve.sampling_params", "rlserve.sequence", "rlserve.config"] + [
    f"rlserve.worker.{m.name}" for m in pkgutil.iter_modules(rlserve.worker.__path__)]


def test_importing_the_workers_imports_no_engine_module():
    """In a fresh interpreter, every module of rlserve.worker (and the shared values) loads
    without loading any of rlserve.engine: the worker never reaches up."""
    code = ("import importlib, json, sys\n"
            f"for name in {_BELOW_THE_ENGINE!r}:\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('rlserve.engine'))))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(_BELOW_THE_ENGINE) > 6  # the worker package was found
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []
