"""Is a server batch invariant? One prompt alone, then inside batches of growing size, with
and without its prefix in the cache; for each, the first output token where the greedy
continuation parts from the prompt's own run alone, and the largest logprob difference up to
there. With --trainer, also transformers' forward on the same tokens under
rlserve.batch_invariant.enabled() (the trainer's half): the largest gap to the server's logprobs.

    rlserve serve MODEL --batch-invariant &       # or VLLM_BATCH_INVARIANT=1 (vLLM too)
    python benchmarks/invariance.py --base-url http://localhost:8000 --sizes 1 8 64 256
    python benchmarks/invariance.py --model MODEL --batch-invariant --trainer   # starts its own (CPU)

Works against any OpenAI-compatible server that returns token ids (`return_token_ids`,
vLLM's and rlserve's). A batch-invariant server prints "identical" on every line and a
trainer gap of exactly 0.0.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

import httpx

WORDS = ("the of and to in is it that for on was with as by at be this from or have an are not "
         "but had his they you were her which she all their one there we can been has more").split()


@dataclass(frozen=True)
class Output:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]


def complete(url: str, model: str, prompts: list[str], max_tokens: int, headers: dict,
             cache_salt: str) -> list[Output]:
    """`cache_salt`: cached blocks are shared only with earlier requests of the same salt."""
    body = dict(model=model, prompt=prompts, max_tokens=max_tokens, temperature=0, logprobs=0,
                ignore_eos=True, return_token_ids=True, cache_salt=cache_salt)
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=3600)
    r.raise_for_status()
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [Output(c["prompt_token_ids"], c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]


def parting(ref: Output, got: Output) -> tuple[int | None, float]:
    """The first output token where `got` leaves `ref` (None: never), and the largest logprob
    difference over the tokens before that."""
    first = next((i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b), None)
    upto = len(ref.token_ids) if first is None else first + 1
    gap = max((abs(a - b) for a, b in zip(ref.logprobs[:upto], got.logprobs[:upto])), default=0.0)
    return first, gap


def describe(first: int | None, gap: float) -> str:
    if first is None and gap == 0.0:
        return "identical"
    where = "tokens equal" if first is None else f"tokens part at output token {first}"
    return f"{where}; largest logprob difference {gap:.3g}"


def trainer_gap(model_path: str, out: Output) -> float:
    """transformers' forward under rlserve.batch_invariant on prompt + output: the largest
    difference to the server's logprobs (0.0: bit for bit)."""
    import torch
    from transformers import AutoModelForCausalLM

    import rlserve.batch_invariant
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_ids + out.token_ids])
    with torch.no_grad(), rlserve.batch_invariant.enabled():
        lp = model(ids).logits[0].float().log_softmax(-1)
    n = len(out.prompt_ids)
    mine = [lp[n - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    return max(abs(a - b) for a, b in zip(mine, out.logprobs))


def run(url: str, model: str, args: argparse.Namespace, headers: dict) -> int:
    rng = random.Random(args.seed)

    def prompt() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
    probe = prompt()
    fillers = [prompt() for _ in range(max(args.sizes) - 1)]

    alone = complete(url, model, [probe], args.max_tokens, headers, "alone")[0]
    print(f"probe: {len(alone.prompt_ids)} prompt tokens, {len(alone.token_ids)} output tokens")
    print(f"{'batch':>6}  {'prefix cache':<12}  result")
    worst = 0
    for size in args.sizes:
        for cached in (False, True):
            # The probe in the middle of the batch, not first: its row moves with the size.
            # A fresh salt: a cold cache; the same one again: every prefix from the cache.
            batch = fillers[:size // 2] + [probe] + fillers[size // 2:size - 1]
            got = complete(url, model, batch, args.max_tokens, headers, f"batch-{size}")[size // 2]
            first, gap = parting(alone, got)
            worst = max(worst, int(first is not None or gap > 0))
            print(f"{size:>6}  {'hit' if cached else 'cold':<12}  {describe(first, gap)}")
    if args.trainer:
        print(f"trainer forward under rlserve.batch_invariant: largest gap {trainer_gap(args.model, alone)!r}")
    return worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="a running server (default: start one on --model, CPU, float32)")
    p.add_argument("--model", help="HF directory: the server's model, and the trainer's (default: the demo model)")
    p.add_argument("--batch-invariant", action="store_true", help="the server this script starts runs the mode")
    p.add_argument("--trainer", action="store_true", help="also compare transformers' forward (needs --model "
                   "or the demo model, float32)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.model is None and (args.base_url is None or args.trainer):
        from rlserve.model.demo_model import demo_model_path
        args.model = demo_model_path()
    server = None
    url = args.base_url
    if url is None:
        from rlserve.server.launcher import ServerProcess
        flags = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "2048"]
        server = ServerProcess(args.model, *flags, *(["--batch-invariant"] if args.batch_invariant else []))
        url = server.url
    url = url.rstrip("/").removesuffix("/v1")
    try:
        model = httpx.get(f"{url}/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]
        return run(url, model, args, headers)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
