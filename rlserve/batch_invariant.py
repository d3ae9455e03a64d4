"""The trainer's half of batch-invariant serving: the same ops under a training forward.

    import rlserve.batch_invariant
    with rlserve.batch_invariant.enabled():
        logits = model(input_ids).logits          # a transformers Llama / SmolLM2 / Qwen3
        logprobs = logits.float().log_softmax(-1)

gives, for each token, the bits the server in `--batch-invariant` mode returned as its
logprob, for the same weights and tokens: the trainer/rollout ratio is exactly 1 before the
first update. Inside the block, F.linear, F.scaled_dot_product_attention, log_softmax over
the last dimension and a mean over it with keepdim (RMSNorm's) run the ops of
rlserve/ops/batch_invariant.py, registered here as torch.library ops (`rlserve::bi_linear`,
`rlserve::bi_attention`, `rlserve::bi_log_softmax`, `rlserve::bi_row_mean`) with autograd;
their backward is plain torch. The rest of RMSNorm, rotary embedding, SiLU and the residual
adds are transformers' own code, the same elementwise arithmetic as the server's.

Limits: the model must use transformers' "sdpa" attention (the default), without dropout;
sequences are unpadded or right-padded (positions start at 0); float32 on CPU.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from rlserve.ops import batch_invariant as ops

__all__ = ["enabled", "linear", "attention", "log_softmax", "row_mean"]


@torch.library.custom_op("rlserve::bi_linear", mutates_args=())
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return ops.linear(x, weight, bias)


@_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    g = grad.reshape(-1, grad.shape[-1])
    gx = (g @ weight).reshape(x.shape)
    gw = g.t() @ x.reshape(-1, x.shape[-1])
    return gx, gw, g.sum(0) if ctx.has_bias else None


_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


@torch.library.custom_op("rlserve::bi_attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
               visible: torch.Tensor | None) -> torch.Tensor:
    return ops.attention(q, k, v, q_start, scale, visible)


@_attention.register_fake
def _(q, k, v, q_start, scale, visible):
    return torch.empty_like(q)


def _attention_reference(q, k, v, q_start: int, scale: float, visible):
    """Plain masked softmax attention, for the backward: [M, H, D] -> [M, H, D]."""
    heads = q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    s = torch.einsum("mhd,lhd->hml", q, k) * scale
    if visible is None:
        qpos = torch.arange(q.shape[0], device=q.device) + q_start
        visible = torch.arange(k.shape[0], device=q.device)[None, :] <= qpos[:, None]
    p = torch.softmax(s.masked_fill(~visible[None], float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("hml,lhd->mhd", p, v)


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, q_start, scale, visible = inputs
    ctx.save_for_backward(q, k, v)
    ctx.q_start, ctx.scale, ctx.visible = q_start, scale, visible


def _attention_backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = _attention_reference(*leaves, ctx.q_start, ctx.scale, ctx.visible)
        gq, gk, gv = torch.autograd.grad(out, leaves, grad)
    return gq, gk, gv, None, None, None


_attention.register_autograd(_attention_backward, setup_context=_attention_setup)


@torch.library.custom_op("rlserve::bi_log_softmax", mutates_args=())
def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    return ops.log_softmax(x)


@_log_softmax.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.float32)


def _log_softmax_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output)
    ctx.dtype = inputs[0].dtype


def _log_softmax_backward(ctx, grad):
    (out,) = ctx.saved_tensors
    return (grad - out.exp() * grad.sum(-1, keepdim=True)).to(ctx.dtype)


_log_softmax.register_autograd(_log_softmax_backward, setup_context=_log_softmax_setup)

@torch.library.custom_op("rlserve::bi_row_mean", mutates_args=())
def _row_mean(x: torch.Tensor) -> torch.Tensor:
    return ops.row_mean(x)


@_row_mean.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], 1))


def _row_mean_setup(ctx, inputs, output) -> None:
    ctx.shape = inputs[0].shape


def _row_mean_backward(ctx, grad):
    return (grad / ctx.shape[-1]).expand(ctx.shape).contiguous()


_row_mean.register_autograd(_row_mean_backward, setup_context=_row_mean_setup)

# The public names: the ops as a trainer may also call them directly.
row_mean = torch.ops.rlserve.bi_row_mean
linear = torch.ops.rlserve.bi_linear
attention = torch.ops.rlserve.bi_attention
log_softmax = torch.ops.rlserve.bi_log_softmax


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    """F.scaled_dot_product_attention on [B, H, T, D] as one `bi_attention` per sequence."""
    if dropout_p:
        raise ValueError("rlserve.batch_invariant: attention dropout is not supported (dropout_p=0)")
    batch, _, length, dim = query.shape
    kv_length = key.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    if attn_mask is None and not is_causal and length > 1:
        raise ValueError("rlserve.batch_invariant: only causal attention is supported")
    outs = []
    for b in range(batch):
        visible = None
        if attn_mask is not None:
            m = attn_mask[b if attn_mask.shape[0] > 1 else 0]
            if m.dim() == 3:
                m = m[0]  # one mask for every head, as transformers builds it
            m = m.expand(length, kv_length)
            if m.dtype != torch.bool:
                masked = m <= torch.finfo(m.dtype).min
                if not bool(((m == 0) | masked).all()):
                    raise ValueError("rlserve.batch_invariant: additive attention biases are not supported")
                m = ~masked
            visible = m
        out = attention(query[b].transpose(0, 1), key[b].transpose(0, 1), value[b].transpose(0, 1),
                        kv_length - length, float(scale), visible)
        outs.append(out.transpose(0, 1))
    return torch.stack(outs)


def _log_softmax_call(func, x, *rest, **kwargs):
    """log_softmax over the last dimension in float32 as `bi_log_softmax`; None: another call."""
    dim = rest[0] if rest else kwargs.get("dim")
    dtype = kwargs.get("dtype")
    if dtype is None and len(rest) > (2 if func is F.log_softmax else 1):
        dtype = rest[-1]
    if dim is None or dim not in (-1, x.dim() - 1) or (dtype is not None and dtype != torch.float32):
        return None
    out = log_softmax(x)
    return out if dtype is not None or x.dtype == torch.float32 else out.to(x.dtype)


def _row_mean_call(x, *rest, **kwargs):
    """x.mean(-1, keepdim=True) (RMSNorm's) as `bi_row_mean`; None: another call."""
    dim = rest[0] if rest else kwargs.get("dim")
    keepdim = rest[1] if len(rest) > 1 else kwargs.get("keepdim", False)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if not keepdim or kwargs.get("dtype") is not None or dim not in (-1, x.dim() - 1):
        return None
    return row_mean(x)


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            return linear(x, weight, rest[0] if rest else kwargs.get("bias"))
        if func is F.scaled_dot_product_attention:
            return _sdpa(*args, **kwargs)
        if func in (torch.log_softmax, F.log_softmax, torch.Tensor.log_softmax):
            x, *rest = args
            out = _log_softmax_call(func, x, *rest, **kwargs)
            if out is not None:
                return out
        if func in (torch.mean, torch.Tensor.mean) and args:
            out = _row_mean_call(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Within the block, a transformers model's forward (and the log_softmax after it) runs
    the batch-invariant ops: see the module docstring."""
    with _Mode():
        yield
