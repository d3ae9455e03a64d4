"""Tune the fused MoE's launch shapes on this card for a model's expert shape, and write the
table rlserve/ops/moe_configs.py reads (a script, not a test; it needs a GPU).

For each token count, routing drawn uniformly: first the blocks' rows (BLOCK_M) and the
gate-up kernel's tiles, warps and stages, with the down kernel at the defaults; then the down
kernel's with that choice. Every candidate is checked against the torch reference before it
is timed (replayed from a CUDA graph, as decode steps run); shapes the card cannot launch are
skipped. Prints each count's winner beside the built-in default, then writes

    rlserve/ops/moe_configs/<card>/E<experts>-H<hidden>-I<expert width>-<dtype>.json

    python benchmarks/moe_tune.py --model qwen3-30b-a3b
    python benchmarks/moe_tune.py --model qwen3-next-80b-a3b --tokens 1 8 64 256 4096 16384
    python benchmarks/moe_tune.py --model qwen3-30b-a3b --tp 2          # a shard's expert width
    python benchmarks/moe_tune.py --model qwen3-30b-a3b --quick --dry-run
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from moe_kernels import replay_us  # noqa: E402
from rlserve.model.moe import MoEConfig  # noqa: E402
from rlserve.model.presets import model_dir  # noqa: E402
from rlserve.ops import moe as ref  # noqa: E402
from rlserve.ops import moe_configs  # noqa: E402
from rlserve.ops.triton_moe import DEFAULT_CONFIG, block_m_for, fused_moe  # noqa: E402

TOKENS = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096, 8192, 16384]


def grids(quick: bool) -> tuple[dict, dict]:
    """The gate-up and the down kernel's candidate values."""
    if quick:
        return (dict(BLOCK_N=[64, 128], BLOCK_K=[64, 128], warps=[4, 8], stages=[3]),
                dict(BLOCK_N=[64, 128], BLOCK_K=[64, 128], warps=[4, 8], stages=[3]))
    return (dict(BLOCK_N=[32, 64, 128], BLOCK_K=[64, 128], warps=[4, 8], stages=[3, 4]),
            dict(BLOCK_N=[64, 128, 256], BLOCK_K=[64, 128], warps=[4, 8], stages=[3, 4]))


def product(grid: dict) -> list[dict]:
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def time_us(fn) -> float:
    """Microseconds a call, replayed from a CUDA graph of enough calls to take ~2 ms."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    calls = max(1, min(50, int(2e-3 / max(time.perf_counter() - t0, 1e-6))))
    return replay_us(fn, iters=5, calls=calls)


class Case:
    """One token count's inputs, its reference output, and candidate timings."""

    def __init__(self, tokens: int, moe: MoEConfig, hidden: int, inter: int, w13, w2, gen):
        self.tokens = tokens
        self.x = torch.randn(tokens, hidden, generator=gen).to("cuda", torch.bfloat16)
        logits = torch.randn(tokens, moe.num_experts, generator=gen).cuda()
        self.routing = ref.route(logits, moe.top_k, renormalize=True)
        self.w13, self.w2 = w13, w2
        self.want = ref.fused_moe(self.x.float(), w13.float(), w2.float(), self.routing.weights, self.routing.ids)

    def run(self, cfg: dict | None) -> torch.Tensor:
        return fused_moe(self.x, self.w13, self.w2, self.routing.weights, self.routing.ids,
                         config=cfg if cfg is not None else DEFAULT_CONFIG)

    def time(self, cfg: dict | None) -> float | None:
        """Microseconds, or None: the card cannot launch it, or its output is wrong."""
        try:
            got = self.run(cfg)
            err = ((got.float() - self.want).norm(dim=-1) / self.want.norm(dim=-1).clamp_min(1e-6)).max().item()
            if err > 2e-2:
                print(f"    T={self.tokens} {cfg}: WRONG ({err:.3g}), skipped", flush=True)
                return None
            return time_us(lambda: self.run(cfg))
        except Exception as e:  # triton's OutOfResources and its kin: a shape the card cannot launch
            print(f"    T={self.tokens} {cfg}: {type(e).__name__}, skipped", flush=True)
            return None


def best(case: Case, candidates: list[dict]) -> tuple[dict, float]:
    timed = [(t, c) for c in candidates if (t := case.time(c)) is not None]
    if not timed:
        raise RuntimeError(f"T={case.tokens}: none of {len(candidates)} candidates launched correctly")
    t, c = min(timed, key=lambda tc: tc[0])
    return c, t


def tune(case: Case, experts: int, quick: bool) -> tuple[dict, float, float]:
    """(the winner, its microseconds, the default's microseconds) for one token count."""
    up_grid, down_grid = grids(quick)
    bm0 = block_m_for(case.tokens * case.routing.ids.shape[1], experts)
    block_ms = sorted({m for m in (bm0 // 2, bm0, bm0 * 2) if 16 <= m <= 128})
    default_down = {k: DEFAULT_CONFIG[k] for k in ("BLOCK_N", "BLOCK_K", "warps", "stages")}
    up, _ = best(case, [dict(BLOCK_M=m, **u, down=default_down) for m in block_ms for u in product(up_grid)])
    up.pop("down")
    winner, t = best(case, [dict(up, down=d) for d in product(down_grid)])
    if all(winner["down"][k] == winner[k] for k in winner["down"]):
        winner.pop("down")  # the same shape for both: one set of keys
    return winner, t, case.time(None) or float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", help="an MoE preset or an HF directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: each rank's expert width")
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--quick", action="store_true", help="a smaller grid (a few minutes)")
    p.add_argument("--dry-run", action="store_true", help="print the table, write nothing")
    args = p.parse_args()
    from transformers import AutoConfig
    hf = AutoConfig.from_pretrained(model_dir(args.model))
    hf = getattr(hf, "text_config", hf)
    moe = MoEConfig.read(hf)
    hidden, inter = hf.hidden_size, moe.intermediate_size // args.tp
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(moe.num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to("cuda", torch.bfloat16)
    w2 = (torch.randn(moe.num_experts, hidden, inter, generator=gen) / inter ** 0.5).to("cuda", torch.bfloat16)
    name = torch.cuda.get_device_name()
    print(f"{name}; {args.model}: {moe.num_experts} experts, top-{moe.top_k}, H {hidden}, I {inter}, bf16", flush=True)
    table, t0 = {}, time.perf_counter()
    path = moe_configs.table_path(name, moe.num_experts, hidden, inter, torch.bfloat16)
    for tokens in args.tokens:
        cfg, us, default_us = tune(Case(tokens, moe, hidden, inter, w13, w2, gen), moe.num_experts, args.quick)
        table[str(tokens)] = cfg
        print(f"T={tokens:>6}: {us:9.1f} us, default {default_us:9.1f} us ({default_us / us:.2f}x): {cfg}", flush=True)
        moe_configs.check_table(table, "tuned table")
        if not args.dry_run:  # after every count: a run cut short still leaves what it found
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"tuned in {time.perf_counter() - t0:.0f} s")
    if args.dry_run:
        print(json.dumps(table, indent=1))
        return
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
