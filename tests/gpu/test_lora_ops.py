"""Batched LoRA ops: the torch reference against a plain per-token computation, and the
Triton kernels against the reference on fresh random inputs (mixed adapters, base-model
tokens, fused slices of unequal widths, ranks below the maximum).

The Triton half needs CUDA and triton (marker gpu); with RLSERVE_TRITON_INTERPRET=1 it runs
on CPU tensors through Triton's interpreter instead (slow, so shapes stay small).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from rlserve import envs
from rlserve.ops.lora import LoRABatch, group_tokens, lora_reference

INTERPRET = envs.RLSERVE_TRITON_INTERPRET.get()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit decorates the kernels
HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cpu" if INTERPRET else "cuda"


def _case(gen, num_tokens, k, slices, num_slots, rank, dtype, device, used_ranks=None):
    """Random x, y, stacked a/b (slots past an adapter's rank zero, as loading leaves them)
    and per-token slots (-1: base), on `device`."""
    out = sum(n for _, n in slices)
    x = torch.randn(num_tokens, k, generator=gen)
    y = torch.randn(num_tokens, out, generator=gen)
    a = torch.randn(num_slots, len(slices), rank, k, generator=gen) / k ** 0.5
    b = torch.randn(num_slots, out, rank, generator=gen)
    for slot, r in enumerate(used_ranks or []):
        a[slot, :, r:] = 0
        b[slot, :, r:] = 0
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen).numpy()
    to = dict(dtype=dtype, device=device)
    return x.to(**to), y.to(**to), a.to(**to).contiguous(), b.to(**to).contiguous(), slots


def _batch(slots: np.ndarray, num_slots: int, device) -> LoRABatch:
    order, starts, segments = group_tokens(slots, num_slots)
    return LoRABatch(torch.from_numpy(order).to(device), torch.from_numpy(starts).to(device), segments)


def test_group_tokens_orders_by_slot_and_puts_base_last():
    order, starts, segments = group_tokens(np.array([2, -1, 0, 2, 0, -1]), 3)
    assert order.tolist() == [2, 4, 0, 3, 1, 5]
    assert starts.tolist() == [0, 2, 2, 4]
    assert segments == ((0, 0, 2), (2, 2, 4))


def test_reference_matches_per_token_merged_weights():
    gen = torch.Generator().manual_seed(0)
    slices = [(0, 24), (24, 8), (32, 8)]
    x, y, a, b, slots = _case(gen, 13, 32, slices, 3, 8, torch.float64, "cpu")
    expected = y.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for s, (off, n) in enumerate(slices):
            w = b[slot, off:off + n] @ a[slot, s]  # the merged delta of this slice
            expected[t, off:off + n] += w @ x[t]
    lora_reference(y, x, a, b, slices, _batch(slots, 3, "cpu"))
    torch.testing.assert_close(y, expected)


def test_reference_reads_slot_starts_without_host_segments():
    gen = torch.Generator().manual_seed(1)
    slices = [(0, 16)]
    x, y, a, b, slots = _case(gen, 9, 16, slices, 2, 4, torch.float32, "cpu")
    batch = _batch(slots, 2, "cpu")
    y1, y2 = y.clone(), y.clone()
    lora_reference(y1, x, a, b, slices, batch)
    lora_reference(y2, x, a, b, slices, batch._replace(segments=None))
    assert torch.equal(y1, y2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                    reason="needs CUDA (or RLSERVE_TRITON_INTERPRET=1)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,k,slices,num_slots,rank", [
    (1, 64, [(0, 64)], 1, 8),
    (37, 96, [(0, 64), (64, 32), (96, 32)], 4, 16),  # fused qkv, unequal widths
    (70, 160, [(0, 200), (200, 200)], 3, 8),  # gate_up: more columns than one tile
    (40, 1100, [(0, 48)], 2, 16),  # `in` split over several programs, the last split short
])
@pytest.mark.parametrize("max_split_k", [1, 8])
def test_triton_matches_reference(dtype, num_tokens, k, slices, num_slots, rank, max_split_k):
    from rlserve.ops.triton_lora import lora_shrink_expand
    gen = torch.Generator().manual_seed(num_tokens)
    x, y, a, b, slots = _case(gen, num_tokens, k, slices, num_slots, rank, dtype, DEVICE,
                              used_ranks=[rank // 2] + [rank] * (num_slots - 1))
    batch = _batch(slots, num_slots, DEVICE)
    table = torch.tensor([[o for o, _ in slices], [n for _, n in slices]], dtype=torch.int32, device=DEVICE)
    expected = y.clone()
    lora_reference(expected, x, a, b, slices, batch)
    got = y.clone()
    lora_shrink_expand(got, x, a, b, slices, table, batch.sorted_tokens, batch.slot_starts,
                       config=dict(MAX_SPLIT_K=max_split_k))
    base = torch.from_numpy(slots < 0).to(DEVICE)
    assert torch.equal(got[base], y[base])  # base-model rows untouched
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.float(), expected.float(), **tol)



DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scales", [[2.0, 0.5, 0.25], [2.0, 0.5, 0.375], [2.0, 0.37, 1 / 3]])
def test_slot_load_rounds_scaled_b_once(device, src_dtype, scales):
    """B lands in the slot as (B * scaling) computed in float32 and rounded once into the
    slot's dtype, whichever dtype the trainer sent and whatever the scaling."""
    from rlserve.model.lora import LoadPlan, LoRAContext, LoRAModel, _exact_in_place
    gen = torch.Generator().manual_seed(7)
    b_src = [torch.randn(shape, generator=gen).to(src_dtype).to(device) for shape in [(64, 8), (48, 16), (32, 4)]]
    a_src = [torch.randn(8, 40, generator=gen).to(src_dtype).to(device)]
    b_dst = [torch.full(b.shape, float("nan"), dtype=torch.bfloat16, device=device) for b in b_src]
    a_dst = [torch.empty(8, 40, dtype=torch.bfloat16, device=device)]
    slot = torch.ones(4, 4, dtype=torch.bfloat16, device=device)
    in_place = _exact_in_place(b_dst, b_src, scales)
    assert in_place == (scales[2] == 0.25 or (src_dtype == torch.bfloat16 and scales[1] == 0.5))
    LoRAModel({}, LoRAContext(), 1, 16).run(LoadPlan([slot], a_dst, a_src, b_dst, b_src, scales, in_place))
    assert not slot.any()
    assert torch.equal(a_dst[0], a_src[0].to(torch.bfloat16))
    for dst, src, s in zip(b_dst, b_src, scales):
        assert torch.equal(dst, (src.float() * s).to(torch.bfloat16))


def test_slot_load_into_float16_from_float32_scales_before_the_cast():
    """float16's subnormals start at 6e-5: a small B rounded first and scaled after would
    differ from scaling first, so that load takes the float32 path."""
    from rlserve.model.lora import LoadPlan, LoRAContext, LoRAModel, _exact_in_place
    b_src = [torch.tensor([[3.0001e-5, 1.0e-6], [0.1234567, -2.5e-5]])]
    b_dst = [torch.empty(2, 2, dtype=torch.float16)]
    a_src, a_dst = [torch.ones(2, 3)], [torch.empty(2, 3, dtype=torch.float16)]
    assert not _exact_in_place(b_dst, b_src, [2.0])
    LoRAModel({}, LoRAContext(), 1, 2).run(LoadPlan([torch.ones(1)], a_dst, a_src, b_dst, b_src, [2.0], False))
    assert torch.equal(b_dst[0], (b_src[0] * 2.0).to(torch.float16))


def test_slot_load_clears_what_its_copies_leave():
    """Loading into a used slot leaves exactly the new adapter there (modules it lacks and
    rows past its ranks zero), and an adapter on every module at the full rank clears nothing
    before its copies."""
    from transformers import Qwen3Config

    from rlserve.model.llama import Qwen3ForCausalLM
    from rlserve.model.lora import attach_lora
    config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    lora = attach_lora(Qwen3ForCausalLM(config), max_loras=2, max_rank=8)
    gen = torch.Generator().manual_seed(3)

    def adapter(modules, rank_of):
        pairs = {}
        for m in modules:
            shape_a, shape_b = lora.module_shapes(m, rank_of(m))
            pairs[m] = (torch.randn(shape_a, generator=gen), torch.randn(shape_b, generator=gen))
        return pairs

    full = adapter(list(lora.targets), lambda m: 8)
    full_plan = lora.plan(1, full, lambda m: 1.0)
    assert full_plan.zero == []
    lora.run(full_plan)
    lora.load(0, full, lambda m: 1.0)  # slot 0 now full of the old adapter
    partial = adapter([m for m in lora.targets if m.endswith(("q_proj", "down_proj"))],
                      lambda m: 4 if "q_proj" in m else 2)
    lora.load(0, partial, lambda m: 0.5)
    for m, t in lora.targets.items():
        offset, size = t.layer.slices[t.index]
        a, b = t.layer.a[0, t.index], t.layer.b[0, offset:offset + size]
        if m not in partial:
            assert not a.any() and not b.any(), m
            continue
        r = partial[m][0].shape[0]
        assert torch.equal(a[:r], partial[m][0]) and not a[r:].any(), m
        assert torch.equal(b[:, :r], partial[m][1] * 0.5) and not b[:, r:].any(), m
    for m, t in lora.targets.items():  # the other slot is untouched
        offset, size = t.layer.slices[t.index]
        assert torch.equal(t.layer.a[1, t.index], full[m][0]), m
