"""A hybrid model's decode step as its CUDA graph runs it (gated_deltanet.StateBatch.decode_rows):
the batch padded with rows on the pool's spare slot computes the real rows as the eager step
does, and leaves every sequence's state as the eager step leaves it. The capture itself needs
CUDA (tests/gpu/test_gpu_hybrid.py); this is the arithmetic of the padding, on the CPU."""

from __future__ import annotations

import torch

from helpers.hybrid import COMMON
from rlserve.model.gated_deltanet import GatedDeltaNet, StateBatch, bind_states, pad_slot


def _layer() -> GatedDeltaNet:
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    torch.manual_seed(0)
    layer = GatedDeltaNet(Qwen3_5TextConfig(**COMMON, intermediate_size=96), fused_input=False)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    bind_states(layer, 6, torch.device("cpu"), torch.float32)
    assert layer.conv_state is not None and layer.recurrent_state is not None
    layer.conv_state.normal_()
    layer.recurrent_state.normal_(0, 0.1)
    return layer


def _states(layer: GatedDeltaNet) -> tuple[torch.Tensor, torch.Tensor]:
    assert layer.conv_state is not None and layer.recurrent_state is not None
    return layer.conv_state.clone(), layer.recurrent_state.clone()


@torch.inference_mode()
def test_padding_rows_on_the_spare_slot_change_no_sequence():
    layer = _layer()
    pad = pad_slot([layer])
    assert pad == 6  # one slot after the sequences' six
    before = _states(layer)
    x = torch.randn(3, COMMON["hidden_size"])
    slots, starts = [4, 1, 2], [5, 0, 9]  # slot 1 starts its sequence: from zero state
    eager = layer(x, StateBatch.build(slots, [0, 1, 2, 3], starts, x.device))
    eager_states = _states(layer)

    layer.conv_state.copy_(before[0])
    layer.recurrent_state.copy_(before[1])
    padded = torch.cat([x, torch.randn(2, x.shape[1])])
    rows = StateBatch.decode_rows(torch.tensor(slots + [pad, pad]), torch.tensor([False, True, False, False, False]))
    out = layer(padded, rows)

    torch.testing.assert_close(out[:3], eager, rtol=1e-5, atol=1e-6)
    conv, recurrent = _states(layer)
    torch.testing.assert_close(conv[:pad], eager_states[0][:pad], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(recurrent[:pad], eager_states[1][:pad], rtol=1e-5, atol=1e-6)
    assert not torch.equal(recurrent[pad], before[1][pad])  # the padding wrote where it may
    assert torch.equal(conv[[0, 3, 5]], before[0][[0, 3, 5]])  # slots no row names are untouched
