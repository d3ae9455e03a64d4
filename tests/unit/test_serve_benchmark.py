"""benchmarks/serve.py's /weight_checker burst: the stall it reports is the longest gap
between two tokens of one stream that overlaps the burst, and its calls are counted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from serve import Burst, Result, main  # noqa: E402


def test_the_stall_is_the_longest_gap_overlapping_the_burst():
    streams = [Result(ok=True, stamps=[0.0, 1.0, 1.1, 5.0]),  # 1.1 -> 5.0 spans the burst
               Result(ok=True, stamps=[0.0, 9.0]),  # one gap from before the burst to after it
               Result(ok=True, stamps=[20.0, 40.0]),  # after the burst: not counted
               Result(ok=False, stamps=[2.0, 30.0])]  # a failed stream: not counted
    burst = Burst(start=2.0, end=3.0, latencies=[0.5, 0.9], errors=["HTTP 409: asleep"])
    got = burst.summary(streams[:1] + streams[2:])
    assert got["max_itl_during_checker_ms"] == 3.9e3
    assert burst.summary(streams)["max_itl_during_checker_ms"] == 9e3
    assert got["weight_checker_calls"] == 3 and got["weight_checker_failed"] == 1
    assert got["weight_checker_max_ms"] == 900.0 and got["weight_checker_window_ms"] == 1e3


def test_negative_burst_options_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--weight-checker-calls", "-1"])
    assert e.value.code == 2
    assert "--weight-checker-calls" in capsys.readouterr().err
