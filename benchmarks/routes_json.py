"""The API server's cost of a choice's routed_experts: a completion's routes (default 2,000
tokens of Qwen3-30B-A3B: 48 layers x 8 experts) written into a response body, against
the same as Python lists through pydantic.

    python benchmarks/routes_json.py [--tokens 2000 --layers 48 --top-k 8 --experts 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from rlserve.server.responses import CompletionChoice
from rlserve.server.routes_json import RoutesJSON, splice


def timed(fn, runs: int) -> float:
    """Median milliseconds of `fn()`."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args()
    routes = np.random.default_rng(0).integers(0, args.experts, (args.tokens, args.layers, args.top_k)).astype(np.int32)

    def fast() -> str:
        choice = CompletionChoice(index=0, text="")
        choice.routed_experts = RoutesJSON(routes)
        return splice(choice.model_dump_json())

    def lists() -> str:
        return json.dumps({"index": 0, "text": "", "routed_experts": routes.tolist()})

    body = fast()
    assert json.loads(body)["routed_experts"] == routes.tolist()
    print(f"{args.tokens} tokens x {args.layers} layers x {args.top_k}: {len(body) / 1e6:.1f} MB of JSON")
    print(f"  numpy-written text, spliced: {timed(fast, args.runs):.1f} ms")
    print(f"  Python lists, json.dumps:    {timed(lists, max(args.runs // 4, 1)):.1f} ms")


if __name__ == "__main__":
    main()
