"""Decode GEMMs with their neighbours: cuBLAS and the op after it, against
rlserve/ops/triton_decode_gemm.py with that op fused.

Per model and batch size, four pairs, each timed as a CUDA-graph replay of 28 layers with
distinct weights (none served from L2), in microseconds a layer:

  o, down   F.linear, then the residual add + RMSNorm kernel   | split-K GEMM whose partial
            sums the norm reads (triton_fused.partials_add_rms_norm)
  gate_up   F.linear, then SiLU-and-mul                        | one GEMM writing silu(g) * u
  qkv       F.linear                                           | the decode GEMM, unsplit

For each: the tiles the engine picks (plan_o_down / plan_gate_up; "-" where it keeps
cuBLAS) and the best of a sweep of tiles, so the plans can be checked and retuned. Every
variant is checked against the cuBLAS pair first.

Usage: python benchmarks/decode_gemm.py [--models qwen3-0.6b,llama-3.1-8b] [--rows 1,16,64]
       [--kinds qkv,o,gate_up,down]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from attention_kernels import bench_graph
from rlserve.ops import triton_decode_gemm as G
from rlserve.ops import triton_fused

LAYERS = 28
# hidden, q heads x head_dim, kv heads x head_dim, intermediate
MODELS = {"qwen3-0.6b": (1024, 2048, 1024, 3072), "llama-3.1-8b": (4096, 4096, 1024, 14336)}
ROWS = (1, 8, 16, 32, 64, 96, 128, 192, 256)


def _sweep(rows: int, k: int, n: int, gated: bool):
    """Candidate tiles: a few shapes per knob, the ones that divide the problem."""
    bms = sorted({G._bm(rows), min(128, max(16, 1 << (rows - 1).bit_length()))})
    for bm, bn, bk, splits in itertools.product(bms, (16, 32, 64, 128), (128, 256),
                                                (1,) if gated else (1, 2, 4, 8, 16)):
        plan = G.GemmPlan(bn=bn, bm=bm, bk=bk, splits=splits, stages=3 if gated else 4, warps=4)
        if G._fits(plan, k, n) and (bn * (2 if gated else 1) + bm) * bk * 2 * plan.stages <= 200_000:
            yield plan


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _time(fn) -> float:
    return bench_graph(fn, iters=30) / LAYERS


def _pair(kind: str, rows: int, k: int, n: int, dtype: torch.dtype):
    """(baseline fn, fn of a plan, reference output) over LAYERS distinct weights."""
    gated = kind == "gate_up"
    wn = 2 * n if gated else n
    weights = [torch.randn(wn, k, device="cuda", dtype=dtype) * k ** -0.5 for _ in range(LAYERS)]
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    residual = torch.randn(rows, n, device="cuda", dtype=dtype)
    norm_w = torch.ones(n, device="cuda", dtype=dtype)

    if kind in ("o", "down"):
        def base(w):
            return triton_fused.fused_add_rms_norm(F.linear(x, w), residual, norm_w, 1e-6)[0]

        def fused(w, plan):
            return G.gemm_add_rms_norm(x, w, plan, residual, norm_w, 1e-6)[0]
    elif gated:
        def base(w):
            return triton_fused.silu_and_mul(F.linear(x, w))

        def fused(w, plan):
            return G.decode_gemm(x, w, plan, gated=True)
    else:
        def base(w):
            return F.linear(x, w)

        def fused(w, plan):
            return G.decode_gemm(x, w, plan)
    return weights, base, fused


def measure(kind: str, rows: int, k: int, n: int, dtype=torch.bfloat16) -> str:
    weights, base, fused = _pair(kind, rows, k, n, dtype)
    expected = base(weights[0])
    t_base = _time(lambda: [base(w) for w in weights])
    planner = {"o": G.plan_o_down, "down": G.plan_o_down, "gate_up": G.plan_gate_up}.get(kind)
    picked = planner(rows, k, n) if planner else None
    results = {}
    for plan in _sweep(rows, k, n, kind == "gate_up"):
        if kind == "qkv" and plan.splits > 1:
            continue
        try:
            err = _rel(fused(weights[0], plan), expected)
            assert err < 2e-2, f"relative error {err:.3g}"
            results[plan] = _time(lambda: [fused(w, plan) for w in weights])
        except Exception as e:  # out of resources
            print(f"    {kind} rows={rows} {plan}: failed ({type(e).__name__}: {e})", flush=True)
    if picked is not None and picked not in results:
        results[picked] = _time(lambda: [fused(w, picked) for w in weights])
    best = min(results, key=results.get)
    t_pick = f"{results[picked]:7.2f}" if picked is not None else "      -"
    return (f"{kind:8s} K={k:5d} N={n:5d} rows={rows:3d}: cuBLAS pair {t_base:7.2f} | plan {t_pick} "
            f"{tuple(picked) if picked else ''} | best {results[best]:7.2f} {tuple(best)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--kinds", default="qkv,o,gate_up,down")
    args = ap.parse_args()
    print("GemmPlan fields: (bn, bm, bk, splits, stages, warps); us per layer", flush=True)
    for model in args.models.split(","):
        hidden, q, kv, inter = MODELS[model]
        print(f"== {model}", flush=True)
        for rows in map(int, args.rows.split(",")):
            for kind, k, n in (("qkv", hidden, q + 2 * kv), ("o", q, hidden),
                               ("gate_up", hidden, inter), ("down", inter, hidden)):
                if kind in args.kinds.split(","):
                    print(measure(kind, rows, k, n), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
