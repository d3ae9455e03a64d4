"""benchmarks/ as its users meet it: the bound names the card it runs on (or none), the
GRPO-shaped workload has the shape and draws it promises, and throughput.py runs it end to
end, reporting the KV cache's capacity and the run's preemptions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from bounds import bound_tokens_per_s, device_peak, roofline_tokens_per_s  # noqa: E402
from rlserve.model.presets import PRESETS  # noqa: E402
from workloads import GRPO_MIN_OUT, grpo, nano_vllm  # noqa: E402


@pytest.mark.parametrize("card, tb_s, tflops", [
    ("NVIDIA H100 80GB HBM3", 3.35, 989),
    ("NVIDIA H100 PCIe", 2.0, 756),
    ("NVIDIA H200", 4.8, 989),
])
def test_a_known_card_gets_its_own_peaks(card, tb_s, tflops):
    peak = device_peak(card=card)
    assert (peak.hbm_bytes_per_s, peak.flops_per_s) == (tb_s * 1e12, tflops * 1e12)
    assert peak.describe(flops=True) == f"{card}, {tb_s:.2f} TB/s, {tflops} TFLOP/s"


def test_an_unknown_card_gets_no_peak_unless_given():
    """A GH200 is an H100 with its own memory: its name must not read as an H200's."""
    for card in ("NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB"):
        peak = device_peak(card=card)
        assert peak.hbm_bytes_per_s is None and peak.flops_per_s is None
    given = device_peak(2.0, 312, card="NVIDIA A100-SXM4-80GB")
    assert (given.hbm_bytes_per_s, given.flops_per_s) == (2.0e12, 312e12)
    assert given.describe(flops=True).endswith("2.00 TB/s, 312 TFLOP/s (given)")


def test_the_grpo_workload_has_its_shape():
    wl = grpo(128, 8, 200, 1000, 400, 2000, 1.0)
    assert len(wl.prompts) == 128 and all(200 <= len(p) <= 1000 for p in wl.prompts)
    assert all(GRPO_MIN_OUT <= o <= 2000 for o in wl.out_lens)
    assert 300 < sum(wl.out_lens) / len(wl.out_lens) < 500  # a long tail of mean 400
    assert wl.output_tokens == 8 * sum(wl.out_lens)
    params = wl.params()
    assert [p.max_tokens for p in params] == wl.out_lens
    assert all(p.n == 8 and p.logprobs == 0 and p.temperature == 1.0 and p.ignore_eos for p in params)
    again = grpo(128, 8, 200, 1000, 400, 2000, 1.0)
    assert (again.prompts, again.out_lens) == (wl.prompts, wl.out_lens)  # seeded: every run the same


def test_samples_of_a_prompt_count_as_sequences_in_the_bounds():
    """n samples of a prompt read as much as n copies of it; the roofline prefills it once."""
    cfg = PRESETS["qwen3-0.6b"]
    wl = grpo(4, 3, 50, 100, 40, 80, 1.0)
    copies = [p for p in wl.prompts for _ in range(3)], [o for o in wl.out_lens for _ in range(3)]
    grouped = bound_tokens_per_s(cfg, wl.prompts, wl.out_lens, 3.35e12, n=3)
    assert grouped == pytest.approx(bound_tokens_per_s(cfg, *copies, 3.35e12))
    roof = roofline_tokens_per_s(cfg, wl.prompts, wl.out_lens, 3.35e12, 989e12, n=3)
    assert grouped >= roof > roofline_tokens_per_s(cfg, *copies, 3.35e12, 989e12)
    assert nano_vllm(4, 50, 100, 80, 0.6).n == 1


def test_throughput_runs_the_grpo_workload_on_cpu(demo_model):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(BENCHMARKS / "throughput.py"), "--model", demo_model, "--device", "cpu",
           "--workload", "grpo", "--num-prompts", "2", "--n", "2", "--max-len", "24", "--max-out", "24"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "workload grpo: 2 prompts x n=2" in out and "logprobs=0" in out
    run = next(line for line in out.splitlines() if line.startswith("rlserve:"))
    assert "preemptions in this run 0" in run and "KV capacity" in run
    assert "KV cache:" in out or "device memory:" in out
