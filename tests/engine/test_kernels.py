"""The kernel set is chosen once per model, by device or RLSERVE_KERNELS, and every layer
runs the set it was given."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.model.presets import model_dir
from rlserve.ops import kernels


def test_the_cpu_gets_the_torch_references(monkeypatch):
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert kernels.select(torch.device("cpu")) is kernels.TORCH


@pytest.mark.parametrize("value, message", [
    ("cuda", "RLSERVE_KERNELS: must be one of torch, triton, got 'cuda'"),
    ("triton", "RLSERVE_KERNELS=triton: the Triton kernels need a CUDA device"),
])
def test_a_bad_choice_is_an_error_naming_the_variable(monkeypatch, value, message):
    monkeypatch.setenv(kernels.ENV, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kernels.select(torch.device("cpu"))


def test_every_layer_runs_the_bound_set(monkeypatch):
    """A set whose attention is counted: every attention layer of the model calls it."""
    calls, reference = [], kernels.TORCH.paged_attention

    def counted(query, k_cache, v_cache, meta, scale):
        calls.append(query.shape)
        return reference(query, k_cache, v_cache, meta, scale)

    monkeypatch.setattr(kernels, "TORCH", dataclasses.replace(kernels.TORCH, paged_attention=counted))
    llm = LLM(model_dir("tiny"), device="cpu", dtype="float32", load_format="dummy",
              skip_tokenizer_init=True, max_model_len=64)
    runner = llm.engine.executor.local_runner
    assert runner.kernels.paged_attention is counted and not runner.fused_sampling
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, detokenize=False))
    layers = runner.model.config.num_hidden_layers
    assert len(calls) == 2 * layers  # a prefill and a decode step, every layer


def test_a_router_that_picks_other_experts_than_torchs_is_replaced_loudly(caplog):
    """The start-up check of the kernel set's router: a router that disagrees with torch's
    (here one that routes to the least likely experts) is swapped for torch's, with a
    warning; one that agrees is kept."""
    from rlserve.ops import moe

    def wrong(logits, top_k, renormalize):
        return moe.route(-logits, top_k, renormalize)

    def same(logits, top_k, renormalize):
        return moe.route(logits, top_k, renormalize)

    cpu = torch.device("cpu")
    assert kernels.check_router(dataclasses.replace(kernels.TORCH, route=same), cpu, 128, 8).route is same
    with caplog.at_level("WARNING"):
        checked = kernels.check_router(dataclasses.replace(kernels.TORCH, route=wrong), cpu, 128, 8)
    assert checked.route is moe.route
    assert "failed its self-check" in caplog.text and "MoE models route with torch" in caplog.text
