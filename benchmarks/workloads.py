"""The offline workloads throughput.py runs, drawn from fixed seeds so that every run (and
every engine given the same draws) sees the same prompts and lengths.

nano-vllm's: 256 sequences, prompt and output lengths uniform in [100, 1024], T=0.6.
GRPO-shaped: 128 prompts x n=8 samples, prompts uniform in [200, 1000] tokens, each prompt's
output length from a long tail (exponential, mean 400, at least 16, cut at 2000), T=1.0,
the sampled token's logprob. Its draws are those of the script that runs the same workload
on vLLM (`../shared/device/vllm/grpo.py` from the project root), so the figures compare.
Both: random token ids below 10000, ignore_eos, so every sample makes exactly its length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlserve import SamplingParams

GRPO_MIN_OUT = 16  # the GRPO draw's floor: no sample shorter than this


def nano_vllm_draw(num_seqs: int, min_len: int, max_len: int, max_out: int, seed: int = 0):
    """nano-vllm's bench.py workload, drawn in the same order from the same seed:
    (prompts, output lengths)."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_len, max_len))]
               for _ in range(num_seqs)]
    out_lens = [random.randint(min_len, max_out) for _ in range(num_seqs)]
    return prompts, out_lens


def grpo_draw(num_prompts: int, min_len: int, max_len: int, mean_out: float, max_out: int, seed: int = 1):
    """The GRPO-shaped draw: every prompt first, then one output length per prompt (its n
    samples share one SamplingParams, so one max_tokens), in that order from `seed`."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_len, max_len))]
               for _ in range(num_prompts)]
    out_lens = [min(max_out, max(GRPO_MIN_OUT, int(random.expovariate(1 / mean_out))))
                for _ in range(num_prompts)]
    return prompts, out_lens


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    out_lens: list[int]  # each prompt's max_tokens; ignore_eos makes each sample that long
    n: int  # samples per prompt
    temperature: float
    logprobs: int | None  # None: no logprobs; 0: the sampled token's alone
    warm_prompts: int  # the warm-up: this many of the prompts, each sample warm_tokens long
    warm_tokens: int

    @property
    def output_tokens(self) -> int:
        return self.n * sum(self.out_lens)

    def _params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=1.0, ignore_eos=True,
                              max_tokens=max_tokens, logprobs=self.logprobs, detokenize=False)

    def params(self) -> list[SamplingParams]:
        return [self._params(m) for m in self.out_lens]

    def warm_up(self) -> tuple[list[list[int]], SamplingParams]:
        """A slice of the workload's shapes (n, logprobs, prompt lengths) for the warm-up."""
        return self.prompts[:self.warm_prompts], self._params(self.warm_tokens)

    def describe(self) -> str:
        samples = f"{len(self.prompts)} prompts x n={self.n}" if self.n > 1 else f"{len(self.prompts)} seqs"
        lp = "" if self.logprobs is None else f", logprobs={self.logprobs}"
        return (f"{self.name}: {samples}, {sum(map(len, self.prompts))} prompt tokens, "
                f"{self.output_tokens} output tokens, T={self.temperature}{lp}")


def nano_vllm(num_seqs: int, min_len: int, max_len: int, max_out: int, temperature: float) -> Workload:
    prompts, out_lens = nano_vllm_draw(num_seqs, min_len, max_len, max_out)
    return Workload("nano-vllm", prompts, out_lens, n=1, temperature=temperature, logprobs=None,
                    warm_prompts=32, warm_tokens=16)


def grpo(num_prompts: int, n: int, min_len: int, max_len: int, mean_out: float, max_out: int,
         temperature: float) -> Workload:
    prompts, out_lens = grpo_draw(num_prompts, min_len, max_len, mean_out, max_out)
    # The warm-up of the vLLM-side script: 16 prompts, n samples of 32 tokens with logprobs.
    return Workload("grpo", prompts, out_lens, n=n, temperature=temperature, logprobs=0,
                    warm_prompts=16, warm_tokens=32)
