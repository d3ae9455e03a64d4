"""Would a decode layer's GEMMs run faster with their weights already in L2?

A decode step at 256 sequences spends ~28 us a layer in four cuBLAS GEMMs whose weights
(30 MB for Qwen3-0.6B) come cold from HBM, right after paged attention has streamed
hundreds of MB of KV cache through L2. This script models one layer as "stream the KV
bytes, then the four GEMMs" (28 layers, distinct weights, one CUDA graph) and times:

  gemms cold / hot      the four GEMMs alone, distinct weights per layer / the same ones
  stream                the KV stand-in alone (plain loads / evict_first)
  layer                 stream then GEMMs, as the engine runs today
  layer + prefetch      a tiny kernel first asks L2 for the layer's weights (bulk
                        cp.async.bulk.prefetch.L2 or per-line prefetch.global.L2), then
                        stream (plain or evict_first), then GEMMs

The prefetch costs the stream its weight bytes (30 MB at ~4.5 TB/s = ~7 us) and a launch;
it pays if the GEMMs gain more than that.

Usage: python benchmarks/l2_prefetch.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention_kernels import bench_graph
from decode_loads import stream_sum

LAYERS = 28
SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]  # (K, N): qkv, o, gate_up, down

_BULK = ("{ .reg .pred p; setp.gt.s32 p, $2, 0; "
         "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")
_LINE = ("{ .reg .pred p; setp.gt.s32 p, $2, 0; "
         "@p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }")


@triton.jit
def prefetch_kernel(table_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr):
    """Program (t, c): chunks c*BLOCK.. of tensor t, whose (address, bytes) is table[t]."""
    t = tl.program_id(0)
    base = tl.load(table_ptr + 2 * t)
    nbytes = tl.load(table_ptr + 2 * t + 1)
    off = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - off, CHUNK).to(tl.int32)  # <= 0: past the tensor's end
    tl.inline_asm_elementwise(ASM, "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1)


class Prefetcher:
    def __init__(self, tensors, chunk: int, asm: str):
        rows = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
        self.table = torch.tensor(rows, dtype=torch.int64, device="cuda").flatten()
        self.chunk, self.asm = chunk, asm
        self.block = 128
        most = max(n for _, n in rows)
        self.grid = (len(rows), triton.cdiv(triton.cdiv(most, chunk), self.block))

    def __call__(self):
        prefetch_kernel[self.grid](self.table, CHUNK=self.chunk, BLOCK=self.block, ASM=self.asm, num_warps=4)


def main() -> None:
    dtype = torch.bfloat16
    layers = [[torch.randn(n, k, device="cuda", dtype=dtype) * 0.03 for k, n in SHAPES] for _ in range(LAYERS)]
    print(f"weights a layer: {sum(w.numel() * 2 for w in layers[0]) / 1e6:.1f} MB", flush=True)
    xs = {k: None for k, _ in SHAPES}
    stream_block, iters = 4096, 8
    for stream_mb, m in ((690, 256), (300, 128), (64, 16)):
        n = stream_mb * 1_000_000 // 2 // (stream_block * iters) * (stream_block * iters)
        kv = torch.randn(LAYERS, n, device="cuda", dtype=dtype)
        grid = n // (stream_block * iters)
        sink = torch.empty(grid, device="cuda", dtype=torch.float32)
        for k in xs:
            xs[k] = torch.randn(m, k, device="cuda", dtype=dtype)

        def gemms(ws):
            for w in ws:
                torch.nn.functional.linear(xs[w.shape[1]], w)

        def stream(i, evict):
            stream_sum[(grid,)](kv[i], sink, n, BLOCK=stream_block, ITERS=iters, EVICT=evict, num_warps=8)

        prefetchers = {
            (name, chunk): [Prefetcher(ws, chunk, asm) for ws in layers]
            for name, chunk, asm in (("bulk", 65536, _BULK), ("bulk", 16384, _BULK), ("line", 128, _LINE))}

        def run(label, fn):
            t = bench_graph(fn, iters=20) / LAYERS
            print(f"  {label:<44} {t:8.2f} us a layer", flush=True)
            return t

        print(f"stream {stream_mb} MB a layer, {m} rows:", flush=True)
        run("gemms cold", lambda: [gemms(ws) for ws in layers])
        run("gemms hot (same weights every layer)", lambda: [gemms(layers[0]) for _ in layers])
        for evict in ("", "evict_first"):
            run(f"stream {evict or 'plain'}", lambda: [stream(i, evict) for i in range(LAYERS)])
        for evict in ("", "evict_first"):
            run(f"layer: stream {evict or 'plain'} + gemms",
                lambda: [(stream(i, evict), gemms(ws)) for i, ws in enumerate(layers)])
        for (name, chunk), pfs in prefetchers.items():
            for evict in ("", "evict_first"):
                run(f"prefetch {name} {chunk} + stream {evict or 'plain'}",
                    lambda: [(pfs[i](), stream(i, evict)) for i in range(LAYERS)])
                run(f"prefetch {name} {chunk} + stream {evict or 'plain'} + gemms",
                    lambda: [(pfs[i](), stream(i, evict), gemms(ws)) for i, ws in enumerate(layers)])
        del kv


if __name__ == "__main__":
    main()
