"""Host (Python) cost of one engine step, measured on CPU with a model too small to matter.

On the GPU, large decode batches are limited by the host: the scheduler, the KV block
bookkeeping, building the step's input tensors, reading the sampled tokens back and the
per-token updates of every request. This script runs the same engine on CPU with a tiny
Qwen3 (one layer, hidden size 64, dummy weights) and, by default, a stand-in attention
that does no work (the torch reference attention loops over sequences in Python and would
dominate), so what is left is the engine's own cost per step.

    python benchmarks/host_overhead.py                        # 256 seqs, temperature 0.6 and 0
    python benchmarks/host_overhead.py --profile --repeat 1   # plus the top functions (cProfile)
    python benchmarks/host_overhead.py --no-async-scheduling  # plain schedule -> run -> update
    python benchmarks/host_overhead.py --vocab-size 151936    # Qwen3's vocabulary (see below)
    python benchmarks/host_overhead.py --max-prompt 1024 --output-len 4 --temperatures 0.6
        # mostly full 16384-token prefill steps: their host time is printed too

Workload: 256 prompts of 100-600 random token ids, 200 output tokens each (ignore_eos),
overlapped scheduling as on the GPU, run --repeat times. For the decode steps at full
batch (every sequence decodes one token) it prints the median milliseconds per step:
the model's forward and logits and the sampler (device work on a GPU; on this CPU the
sampler's temperature path is slow torch compute), and what is left, "engine host ms per
decode step", the number this script is for. Then output tokens/s over the runs, and a
checksum of every output token, which must not change when only the engine's
bookkeeping changes (same options and --seed).

The default vocabulary (4096) keeps the logits small. With Qwen3's (151936) the CPU
allocates and frees a [256, vocab] float32 tensor every step, and the page faults of
doing so land in every column, the engine's included; a GPU's caching allocator has no
such cost.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def tiny_model_dir(vocab_size: int, hidden_size: int, num_layers: int) -> str:
    """A Qwen3 config.json with the given sizes (weights are dummy)."""
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=hidden_size,
               intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
               num_attention_heads=2, num_key_value_heads=1, head_dim=hidden_size // 2,
               vocab_size=vocab_size, max_position_embeddings=40960, rope_theta=1000000.0,
               rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
               attention_bias=False, torch_dtype="float32", eos_token_id=0, bos_token_id=1)
    path = os.path.join(tempfile.gettempdir(), f"rlserve-tiny-{vocab_size}-{hidden_size}-{num_layers}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def stub_attention() -> None:
    """Replace paged attention by the identity on the queries: the KV cache is still
    written, but nothing is read back, so the forward costs almost nothing."""
    import dataclasses

    from rlserve.ops import kernels

    def identity(query, k_cache, v_cache, meta, scale):
        return query

    # Before the engine is built: the worker selects (and binds) this set.
    kernels.TORCH = dataclasses.replace(kernels.TORCH, paged_attention=identity)


class StepTimer:
    """Wraps the engine's step, the model (forward and logits) and the sampler with wall-clock timers."""

    def __init__(self, engine):
        import rlserve.worker.sampler as sampler
        self.steps: list[tuple[float, float, float, int, int]] = []  # total, forward, sample, seqs, tokens
        self._forward = self._sample = 0.0
        self._last = None
        runner = engine.executor.local_runner
        schedule, step = engine.scheduler.schedule, engine.step
        model = runner.model
        forward, logits, sample = runner.forward, model.compute_logits, sampler.sample

        def timed_schedule():
            self._last = schedule()
            return self._last

        def timed_forward(*a, **kw):
            t = time.perf_counter()
            out = forward(*a, **kw)
            self._forward += time.perf_counter() - t
            return out

        def timed_logits(*a, **kw):
            t = time.perf_counter()
            out = logits(*a, **kw)
            self._forward += time.perf_counter() - t
            return out

        def timed_sample(*a, **kw):
            t = time.perf_counter()
            out = sample(*a, **kw)
            self._sample += time.perf_counter() - t
            return out

        def timed_step():
            # A step's time runs to the start of the next one, so it includes what the
            # caller (LLM.generate) does with the step's outputs.
            t = time.perf_counter()
            if self._open is not None:
                self._close(t)
            self._forward = self._sample = 0.0
            self._last = None
            out = step()
            self._open = (t, self._last)
            return out

        self._open = None
        engine.scheduler.schedule = timed_schedule
        engine.step = timed_step
        runner.forward = timed_forward
        model.compute_logits = timed_logits
        sampler.sample = timed_sample

    def _close(self, now: float) -> None:
        t, s = self._open
        self._open = None
        if s is not None and not s.empty:
            self.steps.append((now - t, self._forward, self._sample, len(s.scheduled),
                               s.num_batched_tokens))

    def decode_steps(self, batch: int):
        return [s for s in self.steps if s[3] == batch and s[4] == batch]

    def prefill_steps(self, min_tokens: int):
        """Steps that compute at least `min_tokens` prompt tokens (chunks of a full budget)."""
        return [s for s in self.steps if s[4] >= min_tokens and s[4] > s[3]]


def workload(args):
    rng = random.Random(args.seed)
    high = min(args.vocab_size, 10000)
    prompts = [[rng.randrange(2, high) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.num_seqs)]
    return prompts


def run(args, temperature: float, prompts) -> None:
    from rlserve import LLM, SamplingParams
    path = tiny_model_dir(args.vocab_size, args.hidden_size, args.num_layers)
    blocks = sum(-(-(len(p) + args.output_len) // 16) + 1 for p in prompts) + 64
    llm = LLM(path, device="cpu", dtype="float32", load_format="dummy", skip_tokenizer_init=True,
              max_model_len=args.max_prompt + args.output_len + 16, max_num_seqs=args.num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=blocks,
              enable_prefix_caching=not args.no_prefix_caching,
              async_scheduling=not args.no_async_scheduling, seed=args.seed)
    params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=args.output_len,
                            detokenize=False, logprobs=args.logprobs)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, detokenize=False))  # warm-up
    timer = StepTimer(llm.engine)
    profiler = cProfile.Profile() if args.profile else None
    elapsed, digests = 0.0, set()
    for _ in range(args.repeat):
        llm.reset_prefix_cache()  # every run computes its prompts
        torch.manual_seed(args.seed)  # the CPU sampler's noise: same tokens run after run
        t = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        outs = llm.generate(prompts, params)
        if profiler is not None:
            profiler.disable()
        elapsed += time.perf_counter() - t
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        assert produced == args.output_len * len(prompts), produced
        tokens = json.dumps([o.outputs[0].token_ids for o in outs]).encode()
        digests.add(hashlib.sha256(tokens).hexdigest()[:16])

    dec = timer.decode_steps(len(prompts))
    print(f"\n== temperature {temperature}: {len(prompts)} seqs, prompts {args.min_prompt}-"
          f"{args.max_prompt}, {args.output_len} output tokens each, vocab {args.vocab_size}, "
          f"{args.repeat} runs{', cProfile on' if profiler else ''}")
    if dec:
        def ms(i):
            return statistics.median(s[i] for s in dec) * 1e3
        total, fwd, smp = ms(0), ms(1), ms(2)
        rest = statistics.median((s[0] - s[1] - s[2]) for s in dec) * 1e3
        print(f"decode steps at batch {len(prompts)}: {len(dec)} of {len(timer.steps)} steps; median ms "
              f"per step: total {total:.2f}, forward {fwd:.2f}, sampler {smp:.2f}")
        print(f"engine host ms per decode step (total - forward - sampler): {rest:.2f} "
              f"({rest * 1e3 / len(prompts):.1f} us per request)")
    pre = timer.prefill_steps(args.max_num_batched_tokens // 2)
    if pre:
        rest = statistics.median((s[0] - s[1] - s[2]) for s in pre) * 1e3
        tokens = statistics.median(s[4] for s in pre)
        print(f"prefill steps of {tokens:.0f} tokens (median): {len(pre)}; engine host ms per step "
              f"(total - forward - sampler): {rest:.2f} ({rest * 1e3 / tokens:.2f} us per token)")
    total_tokens = args.repeat * args.output_len * len(prompts)
    print(f"{total_tokens} tokens in {elapsed:.2f}s = {total_tokens / elapsed:,.0f} output tok/s; "
          f"outputs sha256 {', '.join(sorted(digests))}")
    if profiler is not None:
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(args.top)
        stats.sort_stats("tottime").print_stats(args.top)
    llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=600)
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 0.0])
    p.add_argument("--logprobs", type=int, default=None, help="ask for logprobs (k alternatives)")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="the sampler's work grows with it (151936 for Qwen3)")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--attention", choices=["stub", "reference"], default="stub",
                   help="stub: attention does no work; reference: the torch reference op")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="plain schedule -> execute -> update (the GPU overlaps steps)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3, help="runs of the workload per temperature")
    p.add_argument("--profile", action="store_true", help="run under cProfile, print the top functions")
    p.add_argument("--top", type=int, default=30, help="functions to print with --profile")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.attention == "stub":
        stub_attention()
    prompts = workload(args)
    for temperature in args.temperatures:
        run(args, temperature, prompts)


if __name__ == "__main__":
    main()
