"""How the server should copy an update's tensors into the model: one `copy_` each, one
`_foreach_copy_` for all, or `copy_all` (large ones alone, the rest fused) at several sizes
of "large". Shapes of Qwen3-8B and Qwen3-30B-A3B (stacked and per-expert), bf16, on one GPU.

    python benchmarks/copy_all.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlserve.model import base  # noqa: E402

MiB = 1 << 20


def qwen3_8b() -> list[tuple[int, ...]]:
    h, i, q, kv = 4096, 12288, 4096, 1024
    layer = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i), (h,), (h,), (128,), (128,)]
    return [(151936, h)] + layer * 36 + [(h,), (151936, h)]


def qwen3_30b_a3b(per_expert: bool) -> list[tuple[int, ...]]:
    h, i, e, q, kv = 2048, 768, 128, 4096, 512
    experts = [(i, h), (i, h), (h, i)] * e if per_expert else [(e, 2 * i, h), (e, h, i)]
    layer = [(q, h), (kv, h), (kv, h), (h, q), (e, h), (h,), (h,), (128,), (128,)] + experts
    return [(151936, h)] + layer * 48 + [(h,), (151936, h)]


def pairs_for(shapes: list[tuple[int, ...]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each shape as a view into one source and one target buffer (a few allocations for
    tens of thousands of tensors, as a trainer's stacked experts seen per expert)."""
    sizes = [torch.Size(s).numel() for s in shapes]
    total = sum(sizes)
    src = torch.randn(total, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    pairs, at = [], 0
    for shape, n in zip(shapes, sizes):
        pairs.append((dst[at:at + n].view(shape), src[at:at + n].view(shape)))
        at += n
    return pairs


def timed(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(label: str, shapes: list[tuple[int, ...]]) -> None:
    pairs = pairs_for(shapes)
    gb = sum(t.numel() * t.element_size() for t, _ in pairs) / 1e9
    flat_dst, flat_src = pairs[0][0].untyped_storage(), pairs[0][1].untyped_storage()
    floor = timed(lambda: flat_dst.copy_(flat_src))
    print(f"{label}: {len(pairs)} tensors, {gb:.2f} GB; one flat copy {floor:.2f} ms")

    def each():
        for t, s in pairs:
            t.copy_(s)

    targets, sources = [t for t, _ in pairs], [s for _, s in pairs]
    results = {"copy_ each": timed(each), "_foreach_copy_ all": timed(lambda: torch._foreach_copy_(targets, sources))}
    for mib in (1, 4, 8, 32):
        base.SINGLE_COPY_BYTES = mib * MiB
        results[f"copy_all, alone from {mib} MiB"] = timed(lambda: base.copy_all(pairs))
    for name, ms in results.items():
        print(f"  {name:>28}: {ms:8.2f} ms = {floor / ms:5.0%} of the flat copy")


def main() -> None:
    measure("Qwen3-8B", qwen3_8b())
    torch.cuda.empty_cache()
    measure("Qwen3-30B-A3B stacked", qwen3_30b_a3b(False))
    torch.cuda.empty_cache()
    measure("Qwen3-30B-A3B per expert", qwen3_30b_a3b(True))


if __name__ == "__main__":
    main()
