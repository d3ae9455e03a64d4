"""Times the Triton paged-attention kernels against the torch reference on one GPU.

Shapes are Qwen3-0.6B's (16 query heads, 8 kv heads, head_dim 128, bf16, block size 16):
  decode:  256 sequences x ~600 cached tokens, one query token each
  long:    8 sequences x 8192 cached tokens, one query token each (split-KV territory)
  prefill: one 8192-token chunk, and 4 x 2048-token chunks over a 2048-token prefix

Usage: python benchmarks/attention_kernels.py [--sweep] [--sampling-only] [--json PATH]

--sweep times other prefill tile configs (on one long prompt and on throughput.py's first
prefill step); benchmarks/decode_sweep.py sweeps the decode launch (tile config, program
order, KV splits) over several context mixes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from rlserve.ops import attention as ref

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16
DTYPE = torch.bfloat16
# (BLOCK_M, BLOCK_N, num_warps, num_stages) to try.
PREFILL_SWEEP = [(32, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 8, 2),
                 (64, 128, 8, 2), (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3)]


def bench(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median microseconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def bench_graph(fn, iters: int = 50) -> float:
    """Median microseconds per replay of fn captured in a CUDA graph (no launch overhead)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay, iters)


def make_batch(prefix_lens, q_lens, seed=0, block_size=BLOCK, head_major=False, cache_dtype=None):
    """Inputs over a cache of `block_size`-token blocks (shuffled), stored token-major
    ([block, token, head, dim], the engine's) or head-major ([block, head, token, dim],
    handed to the kernels as a strided view of that shape). cache_dtype: an fp8 type for a
    quantized cache with its per-row scales (token-major only)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    nblk = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max(nblk)
    num_blocks = sum(nblk) + 16
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    bt = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device="cuda")
    i = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[i:i + n]
        i += n
    shape = ((num_blocks, KV_HEADS, block_size, HEAD_DIM) if head_major
             else (num_blocks, block_size, KV_HEADS, HEAD_DIM))
    k_cache = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen)
    v_cache = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen)
    if head_major:
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    scales, row_bytes = {}, HEAD_DIM * DTYPE.itemsize
    if cache_dtype is not None:
        assert not head_major
        k_cache, k_scale = ref.quantize_fp8(k_cache, cache_dtype)
        v_cache, v_scale = ref.quantize_fp8(v_cache, cache_dtype)
        scales, row_bytes = dict(k_scale=k_scale, v_scale=v_scale), HEAD_DIM + 4
    n_tok = sum(q_lens)
    query = torch.randn(n_tok, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32,
                       device="cuda")
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, query_start_loc=qsl,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                block_tables=bt, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                kv_tokens=sum(seq_lens), scales=scales,
                kv_bytes=sum(seq_lens) * KV_HEADS * row_bytes * 2,
                # causal score entries: each query row sees prefix + its index + 1 keys
                score_entries=sum(q * p + q * (q + 1) // 2 for p, q in zip(prefix_lens, q_lens)))


def run_triton(ta, batch, out, **kw):
    return lambda: ta.paged_attention(
        batch["query"], batch["k_cache"], batch["v_cache"], batch["query_start_loc"],
        batch["seq_lens"], batch["block_tables"], HEAD_DIM ** -0.5,
        max_query_len=batch["max_query_len"], max_seq_len=batch["max_seq_len"], out=out,
        **batch["scales"], **kw)


def run_ref(batch):
    return lambda: ref.paged_attention(
        batch["query"], batch["k_cache"], batch["v_cache"], batch["query_start_loc"],
        batch["seq_lens"], batch["block_tables"], HEAD_DIM ** -0.5, **batch["scales"])


def check(ta, batch, **kw):
    out = torch.empty_like(batch["query"])
    run_triton(ta, batch, out, **kw)()
    exp = run_ref(batch)()
    err = ((out.float() - exp.float()).norm() / exp.float().norm()).item()
    assert err < 2e-2, err
    return err


def bench_sampling(report) -> None:
    """Temperature sampling over Qwen3's vocabulary against greedy's argmax.

    GB/s counts one read of the logits: the log-sum-exp pass is that read, and the draw
    inside one split per row adds little.
    """
    from rlserve.ops.triton_sampling import gumbel_sample
    vocab = 151936
    for rows in (256, 32, 1):
        logits = torch.randn(rows, vocab, device="cuda", dtype=DTYPE)
        temp = torch.full((rows,), 0.6, device="cuda")
        seeds = torch.arange(rows, device="cuda", dtype=torch.int64)
        nbytes = logits.numel() * logits.element_size()
        report(f"gumbel_sample {rows}x{vocab}", bench(lambda: gumbel_sample(logits, temp, seeds)), nbytes)
        report(f"gumbel_sample {rows}x{vocab} (cuda graph)",
               bench_graph(lambda: gumbel_sample(logits, temp, seeds)), nbytes)
        report(f"argmax {rows}x{vocab} torch (greedy)", bench(lambda: logits.argmax(-1)), nbytes)
    # Host time per call (launch overhead): what a step pays before the GPU sees the kernels.
    torch.cuda.synchronize()
    for name, fn in (("gumbel_sample", lambda: gumbel_sample(logits, temp, seeds)),
                     ("argmax", lambda: logits.argmax(-1))):
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        print(f"{name} host time per call: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us", flush=True)
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time other prefill tile configs")
    ap.add_argument("--sampling-only", action="store_true", help="only the sampling kernels")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from rlserve.ops import triton_attention as ta
    from rlserve.ops import triton_kv_store
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name()}

    def report(name, us, bytes_=None, flops=None, extra=""):
        msg = f"{name:58s} {us:10.1f} us"
        if bytes_:
            msg += f"  {bytes_ / us / 1e3:7.0f} GB/s"
        if flops:
            msg += f"  {flops / us / 1e6:7.1f} TFLOP/s"
        print(msg + extra, flush=True)
        results[name] = us

    if args.sampling_only:
        bench_sampling(report)
        return

    # ---------------------------------------------------------------- decode, 256 x ~600
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(500, 701, (256,), generator=g).tolist()
    dec = make_batch(ctx, [1] * 256)
    kv_bytes = dec["kv_bytes"]
    print(f"decode: 256 seqs, {dec['kv_tokens']} cached tokens, "
          f"{kv_bytes / 1e6:.0f} MB of K+V; rel err {check(ta, dec):.2e}", flush=True)
    out = torch.empty_like(dec["query"])
    report("decode triton (eager)", bench(run_triton(ta, dec, out)), kv_bytes)
    report("decode triton (cuda graph)", bench_graph(run_triton(ta, dec, out)), kv_bytes)
    report("decode torch reference", bench(run_ref(dec), iters=10), kv_bytes)

    # ---------------------------------------------------------------- decode, long contexts
    lng = make_batch([8191] * 8, [1] * 8, seed=2)
    lbytes = lng["kv_bytes"]
    print(f"long decode: rel err auto-split {check(ta, lng):.2e}", flush=True)
    out = torch.empty_like(lng["query"])
    report("long decode 8x8192 triton auto splits (graph)",
           bench_graph(run_triton(ta, lng, out)), lbytes)
    for s in (1, 4, 8, 16):
        report(f"long decode 8x8192 triton splits={s} (graph)",
               bench_graph(run_triton(ta, lng, out, num_kv_splits=s)), lbytes)
    report("long decode 8x8192 torch reference", bench(run_ref(lng), iters=10), lbytes)

    # ---------------------------------------------------------------- prefill
    # throughput.py's first prefill step: its workload's prompts up to a 16384-token budget
    # (the last one cut to fit, as the scheduler's chunk).
    from workloads import nano_vllm_draw
    first_chunk, budget = [], 16384
    for p in nano_vllm_draw(256, 100, 1024, 1024)[0]:
        first_chunk.append(min(len(p), budget - sum(first_chunk)))
        if sum(first_chunk) == budget:
            break
    prefill_cases = [("prefill 1x8192", [0], [8192]),
                     ("chunked prefill 4x2048 over 2048 prefix", [2048] * 4, [2048] * 4),
                     (f"prefill {len(first_chunk)} prompts (throughput.py's first step)",
                      [0] * len(first_chunk), first_chunk)]
    for name, prefix, qlens in prefill_cases:
        pb = make_batch(prefix, qlens, seed=3)
        flops = 4 * HEADS * HEAD_DIM * pb["score_entries"]
        print(f"{name}: rel err {check(ta, pb):.2e}", flush=True)
        out = torch.empty_like(pb["query"])
        report(f"{name} triton", bench(run_triton(ta, pb, out), iters=20), flops=flops)
        report(f"{name} torch reference", bench(run_ref(pb), iters=5), flops=flops)
        if qlens == [8192]:
            # Contiguous causal SDPA (flash) as a yardstick for the paged kernel.
            q = pb["query"].transpose(0, 1).unsqueeze(0).contiguous()
            k = torch.randn(1, KV_HEADS, 8192, HEAD_DIM, device="cuda", dtype=DTYPE)
            k = k.repeat_interleave(HEADS // KV_HEADS, 1)
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                q, k, k, is_causal=True)
            report(f"{name} contiguous SDPA causal (yardstick)", bench(sdpa, iters=20),
                   flops=flops)
        if args.sweep and prefix[0] == 0:
            for bm, bn, nw, st in PREFILL_SWEEP:
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=st)
                try:
                    check(ta, pb, _config=cfg)
                    us = bench(run_triton(ta, pb, out, _config=cfg), iters=10)
                except Exception as e:  # out of shared memory, wrong result
                    print(f"  {cfg}: failed ({type(e).__name__}: {e})")
                    continue
                report(f"  {name} {cfg}", us, flops=flops)

    # ---------------------------------------------------------------- store + fused ops
    kc, vc = dec["k_cache"], dec["v_cache"]
    for n in (256, 8192):
        key = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        slots = torch.randperm(kc.shape[0] * BLOCK, device="cuda")[:n]
        report(f"store_kv_cache {n} tokens triton",
               bench(lambda: triton_kv_store.store_kv_cache(key, key, kc, vc, slots)))
        report(f"store_kv_cache {n} tokens torch reference",
               bench(lambda: ref.store_kv_cache(key, key, kc, vc, slots)))
    try:
        from rlserve.ops import fused_ref, triton_fused
        x = torch.randn(8192, 1024, device="cuda", dtype=DTYPE)
        r = torch.randn_like(x)
        w = torch.randn(1024, device="cuda", dtype=DTYPE)
        report("fused_add_rms_norm 8192x1024 triton",
               bench(lambda: triton_fused.fused_add_rms_norm(x, r, w, 1e-6)))
        report("fused_add_rms_norm 8192x1024 torch",
               bench(lambda: fused_ref.fused_add_rms_norm(x, r, w, 1e-6)))
        y = torch.randn(8192, 2 * 3072, device="cuda", dtype=DTYPE)
        report("silu_and_mul 8192x3072 triton", bench(lambda: triton_fused.silu_and_mul(y)))
        report("silu_and_mul 8192x3072 torch", bench(lambda: fused_ref.silu_and_mul(y)))
    except ImportError as e:
        print(f"fused ops skipped: {e}")

    bench_sampling(report)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
