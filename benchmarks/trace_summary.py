"""Where a profiled run's GPU time went, from a torch.profiler chrome trace.

Prints the device's busy share of the run, the idle time between kernels by gap length
(short gaps are launch latency inside a stream or graph; long ones mean the device waited
for the host), and the kernels that took the most time.

    python benchmarks/trace_summary.py TRACE.json [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import json

GAP_BINS = [(0, 5), (5, 20), (20, 100), (100, 1000), (1000, float("inf"))]  # microseconds


def kernel_intervals(trace: dict) -> list[tuple[float, float, str]]:
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            out.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", "?")))
    out.sort()
    return out


def summarize(path: str, top: int = 25) -> None:
    with open(path) as f:
        intervals = kernel_intervals(json.load(f))
    if not intervals:
        print("no device events in the trace")
        return
    span = intervals[-1][1] - intervals[0][0]
    busy = 0.0
    gaps = collections.Counter()
    gap_counts = collections.Counter()
    end = intervals[0][0]
    per_name = collections.defaultdict(lambda: [0, 0.0])
    for s, e, name in intervals:
        if s > end:
            gap = s - end
            for lo, hi in GAP_BINS:
                if lo <= gap < hi:
                    gaps[(lo, hi)] += gap
                    gap_counts[(lo, hi)] += 1
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
        entry = per_name[name[:90]]
        entry[0] += 1
        entry[1] += e - s
    print(f"device events: {len(intervals)}; span {span / 1e6:.3f} s; busy {busy / 1e6:.3f} s "
          f"({busy / span:.1%}); idle {(span - busy) / 1e6:.3f} s")
    for lo, hi in GAP_BINS:
        label = f"gaps {lo}-{hi} us" if hi != float("inf") else f"gaps >= {lo} us"
        print(f"  {label:18s} {gap_counts[(lo, hi)]:8d} x, {gaps[(lo, hi)] / 1e6:.3f} s")
    print(f"top {top} device ops by total time:")
    for name, (n, t) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {t / 1e6:8.3f} s {t / busy:6.1%} {n:8d} x {t / n:8.1f} us  {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    summarize(args.trace, args.top)


if __name__ == "__main__":
    main()
