"""Triton kernels against the torch reference ops (attention, KV store, fused elementwise,
rotary with the KV-cache store folded in).

Needs CUDA and triton; skipped otherwise. With RLSERVE_TRITON_INTERPRET=1 the kernels run
on CPU tensors through Triton's interpreter instead (slow, so shapes stay small).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from helpers.triton_lane import DEVICE, INTERPRET, KERNEL_MARKS
from rlserve.ops import attention as ref
from rlserve.ops import fused_ref

pytestmark = KERNEL_MARKS

TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# The residual sum is bit-exact on GPU; the interpreter truncates fp32 -> bf16 instead of
# rounding to nearest, which costs up to one bf16 ulp.
EXACT = dict(rtol=2 ** -7, atol=0) if INTERPRET else dict(rtol=0, atol=0)


def _ops():
    from rlserve.ops import triton_attention
    return triton_attention


def _store_kv_cache(*args, **kwargs) -> None:
    """The Triton KV store (rlserve.ops.triton_kv_store)."""
    from rlserve.ops import triton_kv_store
    triton_kv_store.store_kv_cache(*args, **kwargs)


def _tiling(*args):
    """How a paged_attention call is cut into programs (rlserve.ops.triton_attention_tiling)."""
    from rlserve.ops import triton_attention_tiling
    return triton_attention_tiling.tiling(*args)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Worst relative error over the head vectors (a whole-tensor norm hides one bad row)."""
    a, b = a.float(), b.float()
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)
    return err.max().item()


def _make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, gen,
                extra_blocks=7, cache_dtype=None):
    """seqs: list of (cached_prefix_len, query_len); cache_dtype: the cache's, if not dtype.

    Builds a cache whose prefix tokens are already stored, the new keys/values to store this
    step, a shuffled block table padded with ids of NaN-filled blocks, and unused slots
    filled with NaN so any out-of-range read shows up in the output.
    """
    seq_lens = [p + q for p, q in seqs]
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    max_blocks = max(blocks_per_seq) + 2
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    used, spare = perm[:sum(blocks_per_seq)], perm[sum(blocks_per_seq):]
    block_tables = torch.empty((len(seqs), max_blocks), dtype=torch.int32)
    i = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = used[i:i + n].to(torch.int32)
        pad = spare[torch.randint(len(spare), (max_blocks - n,), generator=gen)]
        block_tables[b, n:] = pad.to(torch.int32)
        i += n

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=cache_dtype or dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=cache_dtype or dtype)
    scales = {}
    if k_cache.dtype in ref.FP8_DTYPES:  # fp8: a scale per row, NaN where nothing is stored
        scales = {name: torch.full(cache_shape[:3], float("nan")) for name in ("k_scale", "v_scale")}

    def slots(b, positions):
        pos = torch.as_tensor(positions, dtype=torch.int64)
        return block_tables[b].long()[pos // block_size] * block_size + pos % block_size

    new_slots, q_start = [], [0]
    for b, (p, q) in enumerate(seqs):
        if p:
            k = torch.randn(p, num_kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(p, num_kv_heads, head_dim, generator=gen).to(dtype)
            ref.store_kv_cache(k, v, k_cache, v_cache, slots(b, range(p)), **scales)
        new_slots.append(slots(b, range(p, p + q)))
        q_start.append(q_start[-1] + q)
    num_tokens = q_start[-1]
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    dev = DEVICE
    return dict(
        query=query.to(dev), key=key.to(dev), value=value.to(dev),
        k_cache=k_cache.to(dev), v_cache=v_cache.to(dev),
        slot_mapping=torch.cat(new_slots).to(dev),
        query_start_loc=torch.tensor(q_start, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=block_tables.to(dev),
        max_query_len=max(q for _, q in seqs), max_seq_len=max(seq_lens),
        scales={name: t.to(dev) for name, t in scales.items()},
    )


def _reference(batch, scale):
    """fp32 reference over a copy of the cache with the new keys stored (fp8 caches: stored
    in fp8 first, rounded and saturated as the kernels store them, then widened)."""
    kc, vc = batch["k_cache"].clone(), batch["v_cache"].clone()
    if kc.dtype in ref.FP8_DTYPES:
        scales = {name: t.clone() for name, t in batch["scales"].items()}
        ref.store_kv_cache(batch["key"], batch["value"], kc, vc, batch["slot_mapping"], **scales)
        kc, vc = ref.dequantize(kc, scales["k_scale"]), ref.dequantize(vc, scales["v_scale"])
    else:
        kc, vc = kc.float(), vc.float()
        ref.store_kv_cache(batch["key"].float(), batch["value"].float(), kc, vc,
                           batch["slot_mapping"])
    return ref.paged_attention(batch["query"].float(), kc, vc, batch["query_start_loc"],
                               batch["seq_lens"], batch["block_tables"], scale)


# Mixed batch: fresh prefill, decode, chunked prefill over a prefix, decode with a long
# prefix, a prefill chunk crossing many blocks, a decode at the very first position, and
# chunks starting just before a 64-key tile boundary (off-by-one in causal masking).
MIXED = [(0, 37), (45, 1), (19, 20), (70, 1), (33, 50), (0, 1), (62, 9), (127, 2)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_store_and_paged_attention_mixed(group, head_dim, block_size):
    ops = _ops()
    dtype = torch.bfloat16
    num_kv_heads = 2
    gen = torch.Generator().manual_seed(1000 * group + head_dim + block_size)
    batch = _make_batch(MIXED, num_kv_heads * group, num_kv_heads, head_dim, block_size,
                        dtype, gen)
    scale = head_dim ** -0.5
    expected = _reference(batch, scale)

    # Store kernel: bit-exact against the reference store.
    kc_ref, vc_ref = batch["k_cache"].clone(), batch["v_cache"].clone()
    ref.store_kv_cache(batch["key"], batch["value"], kc_ref, vc_ref, batch["slot_mapping"])
    _store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                    batch["slot_mapping"])
    assert torch.equal(batch["k_cache"].nan_to_num(7.0), kc_ref.nan_to_num(7.0))
    assert torch.equal(batch["v_cache"].nan_to_num(7.0), vc_ref.nan_to_num(7.0))

    out = torch.full_like(batch["query"], float("nan"))
    res = ops.paged_attention(batch["query"], batch["k_cache"], batch["v_cache"],
                              batch["query_start_loc"], batch["seq_lens"],
                              batch["block_tables"], scale,
                              max_query_len=batch["max_query_len"],
                              max_seq_len=batch["max_seq_len"], out=out)
    assert res is out
    assert not out.isnan().any(), "some output elements were not written"
    assert _rel_err(out, expected) < TOL[dtype]
    # Also against the reference run in the cache dtype.
    same_dtype = ref.paged_attention(batch["query"], batch["k_cache"], batch["v_cache"],
                                     batch["query_start_loc"], batch["seq_lens"],
                                     batch["block_tables"], scale)
    assert _rel_err(out, same_dtype) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paged_attention_dtypes_no_hints(dtype):
    """No max_query_len / max_seq_len hints: the upper-bound grid must give the same result."""
    ops = _ops()
    gen = torch.Generator().manual_seed(7)
    batch = _make_batch(MIXED, 8, 2, 64, 16, dtype, gen)
    scale = 0.125
    expected = _reference(batch, scale)
    _store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                    batch["slot_mapping"])
    out = ops.paged_attention(batch["query"], batch["k_cache"], batch["v_cache"],
                              batch["query_start_loc"], batch["seq_lens"],
                              batch["block_tables"], scale)
    assert not out.isnan().any()
    assert _rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("num_seqs, block_size, dtype, head_dim", [
    (40, 16, torch.bfloat16, 64), (120, 16, torch.bfloat16, 64), (170, 16, torch.bfloat16, 64),
    (40, 128, torch.bfloat16, 64),
    (40, 16, torch.float32, 128)])  # a narrower key tile, so its stages fit in shared memory
def test_decode_tile_for_each_batch_size(num_seqs, block_size, dtype, head_dim):
    """The decode tile follows the batch size, the block size and the bytes of a key row
    (triton_attention_tiling._pick_config): each choice against the reference, contexts
    across several key tiles."""
    ops = _ops()
    gen = torch.Generator().manual_seed(num_seqs + block_size + head_dim)
    seqs = [(int(p), 1) for p in torch.randint(0, 300, (num_seqs,), generator=gen)]
    batch = _make_batch(seqs, 4, 2, head_dim, block_size, dtype, gen)
    scale = 0.125
    expected = _reference(batch, scale)
    _store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                    batch["slot_mapping"])
    out = ops.paged_attention(batch["query"], batch["k_cache"], batch["v_cache"],
                              batch["query_start_loc"], batch["seq_lens"], batch["block_tables"],
                              scale, max_query_len=1, max_seq_len=batch["max_seq_len"])
    assert _rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_loop_matches_the_general_path(splits):
    """A decode call (max_query_len=1) runs one key loop masked only at the end; the same
    batch without the hint runs the general unmasked + causal-masked loops. Same output,
    contexts ending inside a key tile, on its edge (63 + 1 keys) and with no keys before."""
    ops = _ops()
    gen = torch.Generator().manual_seed(5)
    batch = _make_batch([(63, 1), (0, 1), (200, 1), (31, 1), (95, 1)], 8, 2, 64, 16, torch.float32, gen)
    _store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                    batch["slot_mapping"])
    cfg = dict(BLOCK_M=16, BLOCK_N=32, num_warps=2, num_stages=2)
    outs = [ops.paged_attention(batch["query"], batch["k_cache"], batch["v_cache"],
                                batch["query_start_loc"], batch["seq_lens"], batch["block_tables"],
                                0.125, max_query_len=hint, max_seq_len=batch["max_seq_len"],
                                num_kv_splits=splits, _config=cfg)
            for hint in (1, None)]
    assert _tiling(batch["query"], batch["k_cache"], 5, 1, 256, splits, cfg).constants["DECODE"]
    assert not _tiling(batch["query"], batch["k_cache"], 5, 5, 256, splits, cfg).constants["DECODE"]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    assert _rel_err(outs[0], _reference(batch, 0.125)) < TOL[torch.float32]


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _fp8_batch(seqs, cache_dtype, query_dtype, seed):
    """A batch over an fp8 cache whose new keys and values include out-of-range values."""
    gen = torch.Generator().manual_seed(seed)
    batch = _make_batch(seqs, 8, 2, 128, 16, query_dtype, gen, cache_dtype=cache_dtype)
    limit = torch.finfo(cache_dtype).max
    batch["key"][0, 0, :4] = torch.tensor([2 * limit, -2 * limit, 1e-3, 300.0])
    batch["value"][-1, 1, :2] = torch.tensor([3 * limit, -3 * limit])
    return batch


@pytest.mark.skipif(INTERPRET, reason="Triton's interpreter rounds to fp8 wrongly (0.4927 -> 0.25)")
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
def test_fp8_cache_store(cache_dtype, query_dtype):
    """The store kernel writes the reference's bytes and scales: each head row divided by
    max|row| / the format's largest value, rounded to nearest even."""
    batch = _fp8_batch(MIXED, cache_dtype, query_dtype, 21)
    kc_ref, vc_ref = batch["k_cache"].clone(), batch["v_cache"].clone()
    scales_ref = {name: t.clone() for name, t in batch["scales"].items()}
    ref.store_kv_cache(batch["key"], batch["value"], kc_ref, vc_ref, batch["slot_mapping"],
                       **scales_ref)
    _store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                    batch["slot_mapping"], **batch["scales"])
    assert torch.equal(batch["k_cache"].view(torch.uint8), kc_ref.view(torch.uint8))
    assert torch.equal(batch["v_cache"].view(torch.uint8), vc_ref.view(torch.uint8))
    for name, t in batch["scales"].items():
        torch.testing.assert_close(t, scales_ref[name], **SAME)
    # The row holding +-2 limit stores +-limit at scale 2; the rest of it is still there.
    first = batch["slot_mapping"][0]
    limit = torch.finfo(cache_dtype).max
    row = batch["k_cache"].flatten(0, 1)[first, 0].float()
    assert row[:2].tolist() == [limit, -limit]
    assert batch["scales"]["k_scale"].flatten(0, 1)[first, 0].item() == 2.0
    assert row[3].item() == pytest.approx(150.0, rel=2 ** -3)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seqs, max_query_len, splits", [
    (MIXED, None, 1), ([(p, 1) for p in range(0, 1200, 7)], 1, 1),  # 172: the narrow tile
    ([(1500, 1), (900, 1), (3, 1)], 1, 4)], ids=["mixed", "decode", "split"])
def test_fp8_cache_attention(cache_dtype, query_dtype, seqs, max_query_len, splits):
    """Attention reads an fp8 cache, scaled row by row, in the query's type: the reference
    over the widened cache, and an output in the query's type."""
    ops = _ops()
    batch = _fp8_batch(seqs, cache_dtype, query_dtype, len(seqs) + splits)
    scale = 128 ** -0.5
    expected = _reference(batch, scale)
    ref.store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                       batch["slot_mapping"], **batch["scales"])
    out = ops.paged_attention(batch["query"], batch["k_cache"], batch["v_cache"],
                              batch["query_start_loc"], batch["seq_lens"], batch["block_tables"],
                              scale, max_query_len=max_query_len or batch["max_query_len"],
                              max_seq_len=batch["max_seq_len"], num_kv_splits=splits,
                              **batch["scales"])
    assert out.dtype == query_dtype and not out.isnan().any()
    assert _rel_err(out, expected) < TOL[torch.bfloat16]


@pytest.mark.skipif(INTERPRET, reason="the asm widening runs on CUDA only")
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("seqs, max_query_len",
                         [(MIXED, None), ([(p, 1) for p in range(0, 700, 9)], 1)], ids=["mixed", "decode"])
def test_fp8_values_widened_by_asm_match_the_cast(monkeypatch, cache_dtype, seqs, max_query_len):
    """Values widened by the conversion instruction (V_ASM) give the output of Triton's own
    cast: the same float16 values, element for element, reach the PV dot."""
    ops = _ops()
    batch = _fp8_batch(seqs, cache_dtype, torch.bfloat16, 3)
    ref.store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                       batch["slot_mapping"], **batch["scales"])
    args = (batch["query"], batch["k_cache"], batch["v_cache"], batch["query_start_loc"],
            batch["seq_lens"], batch["block_tables"], 128 ** -0.5)
    kw = dict(max_query_len=max_query_len or batch["max_query_len"],
              max_seq_len=batch["max_seq_len"], **batch["scales"])
    tiling = _tiling(batch["query"], batch["k_cache"], len(seqs), kw["max_query_len"], 256, 1, None)
    if not tiling.constants["V_ASM"]:
        pytest.skip("no fp8 conversion instruction before sm_89")
    with_asm = ops.paged_attention(*args, **kw)
    from rlserve.ops import triton_attention_tiling
    monkeypatch.setattr(triton_attention_tiling, "_fp8_cvt", lambda device: False)
    with_cast = ops.paged_attention(*args, **kw)
    # The dots see the same operands; only the order of a tile's products may differ, which
    # can move a bf16 output by one unit in the last place. Bytes misread are far off.
    torch.testing.assert_close(with_asm.float(), with_cast.float(), rtol=2 ** -7, atol=1e-3)
    assert _rel_err(with_asm, _reference(batch, 128 ** -0.5)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("seqs", [[(150, 1), (3, 1), (0, 1), (97, 1)], MIXED],
                         ids=["decode", "mixed"])
@pytest.mark.parametrize("splits", [2, 3, 5])
def test_paged_attention_split_kv(seqs, splits):
    ops = _ops()
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(splits)
    batch = _make_batch(seqs, 8, 2, 128, 16, dtype, gen)
    scale = 128 ** -0.5
    expected = _reference(batch, scale)
    _store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                    batch["slot_mapping"])
    # A strided output view, as when attention writes into a wider buffer.
    wide = torch.full((batch["query"].shape[0], 8, 256), float("nan"), dtype=dtype,
                      device=DEVICE)
    out = wide[:, :, :128]
    ops.paged_attention(batch["query"], batch["k_cache"], batch["v_cache"],
                        batch["query_start_loc"], batch["seq_lens"], batch["block_tables"],
                        scale, max_query_len=batch["max_query_len"],
                        max_seq_len=batch["max_seq_len"], out=out, num_kv_splits=splits)
    assert not out.isnan().any()
    assert wide[:, :, 128:].isnan().all()
    assert _rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads_first", [True, False])
def test_paged_attention_program_order_changes_nothing(heads_first, splits):
    """The launch order (kv heads fastest or not, sequences in a given order, here longest
    first as the model runner passes them) must not change any output element."""
    ops = _ops()
    seqs = [(150, 1), (3, 1), (0, 1), (97, 1), (40, 1)] if splits > 1 else MIXED
    gen = torch.Generator().manual_seed(11)
    batch = _make_batch(seqs, 8, 2, 64, 16, torch.float32, gen)
    scale = 64 ** -0.5
    expected = _reference(batch, scale)
    _store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                    batch["slot_mapping"])
    lens = batch["seq_lens"].cpu()
    order = torch.argsort(-lens, stable=True).to(torch.int32).to(DEVICE)
    cfg = dict(BLOCK_M=16 if splits > 1 else 64, BLOCK_N=32, num_warps=2, num_stages=2,
               HEADS_FIRST=heads_first)
    outs = []
    for seq_order in (None, order):
        out = torch.full_like(batch["query"], float("nan"))
        ops.paged_attention(batch["query"], batch["k_cache"], batch["v_cache"],
                            batch["query_start_loc"], batch["seq_lens"], batch["block_tables"],
                            scale, max_query_len=batch["max_query_len"],
                            max_seq_len=batch["max_seq_len"], out=out, num_kv_splits=splits,
                            seq_order=seq_order, _config=cfg)
        assert not out.isnan().any()
        assert _rel_err(out, expected) < TOL[torch.float32]
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_paged_attention_block64_strided_query():
    """Block size 64 and query/key/value as views of one fused qkv projection."""
    ops = _ops()
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(64)
    h, kvh, d = 4, 1, 64
    batch = _make_batch([(5, 9), (130, 1), (64, 64)], h, kvh, d, 64, dtype, gen)
    n = batch["query"].shape[0]
    qkv = torch.cat([batch["query"].reshape(n, -1), batch["key"].reshape(n, -1),
                     batch["value"].reshape(n, -1)], dim=1)
    q = qkv[:, :h * d].view(n, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(n, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(n, kvh, d)
    assert not q.is_contiguous()
    expected = _reference(batch, 0.1)
    _store_kv_cache(k, v, batch["k_cache"], batch["v_cache"], batch["slot_mapping"])
    out = ops.paged_attention(q, batch["k_cache"], batch["v_cache"], batch["query_start_loc"],
                              batch["seq_lens"], batch["block_tables"], 0.1,
                              max_query_len=64)
    assert _rel_err(out, expected) < TOL[dtype]


def test_store_kv_cache_skips_negative_slots():
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(6, 2, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    value = torch.randn(6, 2, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    slots = torch.tensor([5, -1, 17, 0, -1, 63], dtype=torch.int64, device=DEVICE)
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    vc = torch.zeros_like(kc)
    kr, vr = kc.clone(), vc.clone()
    _store_kv_cache(key, value, kc, vc, slots)
    ref.store_kv_cache(key, value, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("splits", [None, 4])
def test_decode_cuda_graph_replay(splits):
    """The decode path launches without host syncs, so it can be captured and replayed."""
    ops = _ops()
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(11)
    seqs = [(200, 1), (31, 1), (90, 1), (0, 1)]
    batch = _make_batch(seqs, 16, 8, 128, 16, dtype, gen, extra_blocks=40)
    scale = 128 ** -0.5
    q, out = batch["query"].clone(), torch.empty_like(batch["query"])
    qsl, sl, bt = (batch["query_start_loc"].clone(), batch["seq_lens"].clone(),
                   batch["block_tables"].clone())
    _store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                    batch["slot_mapping"])

    def step():
        ops.paged_attention(q, batch["k_cache"], batch["v_cache"], qsl, sl, bt, scale,
                            max_query_len=1, max_seq_len=512, out=out, num_kv_splits=splits)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(2):
        # New inputs in place: shorter contexts and fresh queries.
        sl.copy_(batch["seq_lens"] - trial * torch.tensor([150, 20, 60, 0], dtype=torch.int32,
                                                          device=DEVICE))
        q.normal_()
        graph.replay()
        torch.cuda.synchronize()
        expected = ref.paged_attention(q.float(), batch["k_cache"].float(),
                                       batch["v_cache"].float(), qsl, sl, bt, scale)
        assert _rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("n,size,width", [(5, 8, 3), (16, 16, 7), (1, 1, 1), (37, 48, 300)])
def test_stage_graph_inputs_matches_the_copies(n, size, width):
    """One launch leaves a graph's static buffers as the plain copies and fills would: the
    step's rows copied, padding rows with slot -1, length 1, their own order and block 0,
    everything else untouched."""
    from rlserve.ops.triton_graph_inputs import stage_graph_inputs
    gen = torch.Generator().manual_seed(n * 1000 + width)

    def ints(shape, dtype, high=10_000):
        return torch.randint(0, high, shape, generator=gen).to(dtype).to(DEVICE)

    b, max_blocks = 48, 320
    ids, pos, slots = (ints((n,), torch.int64) for _ in range(3))
    lens, order = ints((n,), torch.int32), torch.randperm(n, generator=gen).to(torch.int32).to(DEVICE)
    tables = ints((n, width), torch.int32)
    static = [ints((b,), torch.int64), ints((b,), torch.int64), ints((b,), torch.int64),
              ints((b,), torch.int32), ints((b,), torch.int32), ints((b, max_blocks), torch.int32)]
    expected = [t.clone() for t in static]
    e_ids, e_pos, e_slots, e_lens, e_order, e_tables = expected
    e_ids[:n], e_pos[:n], e_slots[:n], e_lens[:n], e_order[:n] = ids, pos, slots, lens, order
    e_slots[n:size], e_lens[n:size], e_tables[n:size, 0] = -1, 1, 0
    e_order[n:size] = torch.arange(n, size, dtype=torch.int32, device=DEVICE)
    e_tables[:n, :width] = tables
    stage_graph_inputs(ids, pos, slots, lens, order, tables, *static, size)
    for name, got, want in zip(("ids", "positions", "slots", "seq_lens", "order", "tables"), static, expected):
        assert torch.equal(got, want), name


def test_stage_graph_inputs_rejects_a_batch_larger_than_the_graph():
    from rlserve.ops.triton_graph_inputs import stage_graph_inputs
    row = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    small = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        stage_graph_inputs(row, row, row, row.int(), row.int(), row.int()[:, None], small, small, small,
                           small.int(), small.int(), torch.zeros(2, 4, dtype=torch.int32, device=DEVICE), 4)


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_attention_head_dim_not_power_of_two(splits):
    ops = _ops()
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(96)
    batch = _make_batch([(10, 5), (40, 1), (0, 20)], 6, 2, 96, 16, dtype, gen)
    expected = _reference(batch, 0.1)
    _store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                    batch["slot_mapping"])
    out = ops.paged_attention(batch["query"], batch["k_cache"], batch["v_cache"],
                              batch["query_start_loc"], batch["seq_lens"],
                              batch["block_tables"], 0.1, max_query_len=20,
                              num_kv_splits=splits)
    assert _rel_err(out, expected) < TOL[dtype]


# ----------------------------------------------------------------------------- fused ops


@pytest.mark.parametrize("hidden", [64, 200, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_add_rms_norm(hidden, dtype):
    from rlserve.ops import triton_fused
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, 3, hidden, generator=gen).to(dtype).to(DEVICE)
    res = torch.randn(5, 3, hidden, generator=gen).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    normed, new_res = triton_fused.fused_add_rms_norm(x, res, w, 1e-6)
    exp_normed, exp_res = fused_ref.fused_add_rms_norm(x, res, w, 1e-6)
    assert new_res.shape == x.shape and normed.dtype == exp_normed.dtype
    torch.testing.assert_close(new_res, exp_res, **EXACT)
    torch.testing.assert_close(normed, exp_normed, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(triton_fused.rms_norm(x, w, 1e-6), fused_ref.rms_norm(x, w, 1e-6),
                               rtol=TOL[dtype], atol=TOL[dtype])
    # In place: outputs land in the inputs' storage.
    x2, r2 = x.clone(), res.clone()
    a, b = triton_fused.fused_add_rms_norm(x2, r2, w, 1e-6, inplace=True)
    assert a.data_ptr() == x2.data_ptr() and b.data_ptr() == r2.data_ptr()
    torch.testing.assert_close(b, exp_res, **EXACT)
    torch.testing.assert_close(a, exp_normed, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("inter", [96, 3072])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_and_mul(inter, dtype):
    from rlserve.ops import triton_fused
    gen = torch.Generator().manual_seed(inter)
    x = (3 * torch.randn(4, 3, 2 * inter, generator=gen)).to(dtype).to(DEVICE)
    out = triton_fused.silu_and_mul(x)
    expected = fused_ref.silu_and_mul(x)
    assert out.shape == (4, 3, inter)
    torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=TOL[dtype])
    # A non-contiguous input (every other row).
    xs = x[::2]
    torch.testing.assert_close(triton_fused.silu_and_mul(xs), fused_ref.silu_and_mul(xs),
                               rtol=TOL[dtype], atol=TOL[dtype])


# ------------------------------------------------------ decode GEMMs with their neighbours


def _gemm_inputs(rows: int, k: int, n: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype).to(DEVICE)
    return x, w


@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_decode_gemm_matches_the_product(rows, splits):
    """Split-K partial sums add up to x @ w.T; unsplit, the product rounded once."""
    from rlserve.ops import triton_decode_gemm as G
    x, w = _gemm_inputs(rows, 512, 64, torch.bfloat16, rows * 10 + splits)
    plan = G.GemmPlan(bn=32, bm=G._bm(rows), bk=128, splits=splits, stages=2, warps=4)
    out = G.decode_gemm(x, w, plan)
    exact = x.float() @ w.float().T
    if splits > 1:
        assert out.shape == (splits, rows, 64) and out.dtype == torch.float32
        torch.testing.assert_close(out.sum(0), exact, rtol=1e-4, atol=1e-4)
    else:
        assert out.shape == (rows, 64) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out, exact.to(torch.bfloat16), rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("rows", [3, 64, 260])
def test_linear_add_rms_norm_matches_linear_then_norm(rows):
    """The kernel set's fused projection + residual add + RMSNorm gives what F.linear and
    fused_add_rms_norm give, through split-K partials at decode sizes (and cuBLAS above)."""
    from rlserve.ops import kernels
    from rlserve.ops import triton_decode_gemm as G
    dtype = torch.bfloat16
    x, w = _gemm_inputs(rows, 1024, 256, dtype, rows)
    gen = torch.Generator().manual_seed(rows + 1)
    residual = torch.randn(rows, 256, generator=gen).to(dtype).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(256, generator=gen)).to(dtype).to(DEVICE)
    plan = G.plan_o_down(rows, 1024, 256)
    assert (plan is not None and plan.splits > 1) == (rows <= 256)
    normed, total = kernels._triton().linear_add_rms_norm(x, w, residual, norm_w, 1e-6)
    exp_normed, exp_total = fused_ref.fused_add_rms_norm(torch.nn.functional.linear(x, w), residual, norm_w, 1e-6)
    assert normed.shape == total.shape == (rows, 256) and normed.dtype == total.dtype == dtype
    # The product's summation order differs from the reference's: compared row by row.
    assert _rel_err(total, exp_total) < TOL[dtype] and _rel_err(normed, exp_normed) < TOL[dtype]


@pytest.mark.parametrize("rows", [2, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_silu_and_mul_matches_linear_then_activation(rows, dtype):
    """gate_up_proj with SiLU-and-mul in its epilogue, against F.linear then silu_and_mul
    (float32 and large batches keep cuBLAS and the activation kernel)."""
    from rlserve.ops import kernels
    x, w = _gemm_inputs(rows, 256, 2 * 96, dtype, rows)
    out = kernels._triton().linear_silu_and_mul(x, w)
    expected = fused_ref.silu_and_mul(torch.nn.functional.linear(x, w))
    assert out.shape == (rows, 96) and out.dtype == dtype
    # Summation order and a few roundings apart: compared row by row (the interpreter
    # truncates at each of them, so it drifts further).
    assert _rel_err(out, expected) < TOL[dtype] * (2 if INTERPRET else 1)


# ------------------------------------------------ rotary with the KV-cache store folded in

ROPE_TOL = {torch.bfloat16: 1.6e-2, torch.float32: 1e-5}  # relative, per head
MAX_POSITION = 512
NUM_BLOCKS = 6
SAME = dict(rtol=0, atol=0, equal_nan=True)


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
    _store_kv_cache(k_sep, v_sep, kc_sep, vc_sep, slots)

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
    assert _rel_err(q, ref_q) < ROPE_TOL[dtype]
    assert _rel_err(k, ref_k) < ROPE_TOL[dtype]
    stored = slots >= 0
    assert _rel_err(kc.flatten(0, 1)[slots[stored]], ref_k[stored]) < ROPE_TOL[dtype]
    torch.testing.assert_close(vc.float(), vc_ref, **SAME)


def test_rope_store_casts_to_the_cache_dtype():
    """Float32 activations into a bf16 cache, as the separate store kernel casts them."""
    from rlserve.model.layers import RotaryEmbedding
    from rlserve.ops.triton_rotary import rope_
    gen = torch.Generator().manual_seed(5)
    t, hq, hk, d, block_size = 5, 4, 2, 64, 16
    rope = RotaryEmbedding(d, MAX_POSITION, 1e4).to(DEVICE)
    positions = torch.randint(0, MAX_POSITION, (t,), generator=gen).to(DEVICE)
    slots = _slots(t, block_size, gen)
    qkv, q, k, v = _qkv(t, hq, hk, d, torch.float32, gen)
    qkv_sep = qkv.clone()
    q_sep, k_sep, v_sep = _qkv_views(qkv_sep, hq, hk, d)
    kc_sep, vc_sep = (_nan_cache(block_size, hk, d, torch.bfloat16) for _ in range(2))
    rope_(q_sep, k_sep, positions, rope.cos, rope.sin)
    _store_kv_cache(k_sep, v_sep, kc_sep, vc_sep, slots)
    kc, vc = (_nan_cache(block_size, hk, d, torch.bfloat16) for _ in range(2))
    rope_(q, k, positions, rope.cos, rope.sin, v=v, k_cache=kc, v_cache=vc, slot_mapping=slots)
    torch.testing.assert_close(qkv, qkv_sep, **SAME)
    torch.testing.assert_close(kc, kc_sep, **SAME)
    torch.testing.assert_close(vc, vc_sep, **SAME)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_rope_store_into_an_fp8_cache(cache_dtype):
    """The fused rotary store writes the same bytes and scales as rotary, then the store
    kernel."""
    from rlserve.model.layers import RotaryEmbedding
    from rlserve.ops.triton_rotary import rope_
    gen = torch.Generator().manual_seed(11)
    t, hq, hk, d, block_size = 9, 8, 2, 128, 16
    rope = RotaryEmbedding(d, MAX_POSITION, 1e4).to(DEVICE)
    positions = torch.randint(0, MAX_POSITION, (t,), generator=gen).to(DEVICE)
    slots = _slots(t, block_size, gen)
    qkv, q, k, v = _qkv(t, hq, hk, d, torch.bfloat16, gen)
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
    _store_kv_cache(k_sep, v_sep, kc_sep, vc_sep, slots, **sc_sep)
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
    assert _rel_err(out["triton"], out["torch"]) < 2 * TOL[dtype]
