"""The batch-invariant Triton kernels (rlserve/ops/triton_batch_invariant.py) against torch:
close to it, and a row's bits independent of the other rows.

Needs CUDA and triton; skipped otherwise. With RLSERVE_TRITON_INTERPRET=1 the kernels run on
CPU tensors through Triton's interpreter instead (small shapes, float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.triton_lane import DEVICE, INTERPRET, KERNEL_MARKS

DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]

pytestmark = KERNEL_MARKS


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(96, 80), (200, 64)] if INTERPRET else [(1024, 1024), (4096, 1024), (151936, 1024)])
def test_matmul_rows_are_independent_of_the_batch(dtype, n, k):
    from rlserve.ops import triton_batch_invariant as tbi
    torch.manual_seed(0)
    m = 70 if INTERPRET else 300
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype)
    together = tbi.linear(x, w, b)
    torch.testing.assert_close(together.float(), F.linear(x.float(), w.float(), b.float()),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                               atol=5e-2 if dtype == torch.bfloat16 else 1e-4)
    for i in (0, 1, m // 2, m - 1):
        # Fewer rows, the row at the same place in its tile: the K order does not follow M.
        assert torch.equal(tbi.linear(x[:i + 1], w, b)[i], together[i]), i
    if not INTERPRET:  # the interpreter's dot is numpy's, whose order may follow the row's place
        for i in (0, 1, m // 2, m - 1):
            assert torch.equal(tbi.linear(x[i:i + 1], w, b)[0], together[i]), i
        assert torch.equal(tbi.linear(x[3:40], w, b), together[3:40])


@pytest.mark.parametrize("n", [576, 1000] if INTERPRET else [576, 1024, 4096, 5120])
def test_row_mean_rows_are_independent_of_the_batch(n):
    from rlserve.ops import triton_batch_invariant as tbi
    torch.manual_seed(0)
    m = 33 if INTERPRET else 513
    x = torch.randn(m, n, device=DEVICE)
    together = tbi.row_mean(x)
    torch.testing.assert_close(together, x.mean(-1, keepdim=True), rtol=1e-5, atol=1e-6)
    for i in (0, m // 2, m - 1):
        assert torch.equal(tbi.row_mean(x[i:i + 1]), together[i:i + 1]), i
    assert tbi.row_mean(x.view(3, 11 if INTERPRET else 171, n)).shape[:-1] == (3, 11 if INTERPRET else 171)


@pytest.mark.parametrize("n", [576, 1000] if INTERPRET else [128, 576, 1024, 2048, 5120])
def test_one_launch_rms_norm_gives_the_bits_of_the_trainers_arithmetic(n):
    """The server's one-launch RMSNorm (with and without the residual add) against
    ops/batch_invariant's torch arithmetic around row_mean, which a trainer's transformers
    RMSNorm runs under rlserve.batch_invariant: bitwise on CUDA (close under the interpreter,
    whose reductions are numpy's), and a row's bits independent of the others."""
    from rlserve.ops import batch_invariant as bi
    from rlserve.ops import triton_batch_invariant as tbi
    torch.manual_seed(0)
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    m = 9 if INTERPRET else 1000
    x = (torch.randn(m, n, device=DEVICE) * 3).to(dtype)
    r = torch.randn(m, n, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(dtype)
    want, want_res = bi.rms_norm(x + r, w, 1e-6), x + r
    got, got_res = tbi.rms_norm(x, w, 1e-6, residual=r)
    plain, _ = tbi.rms_norm(x, w, 1e-6)
    assert torch.equal(got_res, want_res)
    if INTERPRET:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(plain, bi.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
        return
    assert torch.equal(got, want)
    assert torch.equal(plain, bi.rms_norm(x, w, 1e-6))
    assert torch.equal(tbi.rms_norm(x[m // 2:m // 2 + 1], w, 1e-6)[0], plain[m // 2:m // 2 + 1])


@pytest.mark.skipif(INTERPRET, reason="libdevice: CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_one_launch_kernels_pass_their_check_on_this_card(dtype):
    """Each one-launch kernel of the mode gives torch's bits here, so none falls back to the
    torch ops (a fallback keeps the bits and loses the speed)."""
    from rlserve.ops.invariant_fusions import fusions
    assert set(fusions(torch.device("cuda"), dtype)) == {"rms_norm", "fused_add_rms_norm", "rope", "silu_and_mul"}


@pytest.mark.skipif(INTERPRET, reason="the CUDA dispatch of the batch-invariant ops")
def test_the_ops_take_the_kernels_on_cuda_and_stay_invariant():
    from rlserve.ops import batch_invariant as bi
    torch.manual_seed(0)
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    normed = bi.rms_norm(x, w, 1e-6)
    assert all(torch.equal(bi.rms_norm(x[i:i + 1], w, 1e-6)[0], normed[i]) for i in (0, 17, 255))
    q = torch.randn(300, 16, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16)
    whole = bi.attention(q, kv, kv, 0, 128 ** -0.5)
    chunked = torch.cat([bi.attention(q[:100], kv[:100], kv[:100], 0, 128 ** -0.5),
                         bi.attention(q[100:], kv, kv, 100, 128 ** -0.5)])
    assert torch.equal(whole, chunked)


# -- attention: the paged kernel in its batch-invariant mode ------------------------------

BLOCK = 16  # the cache's block size
HEADS, KV_HEADS, HEAD_DIM = (4, 2, 32) if INTERPRET else (16, 8, 128)
ATTN_DTYPES = [torch.float32] if INTERPRET else [torch.bfloat16, torch.float32]


class Sequences:
    """A paged cache holding sequences 0..n-1 (`lengths` tokens each, blocks scattered), and
    each sequence's queries for every position: what a step reads, whatever the step holds."""

    def __init__(self, lengths: list[int], dtype: torch.dtype):
        g = torch.Generator().manual_seed(0)
        self.lengths = lengths
        blocks = [-(-n // BLOCK) for n in lengths]
        perm = torch.randperm(sum(blocks), generator=g).to(torch.int32)
        self.tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
        start = 0
        for i, n in enumerate(blocks):
            self.tables[i, :n] = perm[start:start + n]
            start += n
        shape = (sum(blocks), BLOCK, KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
        self.v_cache = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
        self.queries = [torch.randn(n, HEADS, HEAD_DIM, generator=g).to(dtype).to(DEVICE) for n in lengths]

    def step(self, rows: list[tuple[int, int, int]], invariant: bool = True) -> list[torch.Tensor]:
        """rows: (sequence, first query position, query count), in batch order; each row's
        attention output [count, H, D]."""
        from rlserve.ops import triton_attention
        q = torch.cat([self.queries[s][p:p + c] for s, p, c in rows])
        qsl = torch.tensor([0] + [c for _, _, c in rows], dtype=torch.int32).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([p + c for _, p, c in rows], dtype=torch.int32)
        tables = self.tables[[s for s, _, _ in rows]]
        out = triton_attention.paged_attention(
            q, self.k_cache, self.v_cache, qsl.to(DEVICE), seq_lens.to(DEVICE), tables.to(DEVICE),
            HEAD_DIM ** -0.5, max_query_len=max(c for _, _, c in rows), batch_invariant=invariant)
        return list(out.split([c for _, _, c in rows]))


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
def test_attention_of_a_sequence_is_the_same_alone_and_in_any_batch(dtype):
    """The probe (sequence 0) prefilled whole, as the last chunk of a prefill, and decoding
    its last token: alone, and inside batches of other sequences of other lengths (decode
    rows, prefill rows): bitwise the same outputs, close to the torch reference."""
    seqs = Sequences([150, 9, 300, 64, 33, 200], dtype)
    probe = seqs.lengths[0]
    prefill, chunk, decode = (0, 0, probe), (0, 100, probe - 100), (0, probe - 1, 1)
    others = [(1, 0, 9), (2, 299, 1), (3, 40, 24), (4, 32, 1), (5, 199, 1)]
    for row in (prefill, chunk, decode):
        alone = seqs.step([row])[0]
        for batch in ([*others[:2], row, *others[2:]], [row, *others], [*others[1:], row]):
            got = seqs.step(batch)[batch.index(row)]
            assert torch.equal(got, alone), (row, batch)
    # Many decode rows (the default kernel would split keys and shrink its tiles here).
    many = [(i % 6, seqs.lengths[i % 6] - 1, 1) for i in range(1, 40)]
    assert torch.equal(seqs.step([*many, decode])[-1], seqs.step([decode])[0])

    from rlserve.ops import attention as ref
    whole = seqs.step([prefill])[0]
    want = ref.paged_attention(seqs.queries[0], seqs.k_cache, seqs.v_cache,
                               torch.tensor([0, probe], dtype=torch.int32, device=DEVICE),
                               torch.tensor([probe], dtype=torch.int32, device=DEVICE),
                               seqs.tables[:1].to(DEVICE), HEAD_DIM ** -0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(whole.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
def test_a_position_gets_the_same_bits_in_prefill_chunks_and_decode(dtype):
    """One position's output is the same whether its query came in the whole prefill, in a
    chunk that starts elsewhere, or as a decode step: the key order is fixed by position."""
    seqs = Sequences([200, 70], dtype)
    whole = seqs.step([(0, 0, 200)])[0]
    # The interpreter's dot is numpy's, whose bits follow a row's place in the tile: there,
    # chunks start and decoded positions sit where the whole prefill's tiles (32 tokens) start.
    size, positions = (64, (0, 64, 128, 192)) if INTERPRET else (37, (0, 15, 63, 64, 130, 199))
    chunks = torch.cat([seqs.step([(0, s, min(size, 200 - s)), (1, 0, 70)])[0] for s in range(0, 200, size)])
    assert torch.equal(chunks, whole)
    for pos in positions:
        assert torch.equal(seqs.step([(1, 69, 1), (0, pos, 1)])[1][0], whole[pos]), pos


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
def test_a_trainers_dense_attention_gives_the_servers_paged_bits(dtype):
    """triton_batch_invariant.attention (what rlserve.batch_invariant runs on CUDA under a
    trainer's forward) over a sequence's keys laid out densely: the paged kernel's bits."""
    from rlserve.ops import triton_batch_invariant as tbi
    seqs = Sequences([130], dtype)
    blocks = seqs.tables[0].long().to(DEVICE)
    k = seqs.k_cache[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:130]
    v = seqs.v_cache[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:130]
    q = seqs.queries[0]
    assert torch.equal(tbi.attention(q, k, v, 0, HEAD_DIM ** -0.5), seqs.step([(0, 0, 130)])[0])
    assert torch.equal(tbi.attention(q[90:], k, v, 90, HEAD_DIM ** -0.5), seqs.step([(0, 90, 40)])[0])


# -- routed experts: the Triton MoE kernel with the mode's one block shape ---------------


def test_moe_with_the_invariant_blocks_gives_a_token_the_same_bits_in_any_batch():
    """triton_moe.INVARIANT_CONFIG: close to the torch reference, and (on the GPU) a token's
    output the same alone, in a few tokens and in many, whose routing fills the experts'
    blocks differently."""
    from rlserve.ops import moe as moe_ref
    from rlserve.ops import triton_moe
    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k = (40, 64, 32, 8, 2) if INTERPRET else (300, 1024, 768, 32, 4)
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=DEVICE) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=DEVICE) / inter ** 0.5).to(dtype)
    routing = moe_ref.route(torch.randn(tokens, experts, device=DEVICE), top_k, True)

    def moe(rows):
        return triton_moe.fused_moe(x[rows], w13, w2, routing.weights[rows], routing.ids[rows],
                                    config=triton_moe.INVARIANT_CONFIG)

    together = moe(slice(None))
    want = moe_ref.fused_moe(x.float(), w13.float(), w2.float(), routing.weights, routing.ids)
    tol = 1e-4 if INTERPRET else 3e-2
    torch.testing.assert_close(together.float(), want, rtol=tol, atol=tol)
    if INTERPRET:  # numpy's dot: a row's bits follow its place in the block
        return
    for i in (0, 7, tokens - 1):
        assert torch.equal(moe(slice(i, i + 1))[0], together[i]), i
    assert torch.equal(moe(slice(3, 40)), together[3:40])
