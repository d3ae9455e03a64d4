"""GRPO on small arithmetic: rollouts from `rlserve serve`, the trainer's weights pushed live every step.

    python examples/grpo.py                         # starts a server on the demo model (CPU, float32, gloo)
    python examples/grpo.py --base-url http://HOST:8000 --admin-key KEY   # or uses a running one
    python examples/grpo.py --on-policy             # true on-policy: the trainer/server gap is 0.0

Each step:
1. Rollouts: `--prompts` questions ("What is 7 + 5? Answer with just the number.") times `--n`
   samples, through the openai client, with the sampled tokens' ids, logprobs and weight
   versions. Alongside, greedy answers to the held-out questions: the accuracy curve.
2. Samples not produced entirely by the weights the trainer holds are refused.
3. Reward 1 when the last number in the answer is the sum; advantages normalised per group.
4. A clipped policy-gradient loss with the rollout logprobs as the behaviour policy; one AdamW step.
5. The new weights go to the server as version `step` (with `--lora`, only the adapter's). A failed
   push is logged and retried at the start of the next step; until one succeeds no rollout is
   trained on.

The loss never sees a token the trainer cannot attribute to its own weights, and the log shows
how far the server's logprobs are from the trainer's for the same tokens (|dlogp|). With
`--on-policy` the server runs `--batch-invariant` and the trainer's forward runs under
`rlserve.batch_invariant.enabled()`: the same ops per row on both sides, so the gap printed each
step is exactly 0.0 and the importance ratio of every token is exactly 1 before the update.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import requests
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

import rlserve.batch_invariant
from rlserve.server.launcher import ServerProcess
from rlserve.weight_transfer import WeightSyncClient, WeightTransferError

QUESTION = "What is {a} + {b}? Answer with just the number."
LORA_NAME = "grpo-lora"  # the adapter's model name on the server (--lora)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Config:
    steps: int = 30
    prompts: int = 16  # questions per step
    n: int = 8  # samples per question (the GRPO group)
    max_tokens: int = 12
    # Below 1 so that samples stay mostly on-topic for a 135M model. The server reports, and the
    # trainer computes, logprobs of the raw (untempered) distribution, so the two compare like
    # for like; the tempered samples make the update slightly off-policy for the raw policy.
    temperature: float = 0.7
    lr: float = 3e-5
    clip: float = 0.2
    heldout: int = 50
    low: int = 1  # operands are drawn from [low, high]
    high: int = 15
    micro_batch: int = 16  # sequences per forward/backward, to bound activation memory
    seed: int = 0
    # --lora: train a PEFT LoRA adapter on every projection instead of all weights, and push
    # only the adapter (served as the model LORA_NAME); its own learning rate.
    lora: bool = False
    lora_rank: int = 16
    lora_lr: float = 2e-4
    # --on-policy: a batch-invariant server (--batch-invariant) and the same ops in the trainer's
    # forward (rlserve.batch_invariant): the trainer's logprobs equal the server's bit for bit.
    on_policy: bool = False


@dataclass
class Sample:
    group: int
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]  # the server's logprobs of `ids`: the behaviour policy
    text: str
    reward: float = 0.0


def reward(text: str, answer: int) -> float:
    numbers = re.findall(r"-?\d+", text)
    return float(bool(numbers) and int(numbers[-1]) == answer)


def make_problems(cfg: Config) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Held-out and training questions. A pair is held out in both orders, so the held-out
    accuracy measures more than memorising the training sums."""
    rng = random.Random(cfg.seed)
    pairs = [(a, b) for a in range(cfg.low, cfg.high + 1) for b in range(a, cfg.high + 1)]
    rng.shuffle(pairs)
    held, train = pairs[:cfg.heldout], pairs[cfg.heldout:]
    held = [(b, a) if rng.random() < 0.5 else (a, b) for a, b in held]
    train = train + [(b, a) for a, b in train if a != b]

    def as_question(pairs):
        return [(QUESTION.format(a=a, b=b), a + b) for a, b in pairs]
    return as_question(held), as_question(train)


def attributed_version(choice) -> int | None:
    """The one weight version that produced every token of `choice`; None if there is none
    (no spans, or spans from several versions: a request that straddled an update)."""
    extra = choice.model_extra or {}
    versions = {s["version"] for s in extra.get("weight_version_spans") or []}
    if choice.finish_reason == "abort" or len(versions) != 1:
        return None
    return versions.pop()


def rollouts(client: OpenAI, served: str, prompts: list[str], cfg: Config,
             version: int) -> tuple[list[Sample], int]:
    """Samples of the current server weights; those not all from `version` are refused."""
    r = client.completions.create(
        model=served, prompt=prompts, n=cfg.n, max_tokens=cfg.max_tokens,
        temperature=cfg.temperature, logprobs=0,
        extra_body=dict(return_token_ids=True, return_weight_versions=True))
    samples, refused = [], 0
    for c in sorted(r.choices, key=lambda c: c.index):
        extra = c.model_extra
        if attributed_version(c) != version or len(c.logprobs.token_logprobs) != len(extra["token_ids"]):
            refused += 1
            continue
        samples.append(Sample(c.index // cfg.n, extra["prompt_token_ids"], extra["token_ids"],
                              c.logprobs.token_logprobs, c.text))
    return samples, refused


def heldout_accuracy(client: OpenAI, served: str, prompts: list[str], answers: list[int],
                     max_tokens: int) -> tuple[float, int, list[str]]:
    r = client.completions.create(model=served, prompt=prompts, max_tokens=max_tokens, temperature=0)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    return sum(reward(t, a) for t, a in zip(texts, answers)) / len(answers), r.weight_version, texts


def group_advantages(samples: list[Sample]) -> list[float]:
    """(r - mean) / std within each question's group; 0 where the group agrees (no signal)."""
    groups: dict[int, list[float]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s.reward)
    stats = {g: (statistics.fmean(rs), statistics.pstdev(rs)) for g, rs in groups.items()}
    return [(s.reward - mean) / std if std > 0 else 0.0
            for s in samples for mean, std in [stats[s.group]]]


def token_logprobs(model, samples: list[Sample]) -> list[torch.Tensor]:
    """The trainer's logprobs of each sample's completion tokens (raw distribution)."""
    seqs = [s.prompt_ids + s.ids for s in samples]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows, cols, targets = [], [], []
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        ids[i, :len(seq)], mask[i, :len(seq)] = torch.tensor(seq), 1
        rows += [i] * len(s.ids)
        cols += range(len(s.prompt_ids) - 1, len(seq) - 1)
        targets += s.ids
    if hasattr(model, "get_base_model"):  # a PeftModel (--lora): its LoRA layers are in there
        model = model.get_base_model()
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    # The LM head only where a sampled token is predicted: most of a sequence is prompt.
    logits = model.lm_head(hidden[rows, cols])
    lp = logits.log_softmax(-1).gather(-1, torch.tensor(targets)[:, None])[:, 0]
    return list(lp.split([len(s.ids) for s in samples]))


def policy_gradient(model, samples: list[Sample], advantages: list[float], cfg: Config) -> dict:
    """Accumulates the gradient of the clipped surrogate (each sample's token mean, averaged
    over samples). Zero-advantage samples contribute nothing, so they are not even computed."""
    active = [(s, a) for s, a in zip(samples, advantages) if a != 0]
    loss_sum, diffs, clipped = 0.0, [], 0
    forward = rlserve.batch_invariant.enabled if cfg.on_policy else contextlib.nullcontext
    for i in range(0, len(active), cfg.micro_batch):
        chunk = active[i:i + cfg.micro_batch]
        with forward():
            new = token_logprobs(model, [s for s, _ in chunk])
        loss = 0.0
        for (s, adv), lp in zip(chunk, new):
            old = torch.tensor(s.logprobs)
            ratio = (lp - old).exp()
            surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * adv)
            loss = loss - surrogate.mean() / len(samples)
            diffs.append((lp.detach() - old).abs())
            clipped += int(((ratio - 1).abs() > cfg.clip).sum())
        loss.backward()
        loss_sum += float(loss.detach())
    if not active and samples:  # nothing to learn from: still measure the mismatch, on one group
        with torch.no_grad(), forward():
            group = [s for s in samples if s.group == samples[0].group]
            diffs = [(lp - torch.tensor(s.logprobs)).abs()
                     for s, lp in zip(group, token_logprobs(model, group))]
    d = torch.cat(diffs) if diffs else torch.zeros(0)
    return dict(loss=loss_sum, trained=len(active), tokens=d.numel(),
                dlogp_mean=float(d.mean()) if d.numel() else None,
                dlogp_max=float(d.max()) if d.numel() else None,
                clip_frac=clipped / max(d.numel(), 1))


def push(sync: WeightSyncClient, model, version: int, log) -> bool:
    """Sends all weights as `version`; False (logged) when that fails: the server then keeps
    serving its previous weights, and the caller retries."""
    try:
        if sync.group is None or sync.group.broken:  # a transport failure needs a fresh group
            sync.init()
        if hasattr(model, "peft_config"):  # --lora: the adapter alone, a few MB
            result = sync.push_lora(LORA_NAME, model, version=version)
        else:
            result = sync.push(model.named_parameters(), version=version)
    except (WeightTransferError, requests.RequestException) as e:
        log(f"push of version {version} failed, retrying next step: {e}")
        return False
    if result.weight_versions != [version]:
        log(f"push of version {version}: server reports {result.weight_versions}")
        return False
    return True


def train(cfg: Config, base_url: str, model_path: str, admin_key: str | None = None,
          reward_fn=reward, on_step=None, log=print) -> tuple[torch.nn.Module, list[dict]]:
    """Runs the loop against the server at `base_url`; returns the trained model and one
    record per step (and a last one for the final held-out accuracy)."""
    rng = random.Random(cfg.seed + 1)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    lr = cfg.lr
    if cfg.lora and cfg.on_policy:
        raise ValueError("--on-policy: not with --lora (the server's adapter kernels are not batch-invariant yet)")
    if cfg.lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank,
                                                 target_modules=LORA_TARGETS, lora_dropout=0.0))
        lr = cfg.lora_lr
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    client = OpenAI(base_url=f"{base_url}/v1", api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                    timeout=600)
    # --lora: rollouts name the adapter, which the first push creates on the server
    served = LORA_NAME if cfg.lora else client.models.list().data[0].id

    def chat(q):
        return tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
    heldout, train_set = make_problems(cfg)
    heldout_prompts = [chat(q) for q, _ in heldout]
    pool = ThreadPoolExecutor(1)

    sync = WeightSyncClient(base_url, backend="gloo", admin_key=admin_key)
    version = 0  # the trainer's weights; the server holds them once `live == version`
    # Whatever the server loaded, it now serves exactly the trainer's starting weights.
    live = version if push(sync, model, version, log) else None
    records = []
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        if live != version:
            live = version if push(sync, model, version, log) else live
            if live != version:
                records.append(dict(step=step, skipped=True))
                continue
        problems = rng.sample(train_set, cfg.prompts)
        evaluation = pool.submit(heldout_accuracy, client, served, heldout_prompts,
                                 [a for _, a in heldout], cfg.max_tokens)
        samples, refused = rollouts(client, served, [chat(q) for q, _ in problems], cfg, version)
        for s in samples:
            s.reward = reward_fn(s.text, problems[s.group][1])
        acc, eval_version, answers = evaluation.result()
        if step == 1:
            _show(heldout, answers, log)
        t1 = time.perf_counter()

        opt.zero_grad(set_to_none=True)
        stats = policy_gradient(model, samples, group_advantages(samples), cfg) if samples else {}
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        rollout_version, version = version, step
        t2 = time.perf_counter()
        live = version if push(sync, model, version, log) else live
        t3 = time.perf_counter()

        rec = dict(step=step, rollout_version=rollout_version, eval_version=eval_version,
                   heldout_acc=acc, reward=sum(s.reward for s in samples) / max(len(samples), 1),
                   kept=len(samples), refused=refused, pushed=live == version, **stats,
                   rollout_s=t1 - t0, train_s=t2 - t1, push_s=t3 - t2)
        records.append(rec)
        log(f"step {step:3d}  reward {rec['reward']:.2f}  held-out acc {acc:.2f} (v{eval_version})  "
            f"kept {len(samples)}/{len(samples) + refused}  trained {stats.get('trained', 0)}  "
            f"loss {stats.get('loss', 0):+.4f}  |dlogp| mean {_fmt(stats.get('dlogp_mean'))} "
            f"max {_fmt(stats.get('dlogp_max'))}  clip {stats.get('clip_frac', 0):.2f}  "
            + (f"gap {stats.get('dlogp_max')}  " if cfg.on_policy else "") +
            f"| rollout {t1 - t0:.0f}s train {t2 - t1:.0f}s push {t3 - t2:.1f}s")
        if on_step:
            on_step(records)

    if live == version:
        acc, eval_version, answers = heldout_accuracy(client, served, heldout_prompts,
                                                      [a for _, a in heldout], cfg.max_tokens)
        records.append(dict(step=cfg.steps + 1, eval_version=eval_version, heldout_acc=acc, final=True))
        log(f"final held-out acc {acc:.2f} (v{eval_version})")
        _show(heldout, answers, log)
        if on_step:
            on_step(records)
    pool.shutdown()
    return model, records


def _show(heldout: list[tuple[str, int]], answers: list[str], log, k: int = 4) -> None:
    for (q, a), text in zip(heldout[:k], answers):
        log(f"    {q} ({a}) -> {text!r}")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def save_plot(records: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = [r for r in records if "reward" in r]
    evals = [r for r in records if "heldout_acc" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["rollout_version"] for r in trained], [r["reward"] for r in trained],
            "o-", label="mean reward of the sampled rollouts")
    ax.plot([r["eval_version"] for r in evals], [r["heldout_acc"] for r in evals],
            "s-", label=f"held-out greedy accuracy ({len(evals)} evals)")
    ax.set_xlabel("weight version (= optimizer steps taken)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("GRPO on SmolLM2-135M-Instruct, a + b, rollouts from rlserve")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def start_server(model_path: str, log_path: str, cfg: Config | None = None) -> ServerProcess:
    lora = ["--enable-lora", "--max-lora-rank", str(cfg.lora_rank)] if cfg is not None and cfg.lora else []
    invariant = ["--batch-invariant"] if cfg is not None and cfg.on_policy else []
    return ServerProcess(model_path, "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
                         "--weight-transfer-config", json.dumps({"backend": "gloo"}), *lora, *invariant,
                         log=log_path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in asdict(Config()).items():
        if isinstance(value, bool):
            p.add_argument(f"--{name.replace('_', '-')}", action="store_true")
        else:
            p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--model", default=None, help="HF directory (default: the demo model)")
    p.add_argument("--base-url", default=None, help="a running server (default: start one)")
    p.add_argument("--admin-key", default=os.environ.get("RLSERVE_ADMIN_KEY"))
    p.add_argument("--plot", default=os.path.join(os.path.dirname(__file__), "grpo_plot.png"))
    p.add_argument("--log-json", default=None, help="write the per-step records here")
    args = p.parse_args()
    cfg = Config(**{k: getattr(args, k) for k in asdict(Config())})
    if args.model is None:
        from rlserve.model.demo_model import demo_model_path
        args.model = demo_model_path()

    def on_step(records):
        save_plot(records, args.plot)
        if args.log_json:
            with open(args.log_json, "w") as f:
                json.dump(dict(config=asdict(cfg), records=records), f, indent=1)

    start = time.perf_counter()
    server, url = None, args.base_url
    if url is None:
        server_log = os.path.join(tempfile.gettempdir(), f"grpo_server_{os.getpid()}.log")
        print(f"starting rlserve on {args.model} (log: {server_log})")
        server = start_server(args.model, server_log, cfg)
        url = server.url
    try:
        _, records = train(cfg, url.rstrip("/"), args.model, args.admin_key, on_step=on_step)
    finally:
        if server is not None:
            server.stop()
    evals = [r["heldout_acc"] for r in records if "heldout_acc" in r]
    print(f"held-out greedy accuracy {evals[0]:.2f} -> {evals[-1]:.2f} in {cfg.steps} steps, "
          f"{time.perf_counter() - start:.0f} s; plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
