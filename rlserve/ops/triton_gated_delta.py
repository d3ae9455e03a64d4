"""Gated DeltaNet's decode step on the state pool itself: one Triton launch a layer.

fla-core's recurrent kernel takes the states as one [N, H, Dk, Dv] batch, so a decode step
gathers each row's state from the layer's pool, zeroes the fresh ones, runs, and scatters the
result back: the pool's bytes cross the memory bus about seven times (a Qwen3.5 state is
1 MB a sequence and layer). Here each program reads one row's state tile from its slot (or
starts from zeros for a fresh sequence), applies the token, writes the tile back in place and
the token's output: twice. The q/k L2 norms, q's scale and the value heads' sharing of key
heads happen in the kernel too.

Same recurrence as ops/gated_delta.recurrent_gated_delta_rule (the reference it is tested
against), in float32:

    S = exp(g) S;  delta = beta (v - S^T k);  S = S + k delta^T;  o = S^T q
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The L2 norm's, as ops/gated_delta.l2norm (a jit function reads only constexpr globals).
_EPS = tl.constexpr(1e-6)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, fresh_ptr, out_ptr,
                   stride_qn, stride_qh, stride_vn, stride_vh, stride_gn, stride_sn, stride_sh,
                   stride_on, stride_oh, scale, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    vb = tl.program_id(2)
    kh = head // GROUP
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    km, vm = ks < DK, vs < DV
    q = tl.load(q_ptr + row * stride_qn + kh * stride_qh + ks, mask=km, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_qn + kh * stride_qh + ks, mask=km, other=0.0).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + _EPS)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + _EPS))
    v = tl.load(v_ptr + row * stride_vn + head * stride_vh + vs, mask=vm, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_gn + head).to(tl.float32)
    beta = tl.load(beta_ptr + row * stride_gn + head).to(tl.float32)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    fresh = tl.load(fresh_ptr + row)
    tile = state_ptr + slot * stride_sn + head * stride_sh + ks[:, None] * DV + vs[None, :]
    mask = km[:, None] & vm[None, :]
    # A fresh sequence starts from zeros whatever its slot held (tl.where, not a product:
    # a stale slot may hold anything).
    s = tl.where(fresh != 0, 0.0, tl.load(tile, mask=mask, other=0.0)) * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(tile, s, mask=mask)
    tl.store(out_ptr + row * stride_on + head * stride_oh + vs, tl.sum(s * q[:, None], 0), mask=vm)


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """One token of each of N sequences. q, k [N, Hk, Dk]; v [N, H, Dv]; g, beta [N, H];
    state: the layer's pool [slots, H, Dk, Dv] float32, row i's state at slots[i] (read as
    zeros where fresh[i]), updated in place. Returns o [N, H, Dv] float32."""
    n, heads, dv = v.shape
    dk = q.shape[-1]
    if state.dtype != torch.float32 or state.stride(-1) != 1 or state.stride(-2) != dv:
        raise ValueError("decode_step: the state pool must be float32 [slots, H, Dk, Dv], its last two dims dense")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if q.stride() != k.stride():
        k = k.contiguous()
        q = q.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty((n, heads, dv), dtype=torch.float32, device=v.device)
    if n:
        block_k = triton.next_power_of_2(dk)
        block_v = min(64, triton.next_power_of_2(dv))
        _decode_kernel[(n, heads, triton.cdiv(dv, block_v))](
            q, k, v, g, beta, state, slots, fresh.to(torch.int8), out,
            q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), state.stride(0), state.stride(1),
            out.stride(0), out.stride(1), dk ** -0.5, GROUP=heads // q.shape[1], DK=dk, DV=dv,
            BLOCK_K=block_k, BLOCK_V=block_v, num_warps=4)
    return out
