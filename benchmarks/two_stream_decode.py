"""One decode step of Qwen3-0.6B as one CUDA graph, against the batch cut in two halves
run on two streams inside one graph (so one half's attention can overlap the other's
GEMMs and fill each kernel's ramp and tail), and the two halves on one stream (the cost
of the extra launches alone). Dummy weights; contexts like the throughput workload's.

Usage: python benchmarks/two_stream_decode.py
"""

from __future__ import annotations

import math
import random

import torch

from attention_kernels import bench
from rlserve import LLM
from rlserve.model.layers import AttentionMetadata
from rlserve.model.presets import model_dir


def make_batch(ctxs, blocks, block_size, device):
    """Decode inputs for sequences with contexts `ctxs`, their blocks drawn from `blocks`."""
    n = len(ctxs)
    per_seq = [math.ceil((c + 1) / block_size) for c in ctxs]
    tables = torch.zeros(n, max(per_seq), dtype=torch.int32)
    for i, k in enumerate(per_seq):
        tables[i, :k] = torch.tensor([next(blocks) for _ in range(k)], dtype=torch.int32)
    pos = torch.tensor(ctxs, dtype=torch.int64)
    slots = tables.long().gather(1, (pos // block_size)[:, None])[:, 0] * block_size + pos % block_size
    seq_lens = (pos + 1).to(torch.int32)
    order = torch.argsort(-seq_lens, stable=True).to(torch.int32)
    meta = AttentionMetadata(slots.to(device), torch.arange(n + 1, dtype=torch.int32, device=device),
                             seq_lens.to(device), tables.to(device), 1, int(seq_lens.max()), order.to(device))
    return torch.randint(0, 150000, (n,), device=device), pos.to(device), meta


def capture(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def main() -> None:
    llm = LLM(model_dir("qwen3-0.6b"), device="cuda", dtype="auto", load_format="dummy",
              skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=256,
              max_num_batched_tokens=16384, gpu_memory_utilization=0.9)
    runner = llm.engine.executor.driver.runner
    model, block_size, device = runner.model, runner.block_size, torch.device("cuda")
    rng = random.Random(0)
    pool = list(range(1, runner.num_blocks))
    rng.shuffle(pool)
    cases = [("256 x U[150,1074]", [rng.randint(150, 1074) for _ in range(256)]),
             ("256 x U[400,1400]", [rng.randint(400, 1400) for _ in range(256)]),
             ("192 x U[400,1600]", [rng.randint(400, 1600) for _ in range(192)]),
             ("128 x U[900,1900]", [rng.randint(900, 1900) for _ in range(128)]),
             ("64 x U[1000,2000]", [rng.randint(1000, 2000) for _ in range(64)])]
    with torch.inference_mode():
        for name, ctxs in cases:
            whole = make_batch(ctxs, iter(pool), block_size, device)
            # Halves with similar KV bytes: sorted by length, dealt alternately.
            ranked = sorted(range(len(ctxs)), key=lambda i: -ctxs[i])
            blocks = iter(pool)
            a = make_batch([ctxs[i] for i in ranked[0::2]], blocks, block_size, device)
            b = make_batch([ctxs[i] for i in ranked[1::2]], blocks, block_size, device)
            s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

            def two_streams():
                cur = torch.cuda.current_stream()
                s1.wait_stream(cur)
                s2.wait_stream(cur)
                with torch.cuda.stream(s1):
                    model(*a)
                with torch.cuda.stream(s2):
                    model(*b)
                cur.wait_stream(s1)
                cur.wait_stream(s2)

            variants = (("one graph", lambda: model(*whole)),
                        ("halves, one stream", lambda: (model(*a), model(*b))),
                        ("halves, two streams", two_streams))
            times = {}
            for label, fn in variants:
                graph = capture(fn)
                times[label] = bench(graph.replay, iters=40)
                del graph
            print(name + ": " + " | ".join(f"{k} {v:.0f} us" for k, v in times.items()), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
