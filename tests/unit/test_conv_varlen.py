"""The causal convolution of Gated DeltaNet for a whole step at once (ops/gated_delta.py's
causal_conv1d_varlen) against the one-sequence reference: outputs and new states, for
chunks longer and shorter than the kernel's memory, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from rlserve.ops import gated_delta as ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[1], [5, 1, 2, 37], [3, 64, 1, 1, 9]])
def test_every_sequence_at_once_equals_one_at_a_time(lengths, dtype):
    gen = torch.Generator().manual_seed(sum(lengths))
    channels, width = 12, 4
    x = torch.randn(sum(lengths), channels, generator=gen).to(dtype)
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    states = torch.randn(len(lengths), channels, width - 1, generator=gen).to(dtype)
    spans, start = [], 0
    for n in lengths:
        spans.append((start, start + n))
        start += n
    out, new = ref.causal_conv1d_varlen(x, weight, states, ref.conv_indices(spans, width, x.device))
    # The taps are summed in another order than conv1d's: equal to rounding.
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for i, (a, b) in enumerate(spans):
        want, want_state = ref.causal_conv1d(x[a:b], weight, states[i])
        torch.testing.assert_close(out[a:b], want, **tol)
        torch.testing.assert_close(new[i], want_state)
