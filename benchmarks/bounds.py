"""What a workload could reach at best on a GPU: the bytes-moved bound and a roofline that
also counts the prefill's arithmetic (throughput.py prints both beside its figure).

A mixture-of-experts step reads the dense weights and only the experts its tokens are
routed to: `touched(batch)` says how many of a layer's experts a decode step of `batch`
sequences touches (measured from the model's own routing, see throughput.py), so the
bound counts those experts' bytes, not the whole model's.

The peaks are the card's own, detected from its name (`device_peak`); a card this file does
not know gets no bound unless its figures are given (`--hbm-tb-s`, `--tflops`).
A hybrid model (Qwen3.5, Qwen3-Next) keeps KV only in its full-attention layers, and each
decode step reads and writes every live sequence's linear-attention state.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import NamedTuple

# Datasheet peaks: (name pattern, HBM bytes/s, dense bf16 FLOP/s), the more specific first.
# Word boundaries keep a GH200 (an H100 with its own memory) from reading as an H200.
_PEAKS = (
    (r"\bH200 NVL\b", 4.8e12, 835e12),
    (r"\bH200\b", 4.8e12, 989e12),
    (r"\bH100 NVL\b", 3.9e12, 835e12),
    (r"\bH100 PCIe\b", 2.0e12, 756e12),
    (r"\bH100\b", 3.35e12, 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
)


class DevicePeak(NamedTuple):
    card: str  # the device's name
    hbm_bytes_per_s: float | None  # None: unknown card, no figure given
    flops_per_s: float | None  # dense bf16
    given: bool  # a figure came from the command line, not the datasheet table

    def describe(self, flops: bool = False) -> str:
        """The card and its figure(s), for the line that prints a bound."""
        tb = f"{self.hbm_bytes_per_s / 1e12:.2f} TB/s" if self.hbm_bytes_per_s else "HBM rate unknown"
        tf = f", {self.flops_per_s / 1e12:.0f} TFLOP/s" if self.flops_per_s else ", TFLOP/s unknown"
        return f"{self.card}, {tb}{tf if flops else ''}{' (given)' if self.given else ''}"


def add_peak_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hbm-tb-s", type=float, default=None,
                        help="the card's peak HBM rate in TB/s (default: from its name; H100 SXM 3.35, "
                             "H100 PCIe 2.0, H200 4.8)")
    parser.add_argument("--tflops", type=float, default=None,
                        help="the card's dense bf16 peak in TFLOP/s (default: from its name; H100 SXM 989)")


def device_peak(hbm_tb_s: float | None = None, tflops: float | None = None, card: str | None = None) -> DevicePeak:
    """The peaks of `card` (default: the current CUDA device's name); a figure given here
    replaces the table's."""
    if card is None:
        import torch
        card = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    hbm = flops = None
    for pattern, table_hbm, table_flops in _PEAKS:
        if re.search(pattern, card):
            hbm, flops = table_hbm, table_flops
            break
    return DevicePeak(card, hbm_tb_s * 1e12 if hbm_tb_s else hbm, tflops * 1e12 if tflops else flops,
                      given=bool(hbm_tb_s or tflops))


def unknown_card(peak: DevicePeak, what: str = "--hbm-tb-s") -> str:
    return f"no bound: {peak.card} is not a card benchmarks/bounds.py knows; pass {what} to print one"


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


def bound_tokens_per_s(cfg: dict, prompts, out_lens, hbm_bytes_per_s: float, dtype_bytes: int = 2,
                       kv_fp8: bool = False, touched: Callable[[int], float] | None = None,
                       n: int = 1) -> float:
    """Bytes-moved bound: each decode step reads the weights it uses once (an MoE model's
    dense weights and the experts `touched(live sequences)` per layer) and every live
    token's KV once (kv_fp8: a byte per element and a float32 scale per head row).
    `n` samples per prompt, each `out_lens[i]` long, each reading its whole context."""
    s = shape(cfg, kv_fp8, dtype_bytes)
    lens = list(map(len, prompts))
    total = 0.0
    for step in range(max(out_lens)):
        live = [p + step for p, o in zip(lens, out_lens) if o > step]
        # A hybrid's decode step also reads and writes each live sequence's state.
        total += (_step_weight_bytes(s, n * len(live), touched, dtype_bytes) + s.kv_per_token * n * sum(live)
                  + 2 * s.state_per_seq * n * len(live))
    return n * sum(out_lens) / (total / hbm_bytes_per_s)


def roofline_tokens_per_s(cfg: dict, prompts, out_lens, hbm_bytes_per_s: float, flops_per_s: float,
                          dtype_bytes: int = 2, touched: Callable[[int], float] | None = None,
                          n: int = 1) -> float:
    """The byte bound with arithmetic counted too: the prefill's FLOPs (every prompt token
    through the layers, causal attention, one LM-head row per prompt; once per prompt
    whatever its `n`) at `flops_per_s`, and each decode step at the slower of its bytes and
    its FLOPs. A larger model's prefill is compute-bound and costs seconds the byte bound
    leaves out."""
    s = shape(cfg, dtype_bytes=dtype_bytes)
    vocab_h = cfg["vocab_size"] * cfg["hidden_size"]
    lens = list(map(len, prompts))
    # QK^T and PV: 2 FLOPs a multiply-add, over the causal half of each prompt.
    prefill = sum(2 * s.active_gemm * n + 2 * vocab_h + 2 * 2 * s.attn_width * n * (n + 1) / 2 for n in lens)
    seconds = prefill / flops_per_s
    for step in range(max(out_lens)):
        contexts = [p + step for p, o in zip(lens, out_lens) if o > step]
        seqs, tokens = n * len(contexts), n * sum(contexts)
        bytes_ = (_step_weight_bytes(s, seqs, touched, dtype_bytes) + s.kv_per_token * tokens
                  + 2 * s.state_per_seq * seqs)
        flops = 2 * (s.active_gemm + vocab_h) * seqs + 2 * 2 * s.attn_width * tokens
        seconds += max(bytes_ / hbm_bytes_per_s, flops / flops_per_s)
    return n * sum(out_lens) / seconds
