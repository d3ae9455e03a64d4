"""What a workload could reach at best on a GPU: the bytes-moved bound and a roofline that
also counts the prefill's arithmetic (throughput.py prints both beside its figure).

A mixture-of-experts step reads the dense weights and only the experts its tokens are
routed to: `touched(batch)` says how many of a layer's experts a decode step of `batch`
sequences touches (measured from the model's own routing, see throughput.py), so the
bound counts those experts' bytes, not the whole model's. A hybrid model (Qwen3.5,
Qwen3-Next) keeps KV only in its full-attention layers, and each decode step reads and
writes every live sequence's linear-attention state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class Shape(NamedTuple):
    dense_params: int  # read by every step: embeddings, attention, routers, dense MLPs
    expert_params: int  # one routed expert of one layer (0: a dense model)
    moe_layers: int
    active_gemm: int  # a token's GEMM parameters (attention, its experts or its dense MLP)
    kv_per_token: int  # bytes a token's KV takes over all layers
    attn_width: int  # query heads x head_dim x layers
    state_per_seq: int = 0  # a hybrid model's linear-attention state of one sequence, bytes


def _linear_layers(cfg: dict) -> int:
    """How many layers of a hybrid model (Qwen3.5, Qwen3-Next) are linear attention."""
    if "linear_num_value_heads" not in cfg:
        return 0
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        return sum(1 for i in range(cfg["num_hidden_layers"]) if (i + 1) % interval)
    return sum(t == "linear_attention" for t in types)


def _linear_attention(cfg: dict, dtype_bytes: int) -> tuple[int, int]:
    """A linear-attention layer's parameters, and one sequence's state in it (bytes): the
    conv state in the model's dtype, the recurrent state in float32 (gated_deltanet.py)."""
    h = cfg["hidden_size"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, width = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    conv = 2 * nk * dk + nv * dv
    params = h * (conv + nv * dv + 2 * nv) + nv * dv * h + conv * width
    return params, conv * (width - 1) * dtype_bytes + nv * dk * dv * 4


def shape(cfg: dict, kv_fp8: bool = False, dtype_bytes: int = 2) -> Shape:
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    linear = _linear_layers(cfg)
    full = layers - linear  # with the KV cache
    # A hybrid's full-attention q_proj also yields the output gate: twice the query rows.
    q_rows = 2 * heads if linear else heads
    attn = h * head_dim * (q_rows + 2 * kv_heads) + heads * head_dim * h
    linear_params, state = _linear_attention(cfg, dtype_bytes) if linear else (0, 0)
    mixers = full * attn + linear * linear_params
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    dense_layers = set(cfg.get("mlp_only_layers") or ())
    step = cfg.get("decoder_sparse_step") or 1
    moe_layers = sum(1 for i in range(layers) if experts and i not in dense_layers and (i + 1) % step == 0)
    expert = 3 * h * (cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0
    dense_mlp = 3 * h * cfg["intermediate_size"]
    embed = cfg["vocab_size"] * h * (1 if cfg.get("tie_word_embeddings") else 2)
    shared = 3 * h * (cfg.get("shared_expert_intermediate_size") or 0) if experts else 0
    dense = embed + mixers + (layers - moe_layers) * dense_mlp + moe_layers * (experts * h + shared)
    active = (mixers + (layers - moe_layers) * dense_mlp
              + moe_layers * (cfg.get("num_experts_per_tok", 0) * expert + shared))
    kv_per_token = 2 * full * kv_heads * (head_dim + 4 if kv_fp8 else head_dim * dtype_bytes)
    return Shape(dense, expert, moe_layers, active, kv_per_token, heads * head_dim * full, linear * state)


def _step_weight_bytes(s: Shape, batch: int, touched: Callable[[int], float] | None, dtype_bytes: int) -> float:
    experts = touched(batch) if s.moe_layers and touched else 0
    return (s.dense_params + s.moe_layers * experts * s.expert_params) * dtype_bytes


def bound_tokens_per_s(cfg: dict, prompts, out_lens, dtype_bytes: int = 2,
                       hbm_bytes_per_s: float = 4.8e12, kv_fp8: bool = False,
                       touched: Callable[[int], float] | None = None) -> float:
    """Bytes-moved bound: each decode step reads the weights it uses once (an MoE model's
    dense weights and the experts `touched(live sequences)` per layer) and every live
    token's KV once (kv_fp8: a byte per element and a float32 scale per head row)."""
    s = shape(cfg, kv_fp8, dtype_bytes)
    lens = list(map(len, prompts))
    total = 0.0
    for step in range(max(out_lens)):
        live = [p + step for p, o in zip(lens, out_lens) if o > step]
        # A hybrid's decode step also reads and writes each live sequence's state.
        total += (_step_weight_bytes(s, len(live), touched, dtype_bytes) + s.kv_per_token * sum(live)
                  + 2 * s.state_per_seq * len(live))
    return sum(out_lens) / (total / hbm_bytes_per_s)


def roofline_tokens_per_s(cfg: dict, prompts, out_lens, hbm_bytes_per_s: float = 4.8e12,
                          flops_per_s: float = 989e12, dtype_bytes: int = 2,
                          touched: Callable[[int], float] | None = None) -> float:
    """The byte bound with arithmetic counted too: the prefill's FLOPs (every prompt token
    through the layers, causal attention, one LM-head row per prompt) at `flops_per_s`,
    and each decode step at the slower of its bytes and its FLOPs. The H200's dense bf16
    peak is 989 TFLOP/s. A larger model's prefill is compute-bound and costs seconds the
    byte bound leaves out."""
    s = shape(cfg, dtype_bytes=dtype_bytes)
    vocab_h = cfg["vocab_size"] * cfg["hidden_size"]
    lens = list(map(len, prompts))
    # QK^T and PV: 2 FLOPs a multiply-add, over the causal half of each prompt.
    prefill = sum(2 * s.active_gemm * n + 2 * vocab_h + 2 * 2 * s.attn_width * n * (n + 1) / 2 for n in lens)
    seconds = prefill / flops_per_s
    for step in range(max(out_lens)):
        contexts = [p + step for p, o in zip(lens, out_lens) if o > step]
        tokens = sum(contexts)
        bytes_ = (_step_weight_bytes(s, len(contexts), touched, dtype_bytes) + s.kv_per_token * tokens
                  + 2 * s.state_per_seq * len(contexts))
        flops = 2 * (s.active_gemm + vocab_h) * len(contexts) + 2 * 2 * s.attn_width * tokens
        seconds += max(bytes_ / hbm_bytes_per_s, flops / flops_per_s)
    return sum(out_lens) / seconds
