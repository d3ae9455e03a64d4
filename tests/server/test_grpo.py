"""examples/grpo.py end to end on CPU: two tiny GRPO steps against a real server over gloo,
one of whose pushes fails."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from helpers.servers import start_server, start_side_by_side, stop_server

ADMIN_KEY = "grpo-admin"


@pytest.fixture(scope="module")
def grpo():
    path = Path(__file__).resolve().parents[2] / "examples" / "grpo.py"
    spec = importlib.util.spec_from_file_location("grpo_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _choice(spans, finish_reason="length") -> SimpleNamespace:
    """What the openai client makes of a choice: extensions land in model_extra."""
    return SimpleNamespace(finish_reason=finish_reason, model_extra={"weight_version_spans": spans})


def test_only_single_version_samples_are_attributed(grpo):
    assert grpo.attributed_version(_choice([{"version": 4, "start": 0, "end": 5}])) == 4
    straddling = [{"version": 3, "start": 0, "end": 2}, {"version": 4, "start": 2, "end": 5}]
    assert grpo.attributed_version(_choice(straddling)) is None
    assert grpo.attributed_version(_choice(None)) is None
    assert grpo.attributed_version(_choice([{"version": 4, "start": 0, "end": 5}], "abort")) is None


def test_rewards_and_group_advantages(grpo):
    assert grpo.reward("7 + 5 = 12", 12) == 1.0
    assert grpo.reward("12, no: 13", 12) == 0.0
    assert grpo.reward("twelve", 12) == 0.0
    samples = [grpo.Sample(g, [], [], [], "", r) for g, r in [(0, 1), (0, 0), (1, 1), (1, 1)]]
    assert grpo.group_advantages(samples) == [1.0, -1.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def servers(demo_model, tmp_path_factory):
    """Each test's own server, started side by side: "default", and "on-policy" (--batch-invariant)."""
    logs = tmp_path_factory.mktemp("grpo")
    flags = ("--admin-key", ADMIN_KEY, "--weight-transfer-config", json.dumps({"backend": "gloo", "timeout_s": 30}))
    started = start_side_by_side(partial(start_server, demo_model, logs / "default.log", *flags),
                                 partial(start_server, demo_model, logs / "on-policy.log", "--batch-invariant",
                                         *flags))
    yield dict(zip(("default", "on-policy"), started))
    for server in started:
        stop_server(server)


def test_two_steps_end_to_end_with_a_failed_push(grpo, demo_model, servers, monkeypatch):
    from transformers import AutoModelForCausalLM

    server = servers["default"]
    # The first push after an optimizer step fails before any byte moves.
    pushed, real_push = [], grpo.WeightSyncClient.push

    def flaky_push(self, named, version=None, **kw):
        pushed.append(version)
        if len(pushed) == 2:
            raise grpo.WeightTransferError("injected: server unreachable")
        return real_push(self, named, version=version, **kw)

    monkeypatch.setattr(grpo.WeightSyncClient, "push", flaky_push)
    seen, real_rollouts = [], grpo.rollouts

    def spy(client, served, prompts, cfg, version):
        samples, refused = real_rollouts(client, served, prompts, cfg, version)
        seen.append((version, len(samples), refused))
        return samples, refused

    monkeypatch.setattr(grpo, "rollouts", spy)
    rewards = itertools.cycle([1.0, 0.0])  # every group of two has a signal: the weights move
    cfg = grpo.Config(steps=2, prompts=2, n=2, max_tokens=4, heldout=2, temperature=1.0)
    model, records = grpo.train(cfg, server.url, demo_model, ADMIN_KEY,
                                reward_fn=lambda text, answer: next(rewards))

    assert pushed == [0, 1, 1, 2]  # the failed version 1 is retried before step 2 samples
    # Step 1 sampled version 0; step 2 only once the server held the trainer's version 1.
    assert seen == [(0, 4, 0), (1, 4, 0)]
    step1, step2, final = records
    assert not step1["pushed"] and step2["pushed"]
    assert (step1["eval_version"], step2["eval_version"], final["eval_version"]) == (0, 1, 2)
    for rec in (step1, step2):
        assert rec["trained"] == 4 and math.isfinite(rec["loss"])
        # Same float32 weights on both sides: only kernel rounding separates the logprobs.
        assert rec["dlogp_max"] < 1e-2
    version = httpx.get(f"{server.url}/weight_version",
                        headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["weight_version"]
    assert version == 2
    initial = dict(AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).named_parameters())
    assert any(not torch.equal(p, initial[n]) for n, p in model.named_parameters())


def test_on_policy_gap_is_exactly_zero(grpo, demo_model, servers):
    """--on-policy: a --batch-invariant server and the trainer's forward under
    rlserve.batch_invariant give the same logprobs bit for bit, before and after a push."""
    rewards = itertools.cycle([1.0, 0.0])
    cfg = grpo.Config(steps=2, prompts=2, n=2, max_tokens=4, heldout=2, temperature=1.0, on_policy=True)
    lines: list[str] = []
    _, records = grpo.train(cfg, servers["on-policy"].url, demo_model, ADMIN_KEY,
                            reward_fn=lambda text, answer: next(rewards), log=lines.append)
    steps = [r for r in records if "reward" in r]
    assert [r["rollout_version"] for r in steps] == [0, 1]  # the second step samples pushed weights
    assert all(r["trained"] == 4 and r["tokens"] > 0 and r["dlogp_max"] == 0.0 for r in steps)
    assert sum("gap 0.0 " in line for line in lines) == 2
