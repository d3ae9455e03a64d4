"""The paged-attention kernel's device code: the causal kernel over the paged cache (decode,
prefill and chunked prefill alike, and the batch-invariant mode), and the merge of its
flash-decoding splits. triton_attention.paged_attention launches them.

One program per (query tile, sequence, kv head[, kv split]). A query tile
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

import triton
import triton.language as tl

from rlserve.ops.triton_pdl import release_next


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
def paged_attn_kernel(
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
def merge_splits_kernel(
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

