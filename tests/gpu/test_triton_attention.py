"""The paged-attention and KV-store Triton kernels against the torch reference: mixed
prefill/decode batches, fp8 caches, split KV, CUDA-graph replay, the graph-input stager.

Needs CUDA and triton; skipped otherwise. With RLSERVE_TRITON_INTERPRET=1 the kernels run
on CPU tensors through Triton's interpreter instead (slow, so shapes stay small).
"""

from __future__ import annotations

import pytest
import torch

from helpers.paged_batch import FP8, MIXED, SAME, make_batch, reference, store_kv_cache
from helpers.triton_lane import DEVICE, INTERPRET, KERNEL_MARKS, TOL, rel_err
from rlserve.ops import attention as ref

pytestmark = KERNEL_MARKS


def _ops():
    from rlserve.ops import triton_attention
    return triton_attention


def _tiling(*args):
    """How a paged_attention call is cut into programs (rlserve.ops.triton_attention_tiling)."""
    from rlserve.ops import triton_attention_tiling
    return triton_attention_tiling.tiling(*args)



@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_store_and_paged_attention_mixed(group, head_dim, block_size):
    ops = _ops()
    dtype = torch.bfloat16
    num_kv_heads = 2
    gen = torch.Generator().manual_seed(1000 * group + head_dim + block_size)
    batch = make_batch(MIXED, num_kv_heads * group, num_kv_heads, head_dim, block_size,
                        dtype, gen)
    scale = head_dim ** -0.5
    expected = reference(batch, scale)

    # Store kernel: bit-exact against the reference store.
    kc_ref, vc_ref = batch["k_cache"].clone(), batch["v_cache"].clone()
    ref.store_kv_cache(batch["key"], batch["value"], kc_ref, vc_ref, batch["slot_mapping"])
    store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
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
    assert rel_err(out, expected) < TOL[dtype]
    # Also against the reference run in the cache dtype.
    same_dtype = ref.paged_attention(batch["query"], batch["k_cache"], batch["v_cache"],
                                     batch["query_start_loc"], batch["seq_lens"],
                                     batch["block_tables"], scale)
    assert rel_err(out, same_dtype) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paged_attention_dtypes_no_hints(dtype):
    """No max_query_len / max_seq_len hints: the upper-bound grid must give the same result."""
    ops = _ops()
    gen = torch.Generator().manual_seed(7)
    batch = make_batch(MIXED, 8, 2, 64, 16, dtype, gen)
    scale = 0.125
    expected = reference(batch, scale)
    store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                    batch["slot_mapping"])
    out = ops.paged_attention(batch["query"], batch["k_cache"], batch["v_cache"],
                              batch["query_start_loc"], batch["seq_lens"],
                              batch["block_tables"], scale)
    assert not out.isnan().any()
    assert rel_err(out, expected) < TOL[dtype]


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
    batch = make_batch(seqs, 4, 2, head_dim, block_size, dtype, gen)
    scale = 0.125
    expected = reference(batch, scale)
    store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                    batch["slot_mapping"])
    out = ops.paged_attention(batch["query"], batch["k_cache"], batch["v_cache"],
                              batch["query_start_loc"], batch["seq_lens"], batch["block_tables"],
                              scale, max_query_len=1, max_seq_len=batch["max_seq_len"])
    assert rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_loop_matches_the_general_path(splits):
    """A decode call (max_query_len=1) runs one key loop masked only at the end; the same
    batch without the hint runs the general unmasked + causal-masked loops. Same output,
    contexts ending inside a key tile, on its edge (63 + 1 keys) and with no keys before."""
    ops = _ops()
    gen = torch.Generator().manual_seed(5)
    batch = make_batch([(63, 1), (0, 1), (200, 1), (31, 1), (95, 1)], 8, 2, 64, 16, torch.float32, gen)
    store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
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
    assert rel_err(outs[0], reference(batch, 0.125)) < TOL[torch.float32]


def _fp8_batch(seqs, cache_dtype, query_dtype, seed):
    """A batch over an fp8 cache whose new keys and values include out-of-range values."""
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(seqs, 8, 2, 128, 16, query_dtype, gen, cache_dtype=cache_dtype)
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
    store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
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
    expected = reference(batch, scale)
    ref.store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                       batch["slot_mapping"], **batch["scales"])
    out = ops.paged_attention(batch["query"], batch["k_cache"], batch["v_cache"],
                              batch["query_start_loc"], batch["seq_lens"], batch["block_tables"],
                              scale, max_query_len=max_query_len or batch["max_query_len"],
                              max_seq_len=batch["max_seq_len"], num_kv_splits=splits,
                              **batch["scales"])
    assert out.dtype == query_dtype and not out.isnan().any()
    assert rel_err(out, expected) < TOL[torch.bfloat16]


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
    assert rel_err(with_asm, reference(batch, 128 ** -0.5)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("seqs", [[(150, 1), (3, 1), (0, 1), (97, 1)], MIXED],
                         ids=["decode", "mixed"])
@pytest.mark.parametrize("splits", [2, 3, 5])
def test_paged_attention_split_kv(seqs, splits):
    ops = _ops()
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(splits)
    batch = make_batch(seqs, 8, 2, 128, 16, dtype, gen)
    scale = 128 ** -0.5
    expected = reference(batch, scale)
    store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
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
    assert rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads_first", [True, False])
def test_paged_attention_program_order_changes_nothing(heads_first, splits):
    """The launch order (kv heads fastest or not, sequences in a given order, here longest
    first as the model runner passes them) must not change any output element."""
    ops = _ops()
    seqs = [(150, 1), (3, 1), (0, 1), (97, 1), (40, 1)] if splits > 1 else MIXED
    gen = torch.Generator().manual_seed(11)
    batch = make_batch(seqs, 8, 2, 64, 16, torch.float32, gen)
    scale = 64 ** -0.5
    expected = reference(batch, scale)
    store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
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
        assert rel_err(out, expected) < TOL[torch.float32]
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_paged_attention_block64_strided_query():
    """Block size 64 and query/key/value as views of one fused qkv projection."""
    ops = _ops()
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(64)
    h, kvh, d = 4, 1, 64
    batch = make_batch([(5, 9), (130, 1), (64, 64)], h, kvh, d, 64, dtype, gen)
    n = batch["query"].shape[0]
    qkv = torch.cat([batch["query"].reshape(n, -1), batch["key"].reshape(n, -1),
                     batch["value"].reshape(n, -1)], dim=1)
    q = qkv[:, :h * d].view(n, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(n, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(n, kvh, d)
    assert not q.is_contiguous()
    expected = reference(batch, 0.1)
    store_kv_cache(k, v, batch["k_cache"], batch["v_cache"], batch["slot_mapping"])
    out = ops.paged_attention(q, batch["k_cache"], batch["v_cache"], batch["query_start_loc"],
                              batch["seq_lens"], batch["block_tables"], 0.1,
                              max_query_len=64)
    assert rel_err(out, expected) < TOL[dtype]


def test_store_kv_cache_skips_negative_slots():
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(6, 2, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    value = torch.randn(6, 2, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    slots = torch.tensor([5, -1, 17, 0, -1, 63], dtype=torch.int64, device=DEVICE)
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    vc = torch.zeros_like(kc)
    kr, vr = kc.clone(), vc.clone()
    store_kv_cache(key, value, kc, vc, slots)
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
    batch = make_batch(seqs, 16, 8, 128, 16, dtype, gen, extra_blocks=40)
    scale = 128 ** -0.5
    q, out = batch["query"].clone(), torch.empty_like(batch["query"])
    qsl, sl, bt = (batch["query_start_loc"].clone(), batch["seq_lens"].clone(),
                   batch["block_tables"].clone())
    store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
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
        assert rel_err(out, expected) < TOL[dtype]


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
    batch = make_batch([(10, 5), (40, 1), (0, 20)], 6, 2, 96, 16, dtype, gen)
    expected = reference(batch, 0.1)
    store_kv_cache(batch["key"], batch["value"], batch["k_cache"], batch["v_cache"],
                    batch["slot_mapping"])
    out = ops.paged_attention(batch["query"], batch["k_cache"], batch["v_cache"],
                              batch["query_start_loc"], batch["seq_lens"],
                              batch["block_tables"], 0.1, max_query_len=20,
                              num_kv_splits=splits)
    assert rel_err(out, expected) < TOL[dtype]

