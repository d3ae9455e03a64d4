"""Triton kernels for the paged KV cache: same contract as rlserve.ops.attention.

Importing this module imports triton; callers import it lazily, only on CUDA.

Nothing here reads GPU tensors on the host: launch grids come from shapes and from the
optional host-side hints `max_query_len` / `max_seq_len`, so the decode path can be
captured in a CUDA graph. Without the hints, safe upper bounds are used (programs with
nothing to do exit at once).

Attention kernel: one program per (query tile, sequence, kv head[, kv split]). A query tile
packs BLOCK_Q tokens x all query heads sharing the kv head into the rows of one matrix, so
each K/V tile is loaded once per kv head (GQA packing) and fed to tensor-core dots. Keys are
gathered through the block table in tiles of BLOCK_N positions independent of the cache's
block size. Softmax is online, in fp32, base 2. Keys below a tile's first query position
need no causal mask and run in an unmasked loop, the rest in a masked one; decode calls
(one query token a sequence) see every key and run a single loop masked only at the end.

fp8 caches are read as bytes and widened in registers (values by the conversion instruction
itself where there is one, see widen_values), each key's and value's row scale applied to
the score's column and to p (ops/attention.py has the format).

Launch order matters for decode, which is bound by reading the cache: programs of one
sequence's kv heads are neighbours (they read neighbouring bytes of the same cache rows),
and with `seq_order` the longest sequences start first, so no long one is left running
alone at the end (benchmarks/decode_sweep.py: 288 -> 265 us for 256 sequences of 100 to
2,000 tokens on an H200, 4.3 TB/s).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rlserve.ops import triton_pdl
from rlserve.ops.attention import FP8_DTYPES, fp8_max
from rlserve.ops.attention import MIN_SCALE as MIN_SCALE_F
from rlserve.ops.triton_pdl import release_next

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32, *FP8_DTYPES)


# ----------------------------------------------------------------------------- store


MIN_SCALE = tl.constexpr(MIN_SCALE_F)


@triton.jit
def fp8_scale(amax, LIMIT: tl.constexpr):
    """Scale of fp8 rows whose largest magnitude is amax (ops/attention.quantize_fp8)."""
    return tl.maximum(amax * (1.0 / LIMIT), MIN_SCALE)


@triton.jit
def fp8_rows(x, scale, fp8_ty: tl.constexpr, LIMIT: tl.constexpr):
    """x [rows, cols] / scale [rows], saturated, in fp8. Division and cast round to
    nearest (even), as torch's do, so the stored bytes equal the reference's."""
    y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale[:, None]), -LIMIT, LIMIT)
    return y.to(fp8_ty, fp_downcast_rounding="rtne")


def fp8_limit(cache: torch.Tensor) -> float:
    """A cache's LIMIT for the kernels: its format's largest value; 0.0 for other types."""
    return fp8_max(cache.dtype) or 0.0


def scale_args(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
               dummy: torch.Tensor) -> tuple:
    """(k_scale, v_scale, block stride, slot stride) for a kernel; any pointers and zero
    strides for caches without scales."""
    if cache.dtype not in FP8_DTYPES:
        return dummy, dummy, 0, 0
    assert k_scale is not None and v_scale is not None, "fp8 caches need their scales"
    assert k_scale.shape == cache.shape[:3] and k_scale.dtype == torch.float32
    assert v_scale.stride() == k_scale.stride() and k_scale.stride(2) == 1
    return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ks_ptr, vs_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_sb, stride_ss,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, LIMIT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(value_ptr + t64 * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    if LIMIT > 0:  # fp8: one scale per head row
        ks = fp8_scale(tl.max(tl.abs(k.to(tl.float32)), 1), LIMIT)
        vs = fp8_scale(tl.max(tl.abs(v.to(tl.float32)), 1), LIMIT)
        hs = tl.arange(0, BLOCK_H)
        tl.store(ks_ptr + blk * stride_sb + off * stride_ss + hs, ks, mask=hs < NUM_KV_HEADS)
        tl.store(vs_ptr + blk * stride_sb + off * stride_ss + hs, vs, mask=hs < NUM_KV_HEADS)
        k_out = fp8_rows(k, ks, k_cache_ptr.dtype.element_ty, LIMIT)
        v_out = fp8_rows(v, vs, v_cache_ptr.dtype.element_ty, LIMIT)
    else:
        k_out = k.to(k_cache_ptr.dtype.element_ty)
        v_out = v.to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d, k_out, mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d, v_out, mask=mask)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into their cache slots (-1: skip);
    fp8 caches also get each row's scale in k_scale / v_scale (see ops/attention.py)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_last_dim(key, value, k_cache, v_cache)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), "cache/key shape mismatch"
    assert slot_mapping.shape[0] >= num_tokens
    ks, vs, stride_sb, stride_ss = scale_args(k_cache, k_scale, v_scale, key)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, ks, vs,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_sb, stride_ss,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        LIMIT=fp8_limit(k_cache), num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )


# ------------------------------------------------------------------------- attention


@triton.jit
def _dim_mask(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    # A constant-true mask when head_dim needs no padding keeps the loads vectorized.
    if HEAD_DIM == BLOCK_D:
        return tl.full([BLOCK_D], 1, dtype=tl.int1)
    else:
        return tl.arange(0, BLOCK_D) < HEAD_DIM


@triton.jit
def widen_values(v, dtype: tl.constexpr, ASM: tl.constexpr):
    """An fp8 value tile in the dots' type. The PV dot reduces over keys, which are not
    the cache's contiguous axis: widened by `.to`, Triton folds the conversion into the
    dot-operand load and gathers the tile from shared memory a byte at a time (8-bit data
    has no transposing ldmatrix). ASM widens it with an opaque instruction instead (sm_89+,
    float16 only), so the tile is widened where it lies and reaches the dot as 16-bit
    values through a transposing ldmatrix."""
    if ASM:
        if v.dtype == tl.float8e5:
            cvt: tl.constexpr = "cvt.rn.f16x2.e5m2x2"
        else:  # Triton reads the constexpr annotation on each assignment: both keep it
            cvt: tl.constexpr = "cvt.rn.f16x2.e4m3x2"  # type: ignore[no-redef]
        # Four bytes in, two f16x2 out; not pure, or the conversion is folded back.
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; " + cvt + " $0, lo; " + cvt + " $1, hi; }",
            "=r,=r,r", [v], dtype=tl.float16, is_pure=False, pack=4)
    else:
        return v.to(dtype)


@triton.jit
def _attn_tiles(
    acc, l_i, m_i, q, q_pos, lo, hi, kv_end,
    k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, ks_ptr, vs_ptr, stride_sb, stride_ss,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    scale_log2,
    MASKED: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr, KV_FP8: tl.constexpr, V_ASM: tl.constexpr,
):
    d = tl.arange(0, BLOCK_D)
    d_ok = _dim_mask(HEAD_DIM, BLOCK_D)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        if MASKED:  # 1: keys past kv_end and causal masks; 2: keys past kv_end only
            j_ok = j < kv_end
            phys = tl.load(bt_row_ptr + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
            ld_mask = j_ok[:, None] & d_ok[None, :]
        else:
            phys = tl.load(bt_row_ptr + j // BLOCK_SIZE).to(tl.int64)
            ld_mask = d_ok[None, :]
        off = j % BLOCK_SIZE
        k = tl.load(k_cache_ptr + phys[:, None] * stride_kb + off[:, None] * stride_ks
                    + kvh * stride_kh + d[None, :], mask=ld_mask, other=0.0)
        if KV_FP8:  # widened in registers; the rows' scales apply to the dot's columns
            k = k.to(q.dtype)
            sc = phys * stride_sb + off * stride_ss + kvh
            if MASKED:
                ks = tl.load(ks_ptr + sc, mask=j_ok, other=0.0)
                vs = tl.load(vs_ptr + sc, mask=j_ok, other=0.0)
            else:
                ks = tl.load(ks_ptr + sc)
                vs = tl.load(vs_ptr + sc)
        if DOT_F32:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if KV_FP8:
            qk = qk * (ks * scale_log2)[None, :]
        else:
            qk = qk * scale_log2
        if MASKED == 1:
            visible = (j[None, :] <= q_pos[:, None]) & j_ok[None, :]
            qk = tl.where(visible, qk, float("-inf"))
        elif MASKED == 2:
            qk = tl.where(j_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + phys[:, None] * stride_vb + off[:, None] * stride_vs
                    + kvh * stride_vh + d[None, :], mask=ld_mask, other=0.0)
        if KV_FP8:  # the values' scales weight p; the normaliser l_i sums p unscaled
            v = widen_values(v, q.dtype, V_ASM)
            pw = p * vs[None, :]
        else:
            pw = p
        if DOT_F32:
            pv = tl.dot(pw, v.to(tl.float32), input_precision=PRECISION)
        else:
            pv = tl.dot(pw.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


# The block-table width follows the batch's longest sequence: specialising on it would
# compile new variants mid-run.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qsl_ptr, seq_lens_ptr, bt_ptr, order_ptr, ks_ptr, vs_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_sb, stride_ss, stride_bt, num_heads,
    # The cache's strides follow from block size, kv heads and head_dim alone: constants
    # for a model, so they cost no recompiles, and K and V share their offset arithmetic.
    stride_kb: tl.constexpr, stride_ks: tl.constexpr, stride_kh: tl.constexpr,
    stride_vb: tl.constexpr, stride_vs: tl.constexpr, stride_vh: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr, KV_FP8: tl.constexpr, Q_F16: tl.constexpr, HEADS_FIRST: tl.constexpr,
    ORDERED: tl.constexpr, DECODE: tl.constexpr, PDL: tl.constexpr, V_ASM: tl.constexpr,
    INVARIANT: tl.constexpr,
):
    release_next(PDL)  # o_proj's decode GEMM launches early and waits (triton_pdl)
    if HEADS_FIRST:
        # Neighbouring programs read the neighbouring heads of the same cache rows.
        kvh = tl.program_id(0)
        pid = tl.program_id(1)
        b = tl.program_id(2)
        num_tiles = tl.num_programs(1) // NUM_SPLITS
    else:
        pid = tl.program_id(0)
        b = tl.program_id(1)
        kvh = tl.program_id(2)
        num_tiles = tl.num_programs(0) // NUM_SPLITS
    if ORDERED:
        # Programs start in launch order: the longest sequences first balance the tail.
        b = tl.load(order_ptr + b)
    # Last query tiles (the longest causal rows) first, for better tail balance.
    tile = num_tiles - 1 - pid // NUM_SPLITS
    split = pid % NUM_SPLITS

    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    t0 = tile * BLOCK_Q
    if t0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GROUP_PAD
    hq = rows % GROUP_PAD
    row_ok = (tok < q_len) & (hq < GROUP)
    head = kvh * GROUP + hq
    d = tl.arange(0, BLOCK_D)
    d_ok = _dim_mask(HEAD_DIM, BLOCK_D)
    tok_g = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + tok_g[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if Q_F16:
        # fp8 caches with half-precision queries compute in float16: it holds every fp8
        # value exactly, and widening to it is cheaper than to bfloat16 (decode attention
        # 14% faster on an H200, benchmarks/RESULTS.md).
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    elif not KV_FP8:  # float32 queries read an fp8 cache in float32
        q = q.to(k_cache_ptr.dtype.element_ty)
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = ctx + tok

    # Keys this tile can see end at the last row's position; keys below the first row's
    # position (rounded down to a tile) are visible to every row and need no mask.
    kv_end = ctx + tl.minimum(t0 + BLOCK_Q, q_len)
    full_end = ((ctx + t0 + 1) // BLOCK_N) * BLOCK_N
    if NUM_SPLITS == 1:
        lo = 0
        unmasked_lo = 0
        unmasked_hi = full_end
        masked_lo = full_end
        hi = kv_end
    else:
        chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kv_end)
        unmasked_lo = lo
        unmasked_hi = tl.minimum(hi, full_end)
        masked_lo = tl.maximum(lo, full_end)

    # Finite start so rows that see nothing in this split stay NaN-free.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_bt
    if INVARIANT:
        # Batch-invariant mode (NUM_SPLITS 1): every key tile from position 0 in order, all
        # through the one masked loop, in decode, prefill and chunks alike, so a row's
        # arithmetic follows its position alone. A tile past a row's position leaves its
        # state exactly as it was (alpha 1.0, p 0.0).
        acc, l_i, m_i = _attn_tiles(
            acc, l_i, m_i, q, q_pos, 0, kv_end, kv_end,
            k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, ks_ptr, vs_ptr, stride_sb, stride_ss,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2,
            1, BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, PRECISION, DOT_F32, KV_FP8, V_ASM)
    elif DECODE:
        # One query token: every key below kv_end is visible, so one loop whose only mask
        # is the end. The two loops below keep both pipelines' values live at once (152
        # registers a thread against 118 compiled for sm_90; ncu read 168 on an H200,
        # six programs a SM where the register file holds eight of the minimal kernel's).
        acc, l_i, m_i = _attn_tiles(
            acc, l_i, m_i, q, q_pos, lo, hi, hi,
            k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, ks_ptr, vs_ptr, stride_sb, stride_ss,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2,
            2, BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, PRECISION, DOT_F32, KV_FP8, V_ASM)
    else:
        acc, l_i, m_i = _attn_tiles(
            acc, l_i, m_i, q, q_pos, unmasked_lo, unmasked_hi, kv_end,
            k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, ks_ptr, vs_ptr, stride_sb, stride_ss,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2,
            0, BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, PRECISION, DOT_F32, KV_FP8, V_ASM)
        acc, l_i, m_i = _attn_tiles(
            acc, l_i, m_i, q, q_pos, masked_lo, hi, kv_end,
            k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, ks_ptr, vs_ptr, stride_sb, stride_ss,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2,
            1, BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, PRECISION, DOT_F32, KV_FP8, V_ASM)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + tok_g[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials: [tokens, heads, splits, head_dim] fp32 and log2-sum-exp [tokens, heads, splits].
        part = (tok_g * num_heads + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], o, mask=mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_heads,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    base = (t * num_heads + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)
    w = tl.where(s_ok, w, 0.0)
    o = tl.load(part_out_ptr + (base + s)[:, None] * BLOCK_D + d[None, :],
                mask=s_ok[:, None], other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _has_fp8_cvt(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _fp8_cvt(device: torch.device) -> bool:
    """Whether `device` has the fp8-to-f16x2 conversion instruction (sm_89 and later)."""
    return device.type == "cuda" and _has_fp8_cvt(_cuda_index(device))


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # interpreter runs: any small number
    return _num_sms(_cuda_index(device))


# Shared memory the decode tile's pipelined K/V stages may take (an H200 SM has 228 KB).
_STAGES_BYTES = 200 * 1024


def _pick_config(max_query_len: int, group_pad: int, head_dim: int, num_seqs: int,
                 block_size: int, itemsize: int) -> dict:
    """Tile shape from host-side sizes only (no device reads); tuned on an H200, bf16
    (benchmarks/decode_sweep.py). A CUDA graph is captured per batch size, so the decode
    tile may follow the number of sequences."""
    if max_query_len * group_pad > 16:  # prefill and mixed steps
        return dict(BLOCK_M=max(64, group_pad), BLOCK_N=64, num_warps=4, num_stages=2)
    # Decode (and tiny chunks): memory bound, small M.
    if itemsize == 1:  # fp8: wide key tiles, the best at every batch size measured
        block_n, warps, stages = 128, 4, 2
    elif block_size >= 128:  # a key tile inside one block: one block-table read per tile
        block_n, warps, stages = 64, 4, 2
    elif num_seqs > 160:  # many programs: smaller tiles, more of them resident per SM
        block_n, warps, stages = 32, 2, 3
    elif num_seqs > 96:
        block_n, warps, stages = 64, 2, 3
    else:  # few, long sequences late in a run: larger tiles per program
        block_n, warps, stages = 128, 4, 3
    # Wider heads or float32 caches: narrower key tiles, so the stages still fit.
    block_d = triton.next_power_of_2(head_dim)
    while block_n > 16 and 2 * block_n * block_d * itemsize * stages > _STAGES_BYTES:
        block_n //= 2
    return dict(BLOCK_M=max(16, group_pad), BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def invariant_config(group_pad: int, head_dim: int, itemsize: int) -> dict:
    """The batch-invariant mode's one tile shape, from the model's shapes alone: the same
    for decode, prefill and chunks, whatever the batch (so the same dot instructions and
    the same key tiles for every row). 64 keys a tile; wider heads narrower tiles, as
    _pick_config fits its stages."""
    block_n, stages = 64, 2
    block_d = triton.next_power_of_2(head_dim)
    while block_n > 16 and 2 * block_n * block_d * itemsize * stages > _STAGES_BYTES:
        block_n //= 2
    return dict(BLOCK_M=max(64, group_pad), BLOCK_N=block_n, num_warps=4, num_stages=stages)


def _pick_splits(num_seqs: int, num_kv_heads: int, q_tiles: int, max_ctx: int,
                 device: torch.device) -> int:
    """Flash-decoding: split the keys when too few programs would fill the GPU."""
    if q_tiles != 1 or max_ctx <= 1024:
        return 1
    programs = num_seqs * num_kv_heads
    target = 2 * _sm_count(device)
    if programs >= target:
        return 1
    splits = min(triton.cdiv(target, programs), triton.cdiv(max_ctx, 512), 16)
    return max(1, splits)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float, *,
                    max_query_len: int | None = None, max_seq_len: int | None = None,
                    out: torch.Tensor | None = None, num_kv_splits: int | None = None,
                    seq_order: torch.Tensor | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    batch_invariant: bool = False, _config: dict | None = None) -> torch.Tensor:
    """Causal attention of query [num_tokens, num_heads, head_dim] against the paged cache.

    max_query_len / max_seq_len: host-side upper bounds for the batch (defaults: the number
    of tokens, and the block table's capacity). out: optional preallocated output, which may
    be a strided view. num_kv_splits: force the split-KV decode path (1 disables it).
    seq_order: optional int32 permutation of the sequences, the order their programs start
    in; longest first keeps the GPU busy to the end when lengths vary. k_scale / v_scale:
    an fp8 cache's per-row scales (see ops/attention.py). batch_invariant: one tile shape,
    no KV split (`invariant_config`): a query's bits follow its sequence and position alone.
    """
    num_tokens, num_heads, head_dim = query.shape
    _check_inputs(query, k_cache, v_cache)
    if out is None:
        out = torch.empty_like(query)
    else:
        assert out.shape == query.shape and out.stride(-1) == 1
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if seq_order is not None:
        assert seq_order.shape[0] >= num_seqs and seq_order.dtype == torch.int32
    if max_query_len is None:
        max_query_len = num_tokens
    max_query_len = max(1, min(int(max_query_len), num_tokens))
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * k_cache.shape[1]
    t = _tiling(query, k_cache, num_seqs, max_query_len, int(max_seq_len), num_kv_splits, _config, batch_invariant)
    if t.splits > 1:
        part_out = torch.empty((num_tokens, num_heads, t.splits, t.block_d),
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty((num_tokens, num_heads, t.splits),
                               dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    ks, vs, stride_sb, stride_ss = scale_args(k_cache, k_scale, v_scale, query)
    _paged_attn_kernel[t.grid](
        query, k_cache, v_cache, out, part_out, part_lse,
        query_start_loc, seq_lens, block_tables, seq_order if seq_order is not None else seq_lens,
        ks, vs, scale * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), stride_sb, stride_ss,
        block_tables.stride(0), num_heads,
        stride_kb=k_cache.stride(0), stride_ks=k_cache.stride(1), stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0), stride_vs=v_cache.stride(1), stride_vh=v_cache.stride(2),
        ORDERED=seq_order is not None, PDL=triton_pdl.enabled(query.device), **t.constants,
    )
    if t.splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_heads,
            NUM_SPLITS=t.splits, SPLITS_PAD=triton.next_power_of_2(t.splits),
            HEAD_DIM=head_dim, BLOCK_D=t.block_d, num_warps=4,
        )
    return out


def _check_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads, kv_dim = k_cache.shape[1:]
    assert kv_dim == head_dim and num_heads % num_kv_heads == 0
    assert k_cache.dtype in _SUPPORTED and v_cache.dtype == k_cache.dtype
    assert block_size & (block_size - 1) == 0, "block size must be a power of two"
    _check_last_dim(query, k_cache, v_cache)


class _Tiling(NamedTuple):
    """How one paged_attention call is cut into programs (see _tiling)."""

    grid: tuple[int, int, int]
    splits: int  # KV splits per (query tile, sequence, kv head); > 1: partial results merged after
    block_d: int  # head_dim padded to a power of two
    constants: dict  # the kernel's compile-time constants and launch options


def _tiling(query: torch.Tensor, k_cache: torch.Tensor, num_seqs: int, max_query_len: int,
            max_seq_len: int, num_kv_splits: int | None, config: dict | None,
            invariant: bool = False) -> _Tiling:
    """Tiles, KV splits and grid of a call: BLOCK_Q tokens of a query tile times the query
    heads of one kv head (padded to a power of two) make a tile's BLOCK_M rows."""
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if invariant:
        cfg = invariant_config(group_pad, head_dim, k_cache.element_size())
        num_kv_splits = 1
    elif config:
        cfg = dict(config)
    else:
        cfg = _pick_config(max_query_len, group_pad, head_dim, num_seqs, block_size, k_cache.element_size())
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    block_q = max(1, block_m // group_pad)
    block_m = block_q * group_pad
    q_tiles = triton.cdiv(max_query_len, block_q)
    if num_kv_splits is None:
        num_kv_splits = _pick_splits(num_seqs, num_kv_heads, q_tiles, max_seq_len, query.device)
    splits = max(1, int(num_kv_splits))
    block_d = triton.next_power_of_2(head_dim)
    kv_fp8 = k_cache.dtype in FP8_DTYPES
    # The dots' operand type; fp8 caches: float16 for half-precision queries (see the kernel).
    compute = k_cache.dtype
    if kv_fp8:
        compute = torch.float32 if query.dtype == torch.float32 else torch.float16
    heads_first = cfg.pop("HEADS_FIRST", True)
    grid = ((num_kv_heads, q_tiles * splits, num_seqs) if heads_first
            else (q_tiles * splits, num_seqs, num_kv_heads))
    constants = dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
        PRECISION="ieee" if compute == torch.float32 else "tf32",
        # Triton's CPU interpreter mis-evaluates bf16 dots; it gets fp32 operands instead.
        DOT_F32=query.device.type == "cpu" and compute == torch.bfloat16, KV_FP8=kv_fp8,
        Q_F16=kv_fp8 and compute == torch.float16, DECODE=max_query_len == 1 and not invariant,
        INVARIANT=invariant,
        V_ASM=kv_fp8 and compute == torch.float16 and _fp8_cvt(query.device),
        HEADS_FIRST=heads_first, **cfg)
    return _Tiling(grid, splits, block_d, constants)


def _check_last_dim(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.stride(-1) == 1, "the head_dim axis must be contiguous"
