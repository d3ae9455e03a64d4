"""vLLM's sampling parameters applied by hand to one row of logits, token by token, as
their definitions read: the oracle the engine's batched sampler is checked against."""

from __future__ import annotations

import collections

import torch

INF = float("inf")


def processed_logits(logits: torch.Tensor, prompt: list[int], output: list[int], p,
                     stop_ids=()) -> torch.Tensor:
    """Allow-list, bad words, min_tokens, logit bias, then the penalties (vLLM's order).

    `output`: the tokens generated before this one; `stop_ids`: what min_tokens holds back
    (the request's stop tokens and end-of-sequence tokens)."""
    x = logits.detach().float().clone()
    if p.allowed_token_ids is not None:
        kept = torch.full_like(x, -INF)
        kept[p.allowed_token_ids] = x[p.allowed_token_ids]
        x = kept
    for word in p.bad_words_token_ids or []:
        before = word[:-1]
        if len(before) <= len(output) and list(output[len(output) - len(before):]) == before:
            x[word[-1]] = -INF
    if len(output) < p.min_tokens:
        for t in stop_ids:
            x[t] = -INF
    for t, bias in (p.logit_bias or {}).items():
        x[t] += bias
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in collections.Counter(output).items():
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    return x


def sampling_logits(x: torch.Tensor, p) -> torch.Tensor:
    """Then temperature, min-p, top-k, top-p: the logits a sample is drawn from (greedy
    rows: temperature 1 and none of the truncations)."""
    if p.temperature == 0:
        return x.clone()
    x = x / p.temperature
    if p.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), -INF)
    if p.top_k > 0:
        kth = x.topk(p.top_k).values[-1]
        x = x.masked_fill(x < kth, -INF)
    if p.top_p < 1:
        values, order = x.sort(descending=True)
        probs = values.softmax(-1)
        before = probs.cumsum(-1) - probs
        x = x.clone()
        x[order[before >= p.top_p]] = -INF
    return x


def close(a: float, b: float, tol: float = 2e-4) -> bool:
    return a == b or abs(a - b) <= tol


def model_logits(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The raw logits before each output token [len(output), V], from one forward pass of a
    transformers model."""
    ids = list(prompt) + list(output)
    with torch.no_grad():
        logits = hf(torch.tensor([ids], device=hf.device)).logits[0].float().cpu()
    return logits[len(prompt) - 1:len(ids) - 1]


def stop_ids(llm, p) -> set[int]:
    """What min_tokens holds back: the request's stop tokens, and end-of-sequence."""
    return set(p.stop_token_ids) | (set() if p.ignore_eos else set(llm.engine.eos_token_ids))


def check_outputs(llm, hf, params, outs, processed: bool) -> None:
    """Every sample of every RequestOutput against the reference (check_sample)."""
    for p, out in zip(params, outs):
        ids = out.prompt_token_ids
        for sample in out.outputs:
            check_sample(model_logits(hf, ids, sample.token_ids), ids, p, sample, stop_ids(llm, p), processed)


def check_sample(logits: torch.Tensor, prompt: list[int], p, sample, stop_ids, processed: bool) -> None:
    """Every token of one engine sample (CompletionOutput) against the reference.

    `logits` [len(sample.token_ids), V]: the model's raw logits before each output token.
    The sampled token is never masked, a greedy one is the processed argmax, and its
    logprob and top alternatives are those of the processed distribution (`processed`)
    or of the raw one."""
    out = sample.token_ids
    for t, token in enumerate(out):
        x = processed_logits(logits[t], prompt, out[:t], p, stop_ids)
        assert x[token] > -INF, f"token {t} ({token}) was masked"
        if p.temperature == 0:
            assert x[token] >= x.max() - 1e-4, f"token {t} ({token}) is not the processed argmax"
        ref = torch.log_softmax(sampling_logits(x, p) if processed else logits[t].float(), -1)
        check_logprob(sample.logprobs[t], ref)


def check_logprob(lp, ref: torch.Tensor) -> None:
    """One TokenLogprob against the reference logprobs of its position."""
    assert close(lp.logprob, ref[lp.token_id].item()), (lp.logprob, ref[lp.token_id].item())
    top = [v for _, v in lp.top]
    assert all(close(v, ref[i].item()) for i, v in lp.top)
    assert all(close(a, b) for a, b in zip(top, ref.topk(len(top)).values.tolist()))


# -- the sampler on its own: the runner's batching and the sampler, on chosen logits ------------

EOS = 2


def _requests(rows, in_flight: bool):
    """Requests holding prompt + output; with `in_flight` the newest token is a
    PLACEHOLDER, as under overlapped scheduling (the device still has it)."""
    from rlserve.engine.request import Request
    from rlserve.sequence import PLACEHOLDER
    reqs, last = [], []
    for i, (p, prompt, output) in enumerate(rows):
        req = Request(f"r{i}", list(prompt), p, frozenset({EOS}), max_model_len=1 << 20, sample_index=i)
        req.token_ids.extend(output)
        last.append(req.token_ids[-1])
        if in_flight and output:
            req.token_ids[-1] = PLACEHOLDER
        reqs.append(req)
    return reqs, last


def sampler_rows(vocab: int):
    """(params, prompt, output) for rows using every processor, greedy and random, next to
    rows using none; and logits [rows, vocab] where each processor changes the outcome."""
    from rlserve import SamplingParams
    g = torch.Generator().manual_seed(0)

    def toks(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    prompt = toks(12)
    out = toks(6)
    fresh = toks(1)[0]
    out += [out[0], out[0], out[2], fresh]  # counts 3 and 2, and a newest token seen once
    x, y, z, w, v = toks(5)
    k = dict(logprobs=5)
    rows = [
        (SamplingParams(temperature=0, repetition_penalty=1.5, **k), prompt, out),
        (SamplingParams(temperature=0.7, top_k=20, presence_penalty=0.5, frequency_penalty=0.7, seed=1, **k),
         prompt, out),
        (SamplingParams(temperature=1.0, allowed_token_ids=prompt[:5] + out[:3],
                        logit_bias={prompt[0]: 2.0, out[1]: -3.0, x: 5.0}, seed=2, **k), prompt, out),
        # x: its prefix ends the output; y: one token of prefix; z: always; v: prefix w does not match
        (SamplingParams(temperature=0, bad_words_token_ids=[[out[-2], out[-1], x], [out[-1], y], [z],
                                                            [w, out[-1], v]], **k), prompt, out),
        (SamplingParams(temperature=0.9, seed=3, **k), prompt, out),
        (SamplingParams(temperature=0, min_tokens=12, repetition_penalty=0.8, **k), prompt, out),
        (SamplingParams(temperature=0.8, min_p=0.05, top_p=0.9, repetition_penalty=1.2, presence_penalty=-0.5,
                        seed=4, **k), prompt, out),
        (SamplingParams(temperature=0, **k), prompt, []),  # first token: nothing to penalise yet
    ]
    logits = torch.randn(len(rows), vocab, generator=g) * 3
    logits[:, out[0]] += 6  # the penalties have a repeated favourite to push down
    logits[:, fresh] += 5  # and one only the newest token (maybe in flight) makes them penalise
    logits[:, EOS] += 8  # min_tokens holds back a likely end
    logits[3, [x, y, z, v]] += 12  # the bad words would win
    logits[0, prompt[3]] = -4.0  # a negative logit the repetition penalty multiplies
    return rows, logits


def grammar_bitmask(rows: int, vocab: int, masked_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed bitmask (rows' bits random in `masked_rows`, all set elsewhere) and the
    bool [rows, vocab] it allows, unpacked here bit by bit."""
    g = torch.Generator().manual_seed(7)
    allowed = torch.ones(rows, vocab, dtype=torch.bool)
    for r in masked_rows:
        allowed[r] = torch.rand(vocab, generator=g) < 0.5
    words = torch.zeros(rows, -(-vocab // 32), dtype=torch.int64)
    for j in range(32):
        bit = torch.zeros(rows, words.shape[1] * 32, dtype=torch.bool)
        bit[:, :vocab] = allowed
        words |= bit[:, j::32].long() << j
    words[:, -1] |= ((1 << 32) - (1 << (vocab % 32 or 32))) if vocab % 32 else 0  # padding bits: set
    return ((words + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32), allowed


def check_sampler(runner, logits_dtype: torch.dtype, in_flight: bool, bitmask: bool = False) -> None:
    """The runner's SamplingBatch and the sampler on `sampler_rows` against the reference:
    processed logprobs (the runner must run in processed_logprobs mode), top alternatives,
    greedy choices, and nothing masked ever sampled. With `bitmask`, some rows also carry a
    grammar mask, given to the runner after launch as a structured output's is."""
    from rlserve.worker.model_runner import StepHandle
    vocab = runner.model.config.vocab_size
    rows, logits = sampler_rows(vocab)
    reqs, last = _requests(rows, in_flight)
    batch = runner.sampling_batch(reqs, torch.tensor(last, device=runner.device))
    device_logits = logits.to(runner.device, logits_dtype)
    handle = StepHandle(list(range(len(rows))), None, {}, {}, pending=(device_logits.clone(), batch))
    mask, allowed = grammar_bitmask(len(rows), vocab, [0, 1, 4, 6] if bitmask else [])
    runner.sample(handle, mask if bitmask else None)
    out = handle.sampled
    tokens, chosen = out.token_ids.tolist(), out.logprobs.tolist()
    top_ids, top_lp = out.top_ids.tolist(), out.top_logprobs.tolist()
    for i, (p, prompt, output) in enumerate(rows):
        row_logits = device_logits[i].float().cpu().masked_fill(~allowed[i], -INF)
        x = processed_logits(row_logits, prompt, output, p, {EOS} | set(p.stop_token_ids))
        ref = torch.log_softmax(sampling_logits(x, p), -1)
        token = tokens[i]
        assert x[token] > -INF, (i, token)
        if p.temperature == 0:
            assert x[token] >= x.max() - 1e-4, (i, token)
        assert close(chosen[i], ref[token].item()), (i, chosen[i], ref[token].item())
        assert all(close(val, ref[t].item()) for t, val in zip(top_ids[i], top_lp[i])), i
        assert all(close(a, b) for a, b in zip(top_lp[i], ref.topk(5).values.tolist())), i


def check_sample_frequencies(runner, num_samples: int, temperature: float = 0.9, **kw) -> None:
    """Many seeded rows of one request shape on the same logits: the sampled tokens'
    frequencies follow the reference distribution (processors, then temperature), and each
    draw's processed logprob is the reference's (the runner runs in processed_logprobs mode)."""
    from rlserve import SamplingParams
    from rlserve.worker import sampler as S
    vocab = runner.model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    live = torch.randperm(vocab - 3, generator=g)[:12] + 3
    logits = torch.full((vocab,), -30.0)
    logits[live] = torch.randn(12, generator=g)
    prompt, output = live[:3].tolist(), [live[3].item(), live[3].item(), live[4].item()]
    p = SamplingParams(temperature=temperature, seed=5, repetition_penalty=1.3, presence_penalty=0.4,
                       frequency_penalty=0.3, logit_bias={live[5].item(): 1.0, live[6].item(): -1.0},
                       allowed_token_ids=live[:10].tolist(), bad_words_token_ids=[[live[4].item(), live[7].item()]],
                       logprobs=0, **kw)
    reqs, last = _requests([(p, prompt, output)] * num_samples, in_flight=True)
    batch = runner.sampling_batch(reqs, torch.tensor(last, device=runner.device))
    out = S.sample(logits.to(runner.device).expand(num_samples, vocab).clone(), batch, runner.kernels.sample)
    tokens = out.token_ids.cpu()
    expected_logits = sampling_logits(processed_logits(logits, prompt, output, p), p)
    assert (out.logprobs.cpu() - expected_logits.log_softmax(-1)[tokens]).abs().max() < 2e-4
    expected = expected_logits.softmax(-1)
    counts = torch.bincount(tokens, minlength=vocab).double() / num_samples
    assert expected[tokens].min() > 0, "a masked token was sampled"
    sd = (expected * (1 - expected) / num_samples).sqrt()
    assert ((counts - expected).abs() <= 4 * sd + 2 / num_samples).all(), \
        [(t, counts[t].item(), expected[t].item()) for t in live.tolist()]
