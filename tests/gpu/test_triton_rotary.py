"""The rotary kernel (with Qwen3's per-head norms and the KV-cache store folded in) against
rotary then store, and the attention layers' fused and separate paths.

Needs CUDA and triton; skipped otherwise. With RLSERVE_TRITON_INTERPRET=1 the kernels run
on CPU tensors through Triton's interpreter instead.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from helpers.paged_batch import FP8, SAME, store_kv_cache
from helpers.triton_lane import DEVICE, KERNEL_MARKS, TOL, rel_err
from rlserve.ops import attention as ref
from rlserve.ops import fused_ref

pytestmark = KERNEL_MARKS


ROPE_TOL = {torch.bfloat16: 1.6e-2, torch.float32: 1e-5}  # relative, per head
MAX_POSITION = 512
NUM_BLOCKS = 6


def _qkv(num_tokens: int, hq: int, hk: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """A fused qkv projection output and its q, k, v views, as the model splits it."""
    qkv = torch.randn(num_tokens, (hq + 2 * hk) * d, generator=gen).to(dtype).to(DEVICE)
    return (qkv, *_qkv_views(qkv, hq, hk, d))


def _qkv_views(qkv: torch.Tensor, hq: int, hk: int, d: int):
    """q [T, hq, d], k and v [T, hk, d]: strided views into a fused qkv output."""
    t = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)


def _slots(num_tokens: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct slots spread over the cache, every third token -1 (not stored)."""
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    return slots.to(DEVICE)


def _nan_cache(block_size: int, hk: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((NUM_BLOCKS, block_size, hk, d), float("nan"), dtype=dtype, device=DEVICE)


def _norms(d: int, dtype: torch.dtype, gen: torch.Generator):
    w = (1 + 0.2 * torch.randn(2, d, generator=gen)).to(dtype).to(DEVICE)
    return w[0], w[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hk", [8, 2])
@pytest.mark.parametrize("d", [64, 128])
def test_rope_store_matches_rope_then_store(dtype, norm, block_size, hk, d):
    from rlserve.model.layers import RotaryEmbedding
    from rlserve.ops.fused_ref import rotate as _rotate
    from rlserve.ops.triton_rotary import rope_
    gen = torch.Generator().manual_seed(block_size * 1000 + hk * 100 + d + norm)
    t, hq = 7, 2 * hk
    rope = RotaryEmbedding(d, MAX_POSITION, 1e4).to(DEVICE)
    positions = torch.randint(0, MAX_POSITION, (t,), generator=gen).to(DEVICE)
    slots = _slots(t, block_size, gen)
    qw, kw = _norms(d, dtype, gen) if norm else (None, None)
    qkv, q, k, v = _qkv(t, hq, hk, d, dtype, gen)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    original = qkv.clone()

    # The separate kernels, on a copy.
    qkv_sep = qkv.clone()
    q_sep, k_sep, v_sep = _qkv_views(qkv_sep, hq, hk, d)
    kc_sep, vc_sep = _nan_cache(block_size, hk, d, dtype), _nan_cache(block_size, hk, d, dtype)
    rope_(q_sep, k_sep, positions, rope.cos, rope.sin, qw, kw, 1e-6)
    store_kv_cache(k_sep, v_sep, kc_sep, vc_sep, slots)

    kc, vc = _nan_cache(block_size, hk, d, dtype), _nan_cache(block_size, hk, d, dtype)
    out_q, out_k = rope_(q, k, positions, rope.cos, rope.sin, qw, kw, 1e-6,
                         v=v, k_cache=kc, v_cache=vc, slot_mapping=slots)
    assert out_q is q and out_k is k

    # Bit for bit the separate kernels: q, k in place, v untouched, the same cache.
    torch.testing.assert_close(qkv, qkv_sep, **SAME)
    torch.testing.assert_close(v, original[:, (hq + hk) * d:].view(t, hk, d), **SAME)
    torch.testing.assert_close(kc, kc_sep, **SAME)
    torch.testing.assert_close(vc, vc_sep, **SAME)

    # Only the slots of stored tokens were written; the rest of the cache is still NaN.
    written = torch.zeros(NUM_BLOCKS * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    for cache in (kc, vc):
        flat = cache.view(NUM_BLOCKS * block_size, -1)
        assert not flat[written].isnan().any()
        assert flat[~written].isnan().all()

    # The torch reference: RMSNorm as transformers, rotation in float32, the reference store.
    q0, k0, _ = _qkv_views(original, hq, hk, d)
    if norm:
        q0, k0 = fused_ref.rms_norm(q0, qw, 1e-6), fused_ref.rms_norm(k0, kw, 1e-6)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    ref_q, ref_k = _rotate(q0.float(), cos, sin), _rotate(k0.float(), cos, sin)
    kc_ref, vc_ref = (_nan_cache(block_size, hk, d, torch.float32) for _ in range(2))
    ref.store_kv_cache(ref_k, v.float(), kc_ref, vc_ref, slots)
    assert rel_err(q, ref_q) < ROPE_TOL[dtype]
    assert rel_err(k, ref_k) < ROPE_TOL[dtype]
    stored = slots >= 0
    assert rel_err(kc.flatten(0, 1)[slots[stored]], ref_k[stored]) < ROPE_TOL[dtype]
    torch.testing.assert_close(vc.float(), vc_ref, **SAME)


def _store_case(t: int, hq: int, hk: int, d: int, block_size: int, dtype: torch.dtype, gen: torch.Generator):
    """A rotary table, t positions, their cache slots and a qkv output with its views."""
    from rlserve.model.layers import RotaryEmbedding
    rope = RotaryEmbedding(d, MAX_POSITION, 1e4).to(DEVICE)
    positions = torch.randint(0, MAX_POSITION, (t,), generator=gen).to(DEVICE)
    return rope, positions, _slots(t, block_size, gen), _qkv(t, hq, hk, d, dtype, gen)


def test_rope_store_casts_to_the_cache_dtype():
    """Float32 activations into a bf16 cache, as the separate store kernel casts them."""
    from rlserve.ops.triton_rotary import rope_
    gen = torch.Generator().manual_seed(5)
    t, hq, hk, d, block_size = 5, 4, 2, 64, 16
    rope, positions, slots, (qkv, q, k, v) = _store_case(t, hq, hk, d, block_size, torch.float32, gen)
    qkv_sep = qkv.clone()
    q_sep, k_sep, v_sep = _qkv_views(qkv_sep, hq, hk, d)
    kc_sep, vc_sep = (_nan_cache(block_size, hk, d, torch.bfloat16) for _ in range(2))
    rope_(q_sep, k_sep, positions, rope.cos, rope.sin)
    store_kv_cache(k_sep, v_sep, kc_sep, vc_sep, slots)
    kc, vc = (_nan_cache(block_size, hk, d, torch.bfloat16) for _ in range(2))
    rope_(q, k, positions, rope.cos, rope.sin, v=v, k_cache=kc, v_cache=vc, slot_mapping=slots)
    torch.testing.assert_close(qkv, qkv_sep, **SAME)
    torch.testing.assert_close(kc, kc_sep, **SAME)
    torch.testing.assert_close(vc, vc_sep, **SAME)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_rope_store_into_an_fp8_cache(cache_dtype):
    """The fused rotary store writes the same bytes and scales as rotary, then the store
    kernel."""
    from rlserve.ops.triton_rotary import rope_
    gen = torch.Generator().manual_seed(11)
    t, hq, hk, d, block_size = 9, 8, 2, 128, 16
    rope, positions, slots, (qkv, q, k, v) = _store_case(t, hq, hk, d, block_size, torch.bfloat16, gen)
    v[1, 0, :3] = torch.tensor([1e5, -1e5, 5.0])
    qw, kw = _norms(d, torch.bfloat16, gen)
    qkv_sep = qkv.clone()
    q_sep, k_sep, v_sep = _qkv_views(qkv_sep, hq, hk, d)
    def scales():
        return {name: torch.full((NUM_BLOCKS, block_size, hk), float("nan"), device=DEVICE)
                for name in ("k_scale", "v_scale")}

    kc_sep, vc_sep = (_nan_cache(block_size, hk, d, cache_dtype) for _ in range(2))
    sc_sep = scales()
    rope_(q_sep, k_sep, positions, rope.cos, rope.sin, qw, kw, 1e-6)
    store_kv_cache(k_sep, v_sep, kc_sep, vc_sep, slots, **sc_sep)
    kc, vc = (_nan_cache(block_size, hk, d, cache_dtype) for _ in range(2))
    sc = scales()
    rope_(q, k, positions, rope.cos, rope.sin, qw, kw, 1e-6,
          v=v, k_cache=kc, v_cache=vc, slot_mapping=slots, **sc)
    torch.testing.assert_close(qkv, qkv_sep, **SAME)
    assert torch.equal(kc.view(torch.uint8), kc_sep.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc_sep.view(torch.uint8))
    for name in sc:
        torch.testing.assert_close(sc[name], sc_sep[name], **SAME)
    # Token 1 is stored (_slots skips every third): its row's extremes +-1e5 take the
    # format's largest value, and 5.0 in the same row survives within 2^-3.
    limit = torch.finfo(cache_dtype).max
    row = vc.flatten(0, 1)[slots[1], 0, :3].float()
    assert row[:2].tolist() == [limit, -limit]
    assert (row[2] * sc["v_scale"].flatten(0, 1)[slots[1], 0]).item() == pytest.approx(5.0, rel=2 ** -3)


def test_rope_store_with_no_tokens():
    from rlserve.model.layers import RotaryEmbedding
    from rlserve.ops.triton_rotary import rope_
    rope = RotaryEmbedding(64, MAX_POSITION, 1e4).to(DEVICE)
    _, q, k, v = _qkv(0, 2, 1, 64, torch.bfloat16, torch.Generator().manual_seed(0))
    kc, vc = (_nan_cache(16, 1, 64, torch.bfloat16) for _ in range(2))
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    rope_(q, k, empty, rope.cos, rope.sin, v=v, k_cache=kc, v_cache=vc, slot_mapping=empty)
    assert kc.isnan().all() and vc.isnan().all()


# ------------------------------------------------------------------------------ wiring


def _attention_layer(qk_norm: bool, dtype: torch.dtype, gen: torch.Generator):
    from rlserve.model.llama import LlamaAttention
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=128,
                             head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=MAX_POSITION,
                             rope_theta=1e4)
    layer = LlamaAttention(config, qkv_bias=False, o_bias=False, qk_norm=qk_norm)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen) + (1 if p.ndim == 1 else 0))
    return layer.to(DEVICE, dtype)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_llama_attention_fused_and_separate_paths_agree(qk_norm):
    """The layer's output and cache are the same whether the rotary kernel stores or not."""
    from rlserve.model import layers
    from rlserve.model.layers import AttentionMetadata
    dtype = torch.float32
    gen = torch.Generator().manual_seed(17)
    layer = _attention_layer(qk_norm, dtype, gen)
    block_size = 16
    # Two prompts from an empty cache: 5 tokens in blocks [3, 1], 3 tokens in block [4].
    seq_lens = [5, 3]
    block_tables = torch.tensor([[3, 1], [4, 0]], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    slot_mapping = torch.tensor([48, 49, 50, 51, 52, 64, 65, 66])
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(DEVICE),
        query_start_loc=torch.tensor([0, 5, 8], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE), max_query_len=5, max_seq_len=5)
    hidden = torch.randn(8, 128, generator=gen).to(DEVICE, dtype)

    from rlserve.ops.kernels import _triton, bind
    separate_stores = []
    triton = _triton()
    counting = dataclasses.replace(triton, store_kv_cache=lambda *args: separate_stores.append(1)
                                   or triton.store_kv_cache(*args))
    results = {}
    for fused in (True, False):
        # Without the rotary kernel the layer rotates in torch and stores separately.
        bind(layer, counting if fused else dataclasses.replace(counting, rope=None))
        kc, vc = (_nan_cache(block_size, 2, 64, dtype) for _ in range(2))
        layer.attn.k_cache, layer.attn.v_cache = kc, vc
        assert layers.fuse_rope_and_store(hidden, layer.attn) is fused
        separate_stores.clear()
        with torch.no_grad():
            out = layer(positions.to(DEVICE), hidden, meta)
        assert len(separate_stores) == (0 if fused else 1)
        results[fused] = out, kc, vc
    for a, b in zip(results[True], results[False]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, equal_nan=True)


def test_no_fusion_without_a_bound_cache():
    from rlserve.model.layers import PagedAttention, fuse_rope_and_store
    attn = PagedAttention(4, 2, 64, 0.125)
    q = torch.zeros(3, 4, 64, device=DEVICE)
    assert not fuse_rope_and_store(q, attn)


@pytest.mark.parametrize("rows", [5, 40])
def test_decoder_layers_on_decode_gemms_match_the_torch_kernels(rows):
    """Two Qwen3-style layers over a decode batch: with the Triton set, o_proj and
    down_proj hand split-K partial sums to the norm after them (the next layer's input
    norm, then the final one) and, at 32 rows or fewer, gate_up applies SiLU in its
    epilogue; the torch set runs the plain ops. Same hidden states, up to bf16 rounding
    of the summation order."""
    from rlserve.model.layers import AttentionMetadata
    from rlserve.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
    from rlserve.ops import triton_decode_gemm as G
    from rlserve.ops.kernels import TORCH, _triton, bind
    dtype, block_size = torch.bfloat16, 16
    config = SimpleNamespace(vocab_size=300, hidden_size=256, num_hidden_layers=2, intermediate_size=1024,
                             hidden_act="silu", rms_norm_eps=1e-6, num_attention_heads=8, num_key_value_heads=2,
                             head_dim=64, max_position_embeddings=MAX_POSITION, rope_theta=1e4)
    assert G.plan_o_down(rows, 512, 256) and G.plan_o_down(rows, 1024, 256)
    assert (G.plan_gate_up(rows, 256, 1024) is not None) == (rows <= 32)
    gen = torch.Generator().manual_seed(23)
    model = LlamaModel(config, lambda i: LlamaDecoderLayer(LlamaAttention(config, False, False, True),
                                                           LlamaMLP(config), config))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=gen) + (1 if p.ndim == 1 else 0))
    model = model.to(DEVICE, dtype)
    # One new token per sequence over an empty cache: sequence i in block i + 1.
    meta = AttentionMetadata(
        slot_mapping=torch.arange(rows, device=DEVICE) * block_size + block_size,
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.ones(rows, dtype=torch.int32, device=DEVICE),
        block_tables=torch.arange(1, rows + 1, dtype=torch.int32, device=DEVICE)[:, None],
        max_query_len=1, max_seq_len=1)
    ids = torch.randint(0, 300, (rows,), generator=gen).to(DEVICE)
    positions = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    out = {}
    for name, kernels in (("torch", TORCH), ("triton", _triton())):
        bind(model, kernels)
        for layer in model.layers:
            attn = layer.self_attn.attn
            attn.k_cache, attn.v_cache = (torch.zeros(rows + 1, block_size, 2, 64, dtype=dtype, device=DEVICE)
                                          for _ in range(2))
        with torch.no_grad():
            out[name] = model(ids, positions, meta)
    assert out["triton"].shape == (rows, 256)
    assert rel_err(out["triton"], out["torch"]) < 2 * TOL[dtype]
