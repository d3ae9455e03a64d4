"""The kernel set a model runs on: the torch references, the Triton kernels, or the
batch-invariant ops (ops/batch_invariant.py, `--batch-invariant`).

Chosen once, when the worker is built (`select`), logged, and bound to the model's layers
(`bind`); no op decides per call. `RLSERVE_KERNELS=torch|triton` overrides the default
(Triton on CUDA where it imports, the torch references elsewhere). The torch set is the
oracle the Triton kernels are tested against (tests/gpu/test_triton_*.py), and it is also
what production runs on the CPU: one copy of each reference.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlserve import envs
from rlserve.ops import attention as attention_ref
from rlserve.ops import fused_ref
from rlserve.ops import moe as moe_ref
from rlserve.ops.self_check import passes

logger = logging.getLogger(__name__)

ENV = envs.RLSERVE_KERNELS.name
CHOICES = ("torch", "triton")


@dataclass(frozen=True)
class Kernels:
    """The ops a model's forward pass and the sampler call."""

    name: str
    # fp8 caches also take k_scale=, v_scale= (ops/attention.py)
    store_kv_cache: Callable[..., None]  # (key, value, k_cache, v_cache, slot_mapping)
    paged_attention: Callable[..., torch.Tensor]  # (query, k_cache, v_cache, meta, scale)
    rms_norm: Callable[..., torch.Tensor]  # (x, weight, eps)
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (x, residual, weight, eps)
    silu_and_mul: Callable[..., torch.Tensor]  # (x)
    # y += LoRA deltas in place: (y, x, a, b, slices, slice_table, LoRABatch); see ops/lora.py
    lora: Callable[..., None]
    # Routed experts: (x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights, topk_ids) -> [T, H]
    fused_moe: Callable[..., torch.Tensor]
    # x @ weight.T + bias for every projection and the LM head: (x, weight, bias)
    linear: Callable[..., torch.Tensor] = F.linear
    # The MoE router: (logits [T, E], top_k, renormalize) -> Routing (float32 weights, int32 ids)
    route: Callable[..., moe_ref.Routing] = moe_ref.route
    # Fused rotary embedding (with the q/k norms and the KV store folded in); None: torch rotary.
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # Decode-sized projections with the op after them fused (ops/triton_decode_gemm.py);
    # None: F.linear, then that op. (x, weight, residual, norm_weight, eps) -> (normed, sum)
    linear_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    linear_silu_and_mul: Callable[..., torch.Tensor] | None = None  # (x, weight [2 I, K]) -> [.., I]
    # Gumbel-max sampling over tempered logits; None: the torch sampler.
    sample: Callable[..., torch.Tensor] | None = None
    # Every op reads only device tensors, so a decode step can be captured in a CUDA graph.
    graphs: bool = False

    def fuses_rope(self, q: torch.Tensor) -> bool:
        """Whether the fused rotary kernel takes these queries (power-of-two head_dim,
        unit stride); other shapes use the torch rotary."""
        head_dim = q.shape[-1]
        return self.rope is not None and head_dim & (head_dim - 1) == 0 and q.stride(-1) == 1


def _torch_paged_attention(query, k_cache, v_cache, meta, scale: float, k_scale=None,
                           v_scale=None) -> torch.Tensor:
    return attention_ref.paged_attention(query, k_cache, v_cache, meta.query_start_loc,
                                         meta.seq_lens, meta.block_tables, scale, k_scale, v_scale)


def _torch_lora(y, x, a, b, slices, slice_table, batch) -> None:
    from rlserve.ops.lora import lora_reference
    lora_reference(y, x, a, b, slices, batch)


TORCH = Kernels(
    name="torch",
    store_kv_cache=attention_ref.store_kv_cache,
    paged_attention=_torch_paged_attention,
    rms_norm=fused_ref.rms_norm,
    fused_add_rms_norm=fused_ref.fused_add_rms_norm,
    silu_and_mul=fused_ref.silu_and_mul,
    lora=_torch_lora,
    fused_moe=moe_ref.fused_moe,
)


def _batch_invariant(device: torch.device, dtype: torch.dtype) -> Kernels:
    """The ops of ops/batch_invariant.py. On CUDA they read only device tensors and a padded
    row changes no other row's bits (GEMM tiles from N and K, attention tiles from the
    model's shapes), so decode steps replay from CUDA graphs with the eager steps' bits;
    the KV store and the sampler are the Triton ones (a copy; a draw per row), and RMSNorm,
    rotary and SiLU-and-mul run in one launch each where they give torch's bits on the card
    (ops/invariant_fusions.py checks them at start)."""
    from rlserve.ops import batch_invariant as bi
    kernels = dataclasses.replace(
        TORCH, name="batch-invariant", paged_attention=bi.paged_attention, rms_norm=bi.rms_norm,
        fused_add_rms_norm=bi.fused_add_rms_norm, linear=bi.linear, fused_moe=bi.fused_moe, lora=bi.lora)
    if device.type != "cuda":
        return kernels
    from rlserve.ops import triton_kv_store
    from rlserve.ops.invariant_fusions import fusions
    from rlserve.ops.triton_sampling import gumbel_sample
    # The Gumbel-max draw of a row follows its own noise key (a seeded request's: from its
    # seed, sample and position), never the batch.
    kernels = dataclasses.replace(kernels, store_kv_cache=triton_kv_store.store_kv_cache, sample=gumbel_sample,
                                  graphs=True, **fusions(device, dtype))
    return _check_sampler(kernels, device)


def _triton() -> Kernels:
    from rlserve.ops import (
        triton_attention,
        triton_decode_gemm,
        triton_fused,
        triton_kv_store,
        triton_lora,
        triton_moe,
        triton_router,
    )
    from rlserve.ops.triton_rotary import rope_
    from rlserve.ops.triton_sampling import gumbel_sample

    def paged_attention(query, k_cache, v_cache, meta, scale: float, k_scale=None,
                        v_scale=None) -> torch.Tensor:
        return triton_attention.paged_attention(
            query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            scale, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
            seq_order=meta.seq_order, k_scale=k_scale, v_scale=v_scale)

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # The kernel reads rows at unit stride; a strided view (rare) takes the reference.
        if x.is_contiguous():
            return triton_fused.rms_norm(x, weight, eps)
        return fused_ref.rms_norm(x, weight, eps)

    def lora(y, x, a, b, slices, slice_table, batch) -> None:
        triton_lora.lora_shrink_expand(y, x, a, b, slices, slice_table, batch.sorted_tokens,
                                       batch.slot_starts)

    def decode_plan(plan, x: torch.Tensor, weight: torch.Tensor, n: int):
        """The decode GEMM's tiles for x @ weight.T, or None: cuBLAS (large batches,
        float32, shapes the tiles do not divide)."""
        if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype \
                or x.stride(1) != 1 or not weight.is_contiguous():
            return None
        return plan(x.shape[0], weight.shape[1], n)

    def linear_add_rms_norm(x, weight, residual, norm_weight, eps):
        plan = decode_plan(triton_decode_gemm.plan_o_down, x, weight, weight.shape[0])
        if plan is None or not residual.is_contiguous():
            return triton_fused.fused_add_rms_norm(F.linear(x, weight), residual, norm_weight, eps)
        return triton_decode_gemm.gemm_add_rms_norm(x, weight, plan, residual, norm_weight, eps)

    def linear_silu_and_mul(x, weight):
        plan = decode_plan(triton_decode_gemm.plan_gate_up, x, weight, weight.shape[0] // 2)
        if plan is None:
            return triton_fused.silu_and_mul(F.linear(x, weight))
        return triton_decode_gemm.decode_gemm(x, weight, plan, gated=True)

    return Kernels(name="triton", store_kv_cache=triton_kv_store.store_kv_cache,
                   paged_attention=paged_attention, rms_norm=rms_norm,
                   fused_add_rms_norm=triton_fused.fused_add_rms_norm,
                   silu_and_mul=triton_fused.silu_and_mul, lora=lora, rope=rope_,
                   fused_moe=triton_moe.fused_moe, route=triton_router.route,
                   linear_add_rms_norm=linear_add_rms_norm, linear_silu_and_mul=linear_silu_and_mul,
                   sample=gumbel_sample, graphs=True)


def _check_sampler(kernels: Kernels, device: torch.device) -> Kernels:
    """Run the sampling kernel once on a known case (it is the most sensitive to the Triton
    version's random-number primitives); torch's sampler where it fails."""
    sample = kernels.sample
    if sample is None:
        return kernels

    def check() -> str | None:
        logits = torch.full((2, 300), -30.0, device=device)
        logits[:, 257] = 30.0
        drawn = sample(logits, torch.ones(2, device=device), torch.tensor([1, 2], device=device)).tolist()
        return None if drawn == [257, 257] else f"drew {drawn} where only token 257 is possible"

    if passes("triton_sampling.gumbel_sample", check, "sampling falls back to the torch sampler"):
        return kernels
    return dataclasses.replace(kernels, sample=None)


def check_router(kernels: Kernels, device: torch.device, experts: int, top_k: int) -> Kernels:
    """Route random rows of a model's shape (`experts`, `top_k`) with the kernel set's router
    and with torch's: the same experts and weights, or torch's router, loudly (a wrong route
    is a wrong token, and nothing downstream would notice). Run once for an MoE model, so a
    dense one compiles no router. float32 logits: no ties, whose order torch.topk leaves open."""
    if kernels.route is moe_ref.route:
        return kernels
    gen = torch.Generator(device=device).manual_seed(0)

    def check() -> str | None:
        for rows in (1, 97):
            logits = torch.randn(rows, experts, device=device, generator=gen)
            got, want = kernels.route(logits, top_k, True), moe_ref.route(logits, top_k, True)
            if not (torch.equal(got.ids, want.ids) and torch.allclose(got.weights, want.weights, rtol=1e-5, atol=1e-6)):
                return f"{rows} rows of {experts} experts, top-{top_k}: other experts or weights than torch's"
        return None

    if passes("triton_router.route", check, "MoE models route with torch"):
        return kernels
    return dataclasses.replace(kernels, route=moe_ref.route)


def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select(device: torch.device, choice: str | None = None, batch_invariant: bool = False,
           dtype: torch.dtype = torch.bfloat16) -> Kernels:
    """The kernel set for a model on `device`: `choice`, else $RLSERVE_KERNELS, else
    Triton on CUDA (when it imports) and torch elsewhere. `batch_invariant`: the ops of
    ops/batch_invariant.py, whatever the device (they take precedence over `choice`), their
    one-launch kernels checked in the model's `dtype`."""
    if batch_invariant:
        kernels = _batch_invariant(device, dtype)
        logger.info("kernels: %s on %s", kernels.name, device)
        return kernels
    choice = (choice or envs.RLSERVE_KERNELS.get() or "").strip().lower() or None
    if choice is not None and choice not in CHOICES:
        raise ValueError(f"{ENV}: must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice is None:
        choice = "triton" if device.type == "cuda" and _triton_imports() else "torch"
    if choice == "torch":
        kernels = TORCH
    else:
        if device.type != "cuda":
            raise ValueError(f"{ENV}=triton: the Triton kernels need a CUDA device, the model is on {device}")
        kernels = _check_sampler(_triton(), device)
    logger.info("kernels: %s on %s%s", kernels.name, device,
                "" if kernels.sample is not None or kernels.name == "torch" else " (torch sampler)")
    return kernels


def bind(model: torch.nn.Module, kernels: Kernels) -> None:
    """Give every layer of `model` the kernel set it calls."""
    for module in model.modules():
        if hasattr(type(module), "kernels"):
            # A plain attribute: nn.Module's stubs type attribute assignment as tensors and modules.
            module.kernels = kernels  # type: ignore[assignment]
