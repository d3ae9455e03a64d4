"""Routing replay (R3) for GRPO on a mixture-of-experts model, on CPU.

    python examples/grpo_moe_replay.py        # starts `rlserve serve` on the tiny MoE preset itself

The trainer is transformers' Qwen3-MoE in float32 (the moe-tiny preset's shape: 8 experts,
top-2, one dense layer; random weights). The server runs the same weights in bfloat16, as
a rollout engine does, so a fraction of its routing decisions differ from the trainer's.
With `--enable-return-routed-experts` every choice carries `routed_experts`, and
`rlserve.moe_replay.replay_routes` makes the trainer use those experts (the routing weights
still come from its own router, so the router learns).

1. The trainer's weights go to the server (gloo) as version 0.
2. Rollouts: `--prompts` prompts times `--n` samples, with token ids, logprobs and routes.
3. The trainer's logprobs of the sampled tokens, without and with replay: how many routing
   decisions differ, and the trainer/server logprob gap each way.
4. One GRPO step with replay (a toy reward: the share of distinct tokens in a completion),
   clipped surrogate against the server's logprobs; the new weights go out as version 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
from openai import OpenAI

from rlserve.model.demo_model import demo_model_path
from rlserve.model.presets import PRESETS, model_dir
from rlserve.moe_replay import ReplayStats, pad_routes, replay_routes
from rlserve.server.launcher import ServerProcess
from rlserve.weight_transfer import WeightSyncClient


def trainer_model() -> torch.nn.Module:
    """transformers' float32 model of the moe-tiny preset, seeded, weights drawn wide enough
    that the output is not uniform."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    fields = {k: v for k, v in PRESETS["moe-tiny"].items() if k not in ("torch_dtype", "model_type")}
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15 if "embed" in name else 0.05)
    return model


def rollouts(client: OpenAI, prompts: list[str], n: int, max_tokens: int) -> list[dict]:
    r = client.completions.create(model="m", prompt=prompts, n=n, max_tokens=max_tokens, temperature=1.0,
                                  logprobs=0, seed=0, extra_body=dict(return_token_ids=True))
    out = []
    for c in sorted(r.choices, key=lambda c: c.index):
        extra = c.model_extra
        out.append(dict(group=c.index // n, prompt_ids=extra["prompt_token_ids"], ids=extra["token_ids"],
                        logprobs=c.logprobs.token_logprobs, routes=extra["routed_experts"]))
    return out


def trainer_logprobs(model, s: dict, replay: bool, stats: ReplayStats) -> torch.Tensor:
    """The trainer's logprobs of a sample's completion tokens, routed as the server did or not."""
    seq = s["prompt_ids"] + s["ids"]
    ids = torch.tensor([seq])
    if replay:
        with replay_routes(model, pad_routes(s["routes"], len(seq)), stats):
            logits = model(ids).logits[0]
    else:
        logits = model(ids).logits[0]
    start = len(s["prompt_ids"]) - 1
    lp = logits[start:len(seq) - 1].log_softmax(-1)
    return lp.gather(-1, torch.tensor(s["ids"])[:, None])[:, 0]


def gap(model, samples: list[dict], replay: bool) -> tuple[float, float, ReplayStats]:
    """Mean and max |trainer - server| logprob over every sampled token; the routing stats."""
    stats, diffs = ReplayStats(), []
    with torch.no_grad():
        for s in samples:
            own = trainer_logprobs(model, s, replay, stats)
            diffs.append((own - torch.tensor(s["logprobs"])).abs())
    d = torch.cat(diffs)
    return float(d.mean()), float(d.max()), stats


def grpo_step(model, samples: list[dict], opt, clip: float = 0.2) -> float:
    """One clipped policy-gradient step with replayed routes; returns the loss."""
    rewards = [len(set(s["ids"])) / max(len(s["ids"]), 1) for s in samples]
    groups: dict[int, list[float]] = {}
    for s, r in zip(samples, rewards):
        groups.setdefault(s["group"], []).append(r)
    loss = torch.zeros(())
    for s, r in zip(samples, rewards):
        rs = groups[s["group"]]
        std = statistics.pstdev(rs)
        adv = (r - statistics.fmean(rs)) / std if std > 0 else 0.0
        if adv == 0.0:
            continue
        ratio = (trainer_logprobs(model, s, True, ReplayStats()) - torch.tensor(s["logprobs"])).exp()
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
        loss = loss - surrogate.mean() / len(samples)
    opt.zero_grad()
    if loss.requires_grad:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return float(loss.detach())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--server-dtype", default="bfloat16", help="the rollout engine's precision")
    args = p.parse_args()
    model = trainer_model()
    log = os.path.join(tempfile.gettempdir(), f"grpo_moe_replay_{os.getpid()}.log")
    print(f"starting rlserve on the moe-tiny preset, {args.server_dtype} (log: {log})")
    server = ServerProcess(model_dir("moe-tiny"), "--device", "cpu", "--dtype", args.server_dtype,
                           "--load-format", "dummy", "--tokenizer", demo_model_path(), "--served-model-name", "m",
                           "--max-model-len", "512", "--enable-return-routed-experts",
                           "--weight-transfer-config", json.dumps({"backend": "gloo"}), log=log)
    try:
        sync = WeightSyncClient(server.url, backend="gloo")
        sync.init()
        sync.push(model.named_parameters(), version=0)
        client = OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)
        prompts = ["The experts of a mixture", "Routing replay makes the trainer", "Once upon a time",
                   "In reinforcement learning"][:args.prompts]
        samples = rollouts(client, prompts, args.n, args.max_tokens)
        without = gap(model, samples, replay=False)
        with_replay = gap(model, samples, replay=True)
        mismatch = with_replay[2]  # replay counts the rows where the trainer would have routed otherwise
        print(f"{len(samples)} samples, {sum(len(s['ids']) for s in samples)} sampled tokens")
        print(f"routing decisions (token, MoE layer) where the trainer's own router picks other experts "
              f"than the server: {mismatch.differing}/{mismatch.rows} ({1 - mismatch.agreement:.1%}); "
              f"with replay the trainer uses the server's experts in 100% of them")
        print(f"trainer vs server logprob gap without replay: mean {without[0]:.2e}, max {without[1]:.2e}")
        print(f"trainer vs server logprob gap with replay:    mean {with_replay[0]:.2e}, max {with_replay[1]:.2e}")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loss = grpo_step(model, samples, opt)
        result = sync.push(model.named_parameters(), version=1)
        print(f"one GRPO step with replayed routes: loss {loss:.4f}; the server now serves "
              f"version {result.weight_versions}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
