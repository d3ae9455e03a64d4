"""The gated delta rule on CUDA through the fla-core package's Triton kernels (the
`gpu-hybrid` extra), when it is installed; rlserve/ops/gated_delta.py is the reference
they are tested against (tests/gpu/test_gpu_hybrid.py).

A step's sequences go to the kernels as one variable-length batch (`cu_seqlens`), their
states gathered into [N, H, Dk, Dv] and scattered back by the caller.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:  # not installed, or no Triton for this platform
        return False
    return True


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial: torch.Tensor, spans: list[tuple[int, int]], decode: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk]; v [T, H, Dv]; g, beta [T, H]; initial [N, H, Dk, Dv] float32;
    spans: each sequence's tokens. Returns (o [T, H, Dv], the final states, float32)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    group = v.shape[1] // q.shape[1]
    if group > 1:  # a value head's key head, spelled out
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    if decode:
        # One token a sequence: a batch of N one-token sequences, so no lengths are read
        # from the host and the step can be captured in a CUDA graph.
        q, k, v = (x.unsqueeze(1).contiguous() for x in (q, k, v))
        g, beta = g.float().unsqueeze(1).contiguous(), beta.to(q.dtype).unsqueeze(1).contiguous()
        out, final = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial.contiguous(),
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
        return out[:, 0], final.float()
    cu = torch.tensor([0] + [end for _, end in spans], dtype=torch.int32, device=q.device)
    q, k, v = (x.unsqueeze(0).contiguous() for x in (q, k, v))
    g, beta = g.float().unsqueeze(0).contiguous(), beta.to(q.dtype).unsqueeze(0).contiguous()
    out, final = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial.contiguous(),
                                        output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    return out[0], final.float()
