"""Gated DeltaNet's recurrences (Qwen3-Next, Qwen3.5): the torch reference ops.

They run on any device, in float32, and are the oracle the GPU kernels (ops/fla.py) are
tested against. Shapes: one sequence's tokens [L, H, D] for a prefill chunk; one token per
sequence [N, H, D] for decode. The recurrent state of a value head is a matrix S [Dk, Dv]:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S~_t^T k_t))^T,   S~_t = exp(g_t) S_{t-1}
    o_t = S_t^T q_t

with q and k L2-normalised and q scaled by Dk^-1/2. The prefill form computes the same
thing a chunk of C tokens at a time (the WY representation of the chunk's C rank-one
updates: one triangular solve and a few matrix products per chunk, instead of C steps).

The short causal convolution in front of it keeps the last K-1 inputs of a sequence as its
conv state [channels, K-1].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # transformers' and the GPU kernels' chunk: the same rounding on both sides


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k per value head (several value heads may share a key head), normalised, q scaled."""
    group = num_v_heads // q.shape[-2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk of tokens. q, k [L, Hk, Dk]; v [L, H, Dv]; g, beta [L, H];
    state [H, Dk, Dv] (the state before the first token). Returns (o [L, H, Dv] float32,
    the state after the last token)."""
    length, heads = v.shape[0], v.shape[1]
    q, k = _heads(q, k, heads)
    # [H, L, D] from here on, padded to whole chunks (padding: g = 0, beta = 0, k = v = 0
    # leaves the state as it is)
    pad = -length % chunk
    q, k, v = (F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.float().transpose(0, 1), (0, pad)) for x in (g, beta))
    n = (length + pad) // chunk
    q, k, v = (x.reshape(heads, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(heads, n, chunk), beta.reshape(heads, n, chunk)
    decay = g.cumsum(-1)  # log of each position's decay since the chunk began
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # exp(decay_i - decay_j) for j <= i, else 0
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    # The chunk's updates interact through (I + A), A strictly lower: A_ij = beta_i k_i.k_j
    # decay_ij (the solve reads only the strict lower triangle; `pair` zeroes the upper)
    system = (kb @ k.transpose(-1, -2)) * pair
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * decay.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * pair  # causal, within the chunk
    q_in = q * decay.exp()[..., None]  # what the state from before the chunk contributes
    k_out = k * (decay[..., -1:] - decay).exp()[..., None]  # what each token leaves at the chunk's end
    last = decay[..., -1].exp()
    s = state.float()
    out = torch.empty_like(v)
    for c in range(n):
        fresh = u[:, c] - w[:, c] @ s  # the chunk's corrected values, given the state before it
        out[:, c] = q_in[:, c] @ s + scores[:, c] @ fresh
        s = s * last[:, c, None, None] + k_out[:, c].transpose(-1, -2) @ fresh
    out = out.reshape(heads, n * chunk, -1)[:, :length].transpose(0, 1)
    return out, s


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of N sequences. q, k [N, Hk, Dk]; v [N, H, Dv]; g, beta [N, H];
    state [N, H, Dk, Dv]. Returns (o [N, H, Dv] float32, the new states)."""
    q, k = _heads(q, k, v.shape[1])
    s = state.float() * g.float().exp()[..., None, None]
    remembered = (s * k[..., None]).sum(-2)  # S^T k
    delta = (v.float() - remembered) * beta.float()[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(-2), s


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk through the depthwise causal convolution, then SiLU.
    x [L, C]; weight [C, K]; state [C, K-1] (the inputs before the chunk). Returns
    (out [L, C], the new state)."""
    width = weight.shape[1]
    window = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K-1+L]
    out = F.conv1d(window[None], weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(out).transpose(0, 1), window[:, window.shape[1] - (width - 1):]


def conv_indices(spans: list[tuple[int, int]], width: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where `causal_conv1d_varlen` reads and writes, for sequences whose tokens sit at
    `spans` of the step's rows: its buffer holds each sequence's K-1 state rows, then its
    tokens, one sequence after another. Returns (each token's window start [T], each
    sequence's state rows [N, K-1], each sequence's last K-1 rows [N, K-1])."""
    keep = width - 1
    lengths = [end - start for start, end in spans]
    seq = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor(lengths))
    windows = torch.arange(sum(lengths)) + seq * keep
    first = torch.tensor([start for start, _ in spans]) + torch.arange(len(spans)) * keep
    rows = torch.arange(keep)
    heads = first[:, None] + rows
    tails = (first + torch.tensor(lengths))[:, None] + rows
    return windows.to(device), heads.to(device), tails.to(device)


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                         indices: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d` for every sequence of a step at once, in a fixed number of ops however
    many there are. x [T, C], the sequences' tokens one after another; weight [C, K];
    states [N, C, K-1]; `indices` from conv_indices. Returns (out [T, C], the new states)."""
    windows, heads, tails = indices
    n, channels, keep = states.shape
    ext = x.new_empty((x.shape[0] + n * keep, channels))
    ext[heads.flatten()] = states.transpose(1, 2).reshape(n * keep, channels).to(x.dtype)
    ext[windows + keep] = x
    out = ext[windows] * weight[:, 0]
    for j in range(1, weight.shape[1]):
        out = out + ext[windows + j] * weight[:, j]
    return F.silu(out), ext[tails].transpose(1, 2)


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of N sequences: x [N, C]; state [N, C, K-1]. Returns (out [N, C],
    the new states)."""
    window = torch.cat([state.to(x.dtype), x[..., None]], dim=-1)  # [N, C, K]
    out = (window * weight).sum(-1)
    return F.silu(out), window[..., 1:]
