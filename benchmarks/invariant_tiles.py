"""Which launch shapes of the batch-invariant kernels keep their bits on this card, and what
each costs (a script, not a test; it needs a GPU).

The batch-invariant GEMM fixes its K walk (BLOCK_K steps in order, no split); whether the row
and column tiles, the warps and the stages also leave every output element's bits alone is a
property of the card's MMA instructions (mma.sync for small tiles, wgmma for 64 rows and more
on Hopper), so it is measured here, not assumed: every candidate against the one fixed shape,
on fresh random inputs at several row counts. The same for the attention kernel's query tile
and warps (its key tile fixed), and for a one-launch RMSNorm against the launches it replaces.

    python benchmarks/invariant_tiles.py                  # Qwen3-0.6B's shapes
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from moe_kernels import replay_us  # noqa: E402
from rlserve.ops import batch_invariant as bi  # noqa: E402
from rlserve.ops import triton_attention  # noqa: E402
from rlserve.ops import triton_batch_invariant as tbi  # noqa: E402

GEMMS = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
         "lm_head": (151936, 1024)}
ROWS = [1, 5, 37, 256, 1000]


def gemm() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = {name: (torch.randn(max(ROWS), k, device="cuda", generator=gen).bfloat16(),
                     (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16())
              for name, (n, k) in GEMMS.items()}
    want = {(name, m): tbi.linear(x[:m], w) for name, (x, w) in inputs.items() for m in ROWS}
    base = {name: replay_us(lambda x=x, w=w: tbi.linear(x[:256], w)) for name, (x, w) in inputs.items()}
    # A 4096-token prefill chunk through the four layer projections (us, summed).
    big = {name: (torch.randn(4096, w.shape[1], device="cuda", generator=gen).bfloat16(), w)
           for name, (_, w) in inputs.items() if name != "lm_head"}
    base["prefill"] = sum(replay_us(lambda x=x, w=w: tbi.linear(x, w), iters=5, calls=2) for x, w in big.values())
    print("GEMM, bf16: candidates against the fixed tiles (64 rows); us at 256 rows per projection")
    print(f"  fixed: {' '.join(f'{k} {v:.1f}' for k, v in base.items())}")
    for bm, bn, warps, stages in itertools.product((16, 32, 64, 128), (32, 64, 128, 256), (4, 8), (3, 4)):
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, warps=warps, stages=stages)
        try:
            same = all(torch.equal(tbi.linear(x[:m], w, _config=cfg), want[name, m])
                       for name, (x, w) in inputs.items() for m in ROWS)
            us = {name: replay_us(lambda x=x, w=w: tbi.linear(x[:256], w, _config=cfg))
                  for name, (x, w) in inputs.items()}
            us["prefill"] = sum(replay_us(lambda x=x, w=w: tbi.linear(x, w, _config=cfg), iters=5, calls=2)
                                for name, (x, w) in big.items())
        except Exception as e:  # a shape the card cannot launch
            print(f"  {cfg}: {type(e).__name__}")
            continue
        print(f"  {cfg}: bits {'SAME' if same else 'DIFFER'}; {' '.join(f'{k} {v:.1f}' for k, v in us.items())}",
              flush=True)


def attention() -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 16, 8, 128, 16
    seqs = 256
    lens = torch.randint(100, 1500, (seqs,))
    blocks_per = (lens + block - 1) // block
    total = int(blocks_per.sum())
    k_cache = torch.randn(total, block, kv_heads, dim, device="cuda").bfloat16()
    v_cache = torch.randn(total, block, kv_heads, dim, device="cuda").bfloat16()
    table = torch.zeros(seqs, int(blocks_per.max()), dtype=torch.int32)
    start = 0
    for i, b in enumerate(blocks_per.tolist()):
        table[i, :b] = torch.arange(start, start + b)
        start += b
    table = table.cuda()
    seq_lens = lens.to(torch.int32).cuda()
    cases = {}
    for name, q_len in (("decode", 1), ("chunk", 24)):
        q = torch.randn(seqs * q_len, heads, dim, device="cuda").bfloat16()
        qsl = torch.arange(0, seqs * q_len + 1, q_len, dtype=torch.int32, device="cuda")
        cases[name] = (q, qsl, q_len)

    def run(name: str, cfg: dict | None) -> torch.Tensor:
        q, qsl, q_len = cases[name]
        return triton_attention.paged_attention(q, k_cache, v_cache, qsl, seq_lens, table, dim ** -0.5,
                                                max_query_len=q_len, max_seq_len=int(lens.max()),
                                                batch_invariant=True, _config=cfg)

    want = {name: run(name, None) for name in cases}
    print(f"attention, bf16, {seqs} sequences of 100-1500 keys: us a decode call")
    print(f"  fixed: decode {replay_us(lambda: run('decode', None)):.1f}")
    for bm, warps, stages in itertools.product((16, 32, 64), (2, 4), (2, 3)):
        cfg = dict(BLOCK_M=bm, BLOCK_N=64, num_warps=warps, num_stages=stages)
        try:
            same = {name: torch.equal(run(name, cfg), want[name]) for name in cases}
            us = replay_us(lambda cfg=cfg: run("decode", cfg))
        except Exception as e:
            print(f"  {cfg}: {type(e).__name__}")
            continue
        print(f"  {cfg}: bits {same}; decode {us:.1f}", flush=True)


def rms_norm() -> None:
    torch.manual_seed(0)
    print("RMSNorm, bf16: one launch against ops/batch_invariant.rms_norm's launches")
    for n, rows in ((1024, 4096), (2048, 512), (576, 700), (128, 8192)):
        x = (torch.randn(rows, n, device="cuda") * 3).bfloat16()
        r = torch.randn(rows, n, device="cuda").bfloat16()
        w = (1 + torch.randn(n, device="cuda") * 0.1).bfloat16()
        want_res = x + r
        want = bi.rms_norm(want_res, w, 1e-6)
        plain = bi.rms_norm(x, w, 1e-6)
        for vec, lib in itertools.product((4, 8), (True, False)):
            got, got_res = tbi.rms_norm(x, w, 1e-6, residual=r, vec=vec, libdevice_rsqrt=lib)
            got_plain, _ = tbi.rms_norm(x, w, 1e-6, vec=vec, libdevice_rsqrt=lib)
            print(f"  n={n} rows={rows} vec={vec} libdevice {lib}: add+norm {torch.equal(got, want)}, "
                  f"residual {torch.equal(got_res, want_res)}, norm {torch.equal(got_plain, plain)}; "
                  f"us {replay_us(lambda: bi.rms_norm(x + r, w, 1e-6)):.1f} -> "
                  f"{replay_us(lambda vec=vec: tbi.rms_norm(x, w, 1e-6, residual=r, vec=vec)):.1f}", flush=True)
    qkv = torch.randn(300, 32 * 128, device="cuda").bfloat16()
    q = qkv[:, :16 * 128].view(300, 16, 128)
    w = (1 + torch.randn(128, device="cuda") * 0.1).bfloat16()
    want = bi.rms_norm(q, w, 1e-6)
    tbi.rms_norm(q, w, 1e-6, out=q)
    print(f"  per-head norm in place on a strided view: {torch.equal(q, want)}")


def elementwise() -> None:
    """The rotary kernel with torch's roundings and the exact SiLU-and-mul against torch."""
    from rlserve.model.layers import RotaryEmbedding
    from rlserve.ops import triton_fused
    from rlserve.ops.fused_ref import rotate as _rotate
    from rlserve.ops.triton_rotary import rope_
    torch.manual_seed(0)
    rot = RotaryEmbedding(128, 4096, 1_000_000.0).cuda()
    for tokens in (7, 3000):
        pos = torch.randint(0, 4096, (tokens,), device="cuda")
        qkv = torch.randn(tokens, 32 * 128, device="cuda").bfloat16()
        q, k = qkv[:, :16 * 128].view(tokens, 16, 128), qkv[:, 16 * 128:24 * 128].view(tokens, 8, 128)
        cos = rot.cos[pos].unsqueeze(1).bfloat16()
        sin = rot.sin[pos].unsqueeze(1).bfloat16()
        want_q, want_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        got_q, got_k = rope_(q.clone(), k.clone(), pos, rot.cos, rot.sin, round_each=True)
        print(f"rotary, round_each, {tokens} tokens: q {torch.equal(got_q, want_q)}, k {torch.equal(got_k, want_k)}")
        x = (torch.randn(tokens, 2 * 3072, device="cuda") * 4).bfloat16()
        want = torch.nn.functional.silu(x[:, :3072]) * x[:, 3072:]
        print(f"silu_and_mul, {tokens} rows: exact {torch.equal(triton_fused.silu_and_mul(x, exact=True), want)}, "
              f"default {torch.equal(triton_fused.silu_and_mul(x), want)}", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name())
    for part in (elementwise, rms_norm, attention, gemm):
        try:
            part()
        except Exception as e:
            print(f"{part.__name__}: {type(e).__name__}: {e}")
