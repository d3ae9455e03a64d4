"""`--batch-invariant`: a request's tokens and logprobs are bitwise the same alone, inside a
batch, with its prefix from the cache and with its prompt chunked by 64 tokens; and
transformers' forward under rlserve.batch_invariant.enabled() gives the server's logprobs
bit for bit. Without the mode the same comparison is reported, not asserted."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import pytest
import torch

from helpers.servers import start_server, start_side_by_side, stop_server

MAX_TOKENS = 4
# Eight prompts of about 10 to 130 tokens: the longer ones span several KV blocks and 64-token chunks.
PROMPTS = [f"Story {i}: " + " ".join(f"the {w} number {i * 7 + j} walked in." for j, w in
                                     zip(range(1 + 2 * i), ["red", "blue", "old", "new"] * 10))
           for i in range(8)]


@dataclass(frozen=True)
class Result:
    """One request's outputs, as the server sent them (JSON floats: float32 exactly)."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[str, float], ...], ...]
    prompt_logprobs: tuple[tuple[tuple[str, float], ...] | None, ...]


def generate(client, prompts: list[str], cache_salt: str = "cold") -> list[Result]:
    """`cache_salt`: requests share cached blocks only with earlier ones of the same salt."""
    r = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0,
        logprobs=2, extra_body=dict(prompt_logprobs=1, return_token_ids=True, ignore_eos=True,
                                    cache_salt=cache_salt))
    out = []
    for c in sorted(r.choices, key=lambda c: c.index):
        extra = c.model_extra
        prompt_lps = tuple(None if e is None else tuple(sorted((t, v["logprob"]) for t, v in e.items()))
                           for e in extra["prompt_logprobs"])
        out.append(Result(tuple(extra["prompt_token_ids"]), tuple(extra["token_ids"]), tuple(c.logprobs.token_logprobs),
                          tuple(tuple(sorted(d.items())) for d in c.logprobs.top_logprobs), prompt_lps))
    return out


def runs(server) -> dict[str, list[Result]]:
    """The prompts each alone on a cold cache, all together on a cold cache, and all together
    again with every prompt's prefix in the cache."""
    from openai import OpenAI
    client = OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "EMPTY", max_retries=0,
                    timeout=600)
    alone = [generate(client, [p], cache_salt=f"alone-{i}")[0] for i, p in enumerate(PROMPTS)]
    together = generate(client, PROMPTS, cache_salt="together")
    return {"alone": alone, "together": together,
            "prefix-cache hit": generate(client, PROMPTS, cache_salt="together")}


def differences(want: list[Result], got: list[Result]) -> list[str]:
    """Where each request's outputs part: the field, the first index, the largest gap."""
    report = []
    for i, (a, b) in enumerate(zip(want, got)):
        if a.token_ids != b.token_ids:
            first = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
            report.append(f"prompt {i}: tokens part at output token {first}")
            continue
        for field in ("logprobs", "top_logprobs", "prompt_logprobs"):
            x, y = getattr(a, field), getattr(b, field)
            if x != y:
                first = next(j for j, (u, v) in enumerate(zip(x, y)) if u != v)
                gap = max((abs(u - v) for u, v in zip(_floats(x), _floats(y))), default=0.0)
                report.append(f"prompt {i}: {field} part at {first}, largest gap {gap:.3g}")
                break
    return report


def _floats(values) -> list[float]:
    out: list[float] = []
    for v in values:
        if isinstance(v, float):
            out.append(v)
        elif isinstance(v, tuple):
            out += _floats(v)
    return out


@pytest.fixture(scope="module")
def invariant_runs(demo_model, tmp_path_factory) -> dict[str, list[Result]]:
    """runs() on a --batch-invariant server, and "chunked": the prompts together on a server
    that vLLM's switch (VLLM_BATCH_INVARIANT=1) puts in the mode, prefilling 64 tokens a step."""
    logs = tmp_path_factory.mktemp("bi")
    servers = start_side_by_side(
        partial(start_server, demo_model, logs / "server.log", "--batch-invariant"),
        partial(start_server, demo_model, logs / "chunked.log", "--max-num-batched-tokens", "64",
                env={"VLLM_BATCH_INVARIANT": "1"}))
    try:
        from openai import OpenAI
        found = runs(servers[0])
        client = OpenAI(base_url=f"{servers[1].url}/v1", api_key="EMPTY", max_retries=0, timeout=600)
        return {**found, "chunked": generate(client, PROMPTS, cache_salt="chunked")}
    finally:
        for server in servers:
            stop_server(server)


def test_alone_together_and_cached_are_bitwise_equal(invariant_runs):
    alone = invariant_runs["alone"]
    assert all(len(r.token_ids) == MAX_TOKENS and len(r.logprobs) == MAX_TOKENS for r in alone)
    for name in ("together", "prefix-cache hit"):
        assert differences(alone, invariant_runs[name]) == [], name
        assert invariant_runs[name] == alone


def test_chunked_prefill_is_bitwise_equal(invariant_runs):
    assert differences(invariant_runs["alone"], invariant_runs["chunked"]) == []


def test_trainer_forward_gives_the_servers_logprobs(invariant_runs, hf_demo):
    import rlserve.batch_invariant as bi
    for r in invariant_runs["together"]:
        prompt_ids = list(r.prompt_ids)
        ids = torch.tensor([prompt_ids + list(r.token_ids)])
        with torch.no_grad(), bi.enabled():
            lp = hf_demo(ids).logits[0].float().log_softmax(-1)
        n = len(prompt_ids)
        trainer = [lp[n - 1 + j, t].item() for j, t in enumerate(r.token_ids)]
        assert trainer == list(r.logprobs)  # exactly: the ratio is 1.0
        prompt = [lp[j - 1, t].item() for j, t in enumerate(prompt_ids) if j]
        server = [dict(e)[str(t)] for e, t in zip(r.prompt_logprobs[1:], prompt_ids[1:])]
        assert prompt == server


def test_trainer_batch_with_padding_and_gradients(invariant_runs, hf_demo):
    """A right-padded batch of all eight, as a trainer sends it: the same bits per row; and
    the backward runs, with gradients close to plain torch's."""
    import rlserve.batch_invariant as bi
    results = invariant_runs["together"]
    seqs = [list(r.prompt_ids + r.token_ids) for r in results]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    weight = hf_demo.model.layers[0].self_attn.q_proj.weight
    grads = []
    for on in (True, False):
        hf_demo.zero_grad(set_to_none=True)
        with bi.enabled() if on else torch.enable_grad():
            lp = hf_demo(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
        if on:
            for i, r in enumerate(results):
                got = [lp[i, len(r.prompt_ids) - 1 + j, t].item() for j, t in enumerate(r.token_ids)]
                assert got == list(r.logprobs), i
        (lp[mask.bool()].max(-1).values.sum()).backward()
        grads.append(weight.grad.clone())
    hf_demo.zero_grad(set_to_none=True)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-4)


def test_default_mode_reports_and_does_not_fail(server):
    """The comparison a user runs against the default mode: differences are expected there
    (the GEMM's and attention's reduction order follow the batch) and reported."""
    found = runs(server)
    for name in ("together", "prefix-cache hit"):
        report = differences(found["alone"], found[name])
        print(f"default mode, alone vs {name}: {len(report)} of {len(PROMPTS)} requests differ")
        for line in report:
            print("   ", line)
    assert all(len(r.token_ids) == MAX_TOKENS for rs in found.values() for r in rs)
