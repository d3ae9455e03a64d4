"""Where a profiled run's GPU time went, from a torch.profiler chrome trace.

Prints the device's busy share of the run, the idle time between kernels by gap length
(short gaps are launch latency inside a stream or graph; long ones mean the device waited
for the host), and the kernels that took the most time; with --steps, the idle time per
engine step over the run; with --gaps N, the N longest idle stretches and what surrounds them.

    python benchmarks/trace_summary.py TRACE.json [--top 25] [--steps] [--gaps N]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json

GAP_BINS = [(0, 5), (5, 20), (20, 100), (100, 1000), (1000, float("inf"))]  # microseconds


def kernel_intervals(trace: dict) -> list[tuple[float, float, str]]:
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            out.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", "?")))
    out.sort()
    return out


def _busy(spans: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of `spans` (start-sorted)."""
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    return busy


def idle_gaps(intervals: list[tuple[float, float, str]]):
    """Each stretch with nothing running, in order: (its start, its length, the name of
    the kernel that ended last before it, the index of the interval after it)."""
    end, last = intervals[0][1], intervals[0][2]
    for i, (s, e, name) in enumerate(intervals[1:], 1):
        if s > end:
            yield end, s - end, last, i
        if e >= end:
            end, last = e, name


def summarize(path: str, top: int = 25) -> list[tuple[float, float, str]]:
    """Prints the summary; returns the trace's device intervals (for idle_per_step)."""
    # torch.profiler gzips the trace when the path ends in .gz.
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        intervals = kernel_intervals(json.load(f))
    if not intervals:
        print("no device events in the trace")
        return intervals
    span = intervals[-1][1] - intervals[0][0]
    gaps = collections.Counter()
    gap_counts = collections.Counter()
    for _, gap, _, _ in idle_gaps(intervals):
        for lo, hi in GAP_BINS:
            if lo <= gap < hi:
                gaps[(lo, hi)] += gap
                gap_counts[(lo, hi)] += 1
    busy = _busy([(s, e) for s, e, _ in intervals])
    per_name = collections.defaultdict(lambda: [0, 0.0])
    for s, e, name in intervals:
        entry = per_name[name[:90]]
        entry[0] += 1
        entry[1] += e - s
    print(f"device events: {len(intervals)}; span {span / 1e6:.3f} s; busy {busy / 1e6:.3f} s "
          f"({busy / span:.1%}); idle {(span - busy) / 1e6:.3f} s")
    for lo, hi in GAP_BINS:
        label = f"gaps {lo}-{hi} us" if hi != float("inf") else f"gaps >= {lo} us"
        print(f"  {label:18s} {gap_counts[(lo, hi)]:8d} x, {gaps[(lo, hi)] / 1e6:.3f} s")
    # A kernel launched early under programmatic dependent launch counts its wait too.
    print(f"top {top} device ops by total time (their durations, waits included):")
    for name, (n, t) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {t / 1e6:8.3f} s {t / busy:6.1%} {n:8d} x {t / n:8.1f} us  {name}")
    return intervals


def idle_per_step(intervals: list[tuple[float, float, str]], marker: str = "_split_logsumexp_kernel",
                  parts: int = 10) -> None:
    """The device's idle time between consecutive `marker` kernels (one per step: the first
    kernel of temperature sampling; a greedy run has none), summarised per tenth of the run.
    Idle that stays the same whether a step's kernels take 6 ms or 2 ms is a wait built into
    every step, not a host that cannot keep up."""
    marks = [s for s, _, name in intervals if name.startswith(marker)]
    if len(marks) < 2:
        print(f"fewer than two {marker} kernels: no steps to compare")
        return
    spans, busy = [], []
    j = 0
    for s0, s1 in zip(marks, marks[1:]):
        while intervals[j][0] < s0:
            j += 1
        i = j
        while i < len(intervals) and intervals[i][0] < s1:
            i += 1
        spans.append(s1 - s0)
        busy.append(_busy([(s, min(e, s1)) for s, e, _ in intervals[j:i]]))
    n = len(spans)
    print(f"{n} steps (from one {marker} to the next):")
    for k in range(parts):
        lo, hi = k * n // parts, (k + 1) * n // parts
        if hi <= lo:
            continue
        span = sorted(spans[lo:hi])[(hi - lo) // 2]
        idle = sorted(sp - b for sp, b in zip(spans[lo:hi], busy[lo:hi]))[(hi - lo) // 2]
        print(f"  steps {lo:5d}-{hi:5d}: median step {span:8.1f} us, of it idle {idle:7.1f} us")
    print(f"  idle between markers: {(sum(spans) - sum(busy)) / 1e6:.3f} s of {sum(spans) / 1e6:.3f} s")


def kernel_time_per_step(intervals: list[tuple[float, float, str]], kernel: str,
                         marker: str = "_stage_kernel") -> list[tuple[float, float]]:
    """Per CUDA-graph decode step (from one `marker` kernel, which writes a step's graph
    inputs, to the next): microseconds in kernels whose name starts with `kernel`, and the
    rest of the step's busy time. The rest is the step's busy time less those kernels', not
    the sum of the other kernels' durations: a kernel launched early under programmatic
    dependent launch (the decode GEMMs, triton_pdl) starts while `kernel` still runs and
    waits, and its duration counts that wait. Steps before the first marker (the prefill)
    are not counted."""
    steps: list[list] = []
    for s, e, name in intervals:
        if name.startswith(marker):
            steps.append([0.0, []])
        elif steps:
            if name.startswith(kernel):
                steps[-1][0] += e - s
            steps[-1][1].append((s, e))
    return [(a, max(0.0, _busy(spans) - a)) for a, spans in steps]


def longest_gaps(intervals: list[tuple[float, float, str]], n: int = 20,
                 marker: str = "_split_logsumexp_kernel") -> None:
    """The `n` longest stretches with nothing running on the device: when (ms into the
    trace, and after how many `marker` kernels: sampled steps), how long, and the kernels
    on either side, which say which part of a step the device waited in."""
    if not intervals:
        return
    t0 = intervals[0][0]
    # Sampled steps before each interval: markers among the intervals ahead of it.
    steps = list(itertools.accumulate((name.startswith(marker) for _, _, name in intervals), initial=0))
    gaps = [(gap, at, steps[i], before, intervals[i][2])
            for at, gap, before, i in idle_gaps(intervals)]
    print(f"longest {n} idle gaps (ms into the trace, sampled steps before it):")
    for gap, at, k, before, after in sorted(gaps, reverse=True)[:n]:
        print(f"  {gap:8.1f} us at {(at - t0) / 1e3:8.2f} ms, step {k:5d}: "
              f"after {before[:50]} / before {after[:50]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--steps", action="store_true", help="also the idle time per step")
    ap.add_argument("--gaps", type=int, default=0, metavar="N", help="also the N longest idle gaps")
    args = ap.parse_args()
    intervals = summarize(args.trace, args.top)
    if args.steps:
        idle_per_step(intervals)
    if args.gaps:
        longest_gaps(intervals, args.gaps)


if __name__ == "__main__":
    main()
