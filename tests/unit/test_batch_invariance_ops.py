"""The batch-invariant ops one by one (rlserve/ops/batch_invariant.py), the trainer's
torch.library ops and their gradients, and how the mode is switched on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlserve.ops import batch_invariant as bi


def test_a_linear_row_does_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(0)
    x, w, b = torch.randn(40, 576), torch.randn(960, 576), torch.randn(960)
    together = bi.linear(x, w, b)
    assert all(torch.equal(bi.linear(x[i:i + 1], w, b)[0], together[i]) for i in range(40))
    assert all(torch.equal(bi.linear(x[i:i + 5], w, b), together[i:i + 5]) for i in range(0, 35, 7))
    # A fused projection (qkv, gate_up) gives the bits of the separate ones.
    assert torch.equal(bi.linear(x, w[576:768], b[576:768]), together[:, 576:768])
    torch.testing.assert_close(together, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert bi.linear(x.view(4, 10, 576), w).shape == (4, 10, 960)


def _causal_sdpa(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(group, 0),
        v.transpose(0, 1).repeat_interleave(group, 0), is_causal=True, scale=scale).transpose(0, 1)


def test_attention_is_causal_attention_and_independent_of_chunking():
    torch.manual_seed(0)
    q, k, v = torch.randn(150, 9, 64), torch.randn(150, 3, 64), torch.randn(150, 3, 64)
    whole = bi.attention(q, k, v, 0, 0.125)
    torch.testing.assert_close(whole, _causal_sdpa(q, k, v, 0.125), rtol=1e-5, atol=1e-5)
    # A prompt in chunks (the later ones after a prefix from the cache), then decode steps.
    for cut in (1, 37, 64, 100):
        chunks = torch.cat([bi.attention(q[:cut], k[:cut], v[:cut], 0, 0.125),
                            bi.attention(q[cut:], k, v, cut, 0.125)])
        assert torch.equal(chunks, whole), cut
    for n in (1, 16, 17, 64, 65, 129, 150):
        assert torch.equal(bi.attention(q[n - 1:n], k[:n], v[:n], n - 1, 0.125)[0], whole[n - 1]), n
    # A trainer's mask: the same keys visible, the same bits.
    visible = torch.ones(150, 150, dtype=torch.bool).tril()
    assert torch.equal(bi.attention(q, k, v, 0, 0.125, visible), whole)


def test_trainer_ops_match_and_differentiate():
    import rlserve.batch_invariant as rbi
    torch.manual_seed(0)
    x = torch.randn(3, 20, 64, requires_grad=True)
    w = torch.randn(96, 64, requires_grad=True)
    y = rbi.linear(x, w, None)
    assert torch.equal(y, bi.linear(x.detach(), w.detach()))
    y.square().sum().backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    F.linear(x, w).square().sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-3)

    q, k, v = (torch.randn(70, h, 32, requires_grad=True) for h in (4, 2, 2))
    out = rbi.attention(q, k, v, 0, 0.2, None)
    assert torch.equal(out, bi.attention(q.detach(), k.detach(), v.detach(), 0, 0.2))
    out.sum().backward()
    got = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    _causal_sdpa(q, k, v, 0.2).sum().backward()
    for a, t in zip(got, (q, k, v)):
        torch.testing.assert_close(a, t.grad, rtol=1e-4, atol=1e-4)

    logits = torch.randn(5, 300, requires_grad=True)
    with rbi.enabled():
        lp = logits.log_softmax(-1)
    assert torch.equal(lp, bi.log_softmax(logits.detach()))
    (lp[:, 7].sum()).backward()
    g = logits.grad
    logits.grad = None
    torch.log_softmax(logits, -1)[:, 7].sum().backward()
    torch.testing.assert_close(g, logits.grad)


def test_enabled_routes_a_transformers_forward_through_the_ops():
    """A tiny random Llama: inside the block each row's logits are the bits of that row
    alone; outside, torch's own ops run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import rlserve.batch_invariant as rbi
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 300, (3, 90))
    with torch.no_grad(), rbi.enabled():
        batch = model(ids).logits
        one = model(ids[1:2]).logits[0]
        prefix = model(ids[1:2, :40]).logits[0]
    assert torch.equal(batch[1], one)
    assert torch.equal(prefix, one[:40])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, batch, rtol=1e-4, atol=1e-4)


def test_the_mode_is_chosen_once_by_flag_or_vllms_variable(monkeypatch):
    from rlserve.config import EngineConfig
    from rlserve.ops import kernels
    chosen = kernels.select(torch.device("cpu"), batch_invariant=True)
    assert chosen.name == "batch-invariant" and chosen.linear is bi.linear
    assert kernels.select(torch.device("cpu")).linear is F.linear  # the default set is untouched
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert not EngineConfig(model="m", device="cpu").batch_invariant
    assert EngineConfig(model="m", device="cpu", batch_invariant=True).batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig(model="m", device="cpu").batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT"):
        EngineConfig(model="m", device="cpu")


def test_the_flag_is_on_the_command_line():
    from rlserve.cli import build_parser
    args = build_parser().parse_args(["serve", "m", "--batch-invariant"])
    assert args.batch_invariant
