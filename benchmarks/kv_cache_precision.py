"""How far an fp8 KV cache moves prompt logprobs: each cache type against a float32 cache.

A prefill step stores the prompt's keys and values, then attends over them read back from
the cache, so prompt logprobs see the cache's rounding at every position. The text is two
copies of a paragraph (~200 tokens of the demo model's tokenizer).

Usage: python benchmarks/kv_cache_precision.py [--model PATH] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse

import torch

TEXT = ("Reinforcement learning from human feedback trains a reward model on human preference "
        "data and then optimises a language model policy against that reward with an algorithm "
        "such as proximal policy optimisation. Group relative policy optimisation removes the value "
        "network: it samples several completions for each prompt, scores them, and uses the "
        "group's mean and standard deviation to compute advantages. The inference server that "
        "generates these rollouts must receive new weights after every training step, quickly "
        "and without restarting, so that the samples always come from the current policy. ") * 2

RUNS = [("float32", "auto"), ("float32", "fp8"), ("float32", "fp8_e5m2"),
        ("bfloat16", "auto"), ("bfloat16", "fp8")]


def prompt_logprobs(model: str, device: str, dtype: str, kv_cache_dtype: str) -> torch.Tensor:
    from rlserve import LLM, SamplingParams
    llm = LLM(model, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_model_len=512,
              kv_cache_memory_bytes=64 << 20)
    ids = llm.tokenizer.encode(TEXT)
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    llm.shutdown()
    return torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])


def main() -> None:
    from rlserve.model.demo_model import demo_model_path
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF directory (default: the demo model)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    model = args.model or demo_model_path()
    results = {run: prompt_logprobs(model, args.device, *run) for run in RUNS}
    base = results[RUNS[0]]
    print(f"{len(base)} prompt tokens; |logprob - float32 weights and cache| in nats")
    for (dtype, kv), lps in results.items():
        d = (lps - base).abs()
        print(f"  weights {dtype:8s} cache {kv:8s} mean {d.mean():.4f}  p90 {d.quantile(0.9):.4f}  "
              f"max {d.max():.4f}")


if __name__ == "__main__":
    main()
