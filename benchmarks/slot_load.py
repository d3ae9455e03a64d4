"""LoRA slot loads on their own: a rank-16 adapter on every projection of Qwen3-8B (504
tensors, PEFT's float32 on the trainer side) copied into bf16 adapter slots, as a warm
push's apply does. Each variant is timed with a device sync, median of 20 after a warm-up.

    python benchmarks/slot_load.py                 # H200
    python benchmarks/slot_load.py --device cpu    # runs anywhere, slowly

Variants: `LoRAModel.run` with the kept plan (A copied, B copied and scaled in place when that
gives the same bits; nothing cleared, as the adapter covers its slot), the same after clearing
the whole slot (as loads did before), and the earlier copies (each B through a float32
temporary; without the clearing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from rlserve.model.lora import LoadPlan, LoRAContext, LoRAModel, _exact_in_place  # noqa: E402

LAYERS, RANK = 36, 16
A_SHAPES = [(RANK, 4096)] * 6 + [(RANK, 12288)]  # q k v o gate up down: A is [r, in]
B_SHAPES = [(4096, RANK), (1024, RANK), (1024, RANK), (4096, RANK), (12288, RANK), (12288, RANK), (4096, RANK)]


def tensors(shapes, dtype, device) -> list[torch.Tensor]:
    return [torch.randn(s, dtype=dtype, device=device) for _ in range(LAYERS) for s in shapes]


def timed(name: str, fn, device: str, repeats: int = 20) -> None:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    print(f"{name:>44}: median {statistics.median(times) * 1e3:.3f} ms, best {min(times) * 1e3:.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--scaling", type=float, default=2.0, help="lora_alpha / r (2.0: alpha = 2r)")
    args = p.parse_args()
    for src_dtype in (torch.float32, torch.bfloat16):
        a_src, b_src = tensors(A_SHAPES, src_dtype, args.device), tensors(B_SHAPES, src_dtype, args.device)
        a_dst, b_dst = tensors(A_SHAPES, torch.bfloat16, args.device), tensors(B_SHAPES, torch.bfloat16, args.device)
        scales = [args.scaling] * len(b_src)
        plan = LoadPlan([], a_dst, a_src, b_dst, b_src, scales, _exact_in_place(b_dst, b_src, scales))
        cleared = plan._replace(zero=[torch.empty_like(t) for t in a_dst + b_dst])
        model = LoRAModel({}, LoRAContext(), 1, RANK)
        print(f"-- trainer tensors in {src_dtype}, scaling {args.scaling} (in place: {plan.b_in_place})")
        timed("LoRAModel.run (the kept plan)", lambda: model.run(plan), args.device)
        timed("the slot cleared first", lambda: model.run(cleared), args.device)
        timed("each B through a float32 temporary", lambda: (
            torch._foreach_copy_(a_dst, a_src),
            torch._foreach_copy_(b_dst, torch._foreach_mul([b.float() for b in b_src], scales))), args.device)


if __name__ == "__main__":
    main()
