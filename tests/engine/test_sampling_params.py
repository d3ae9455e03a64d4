"""vLLM's penalties, logit bias, allow-lists and bad words, and processed logprobs.

What the engine samples from is checked against the definitions applied by hand
(sampling_reference) to the model's logits for the same context, computed by
transformers on the same weights: the processed logprobs of every sampled token and its
top alternatives, greedy choices, seeded frequencies. Then: validation names the field,
seeded sampling stays reproducible, overlapped scheduling and preemption change nothing,
and tensor-parallel ranks take rank 0's tokens.
"""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from helpers.sampling_reference import (
    check_logprob,
    check_outputs,
    check_sample,
    check_sample_frequencies,
    check_sampler,
    model_logits,
    processed_logits,
    sampling_logits,
    stop_ids,
)
from rlserve import LLM, SamplingParams
from rlserve.config import EngineConfig
from rlserve.engine.request import Request
from rlserve.frontend.bad_words import bad_words_to_token_ids
from rlserve.model.demo_model import demo_model_path
from rlserve.sampling_params import InvalidRequestError

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:",
    "1, 2, 3, 4,",
]
MAX_TOKENS = 8
ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="module")
def model_path() -> str:
    return demo_model_path()


@pytest.fixture(scope="module")
def raw(model_path) -> LLM:
    return LLM(model_path, **ENGINE)


@pytest.fixture(scope="module")
def processed(model_path) -> LLM:
    return LLM(model_path, logprobs_mode="processed_logprobs", **ENGINE)


@pytest.fixture(scope="module")
def hf(hf_demo):
    return hf_demo


def cases(llm: LLM) -> tuple[list[list[int]], dict[str, SamplingParams]]:
    """Parameters whose effect shows in the first tokens, built from the plain greedy
    outputs of PROMPTS[:2] (which token to bias, ban or allow)."""
    plain = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    o = [r.outputs[0].token_ids for r in plain]
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return o, {
        "repetition > 1": SamplingParams(repetition_penalty=1.6, **greedy),
        "repetition < 1": SamplingParams(repetition_penalty=0.6, **greedy),
        "presence": SamplingParams(presence_penalty=1.8, **greedy),
        "frequency": SamplingParams(frequency_penalty=2.0, **greedy),
        "negative presence and frequency": SamplingParams(presence_penalty=-2.0, frequency_penalty=-2.0,
                                                          **greedy),
        "logit_bias": SamplingParams(logit_bias={o[0][0]: -100, o[1][0]: -100, o[0][4]: 7.5}, **greedy),
        "allowed_token_ids": SamplingParams(allowed_token_ids=sorted(set(o[0][3:] + o[1][3:])), **greedy),
        # o[0][3] is banned once the output ends with o[0][2], and o[1][1] everywhere
        "bad_words_token_ids": SamplingParams(bad_words_token_ids=[[o[0][2], o[0][3]], [o[1][1]]], **greedy),
        "everything": SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, logprobs=5, repetition_penalty=1.2, presence_penalty=0.5,
            frequency_penalty=0.3, logit_bias={o[0][1]: -5.0, o[1][2]: 2.0}, min_tokens=6,
            bad_words_token_ids=[[o[0][0], o[0][1], o[0][2]], [o[1][3]]]),
        "random": SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=MAX_TOKENS, logprobs=3,
                                 presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2,
                                 logit_bias={o[1][2]: 3.0}),
    }


def test_each_processor_matches_its_definition(raw, processed, hf):
    """Every case on both prompts, all in one batch: every token is the processed argmax
    (greedy), never a masked one, and its logprobs are the processed distribution's
    (processed_logprobs, here with overlapped scheduling) or the raw one's (the default,
    without), computed by hand from the model's logits."""
    plain, all_cases = cases(raw)
    names = [name for name in all_cases for _ in PROMPTS[:2]]
    prompts, params = PROMPTS[:2] * len(all_cases), [all_cases[name] for name in names]
    processed.engine.async_scheduling = True
    try:
        outs = processed.generate(prompts, params)
    finally:
        processed.engine.async_scheduling = False
    raw_outs = raw.generate(prompts, params)
    check_outputs(processed, hf, params, outs, processed=True)
    check_outputs(raw, hf, params, raw_outs, processed=False)
    tokens = [r.outputs[0].token_ids for r in outs]
    assert [r.outputs[0].token_ids for r in raw_outs] == tokens  # the mode changes logprobs only
    for i in range(0, len(tokens), 2):
        if names[i] != "random":
            assert tokens[i:i + 2] != plain, f"{names[i]}: no effect on the greedy outputs"
        if names[i] == "allowed_token_ids":
            assert set(tokens[i] + tokens[i + 1]) <= set(all_cases[names[i]].allowed_token_ids)


def test_samples_follow_the_processed_distribution(processed, hf):
    """One token from many seeded samples of one prompt: each sample's processed logprob
    is the reference's, and their frequencies follow it (allow-list, bias and repetition
    penalty, then temperature, min-p and top-k)."""
    tok = processed.get_tokenizer()
    prompt = tok.encode(PROMPTS[0])
    logits = model_logits(hf, prompt, [0])[0]
    top = logits.topk(6).indices.tolist()
    allowed = top + prompt[1:4]
    p = SamplingParams(n=256, seed=11, temperature=0.8, top_k=6, min_p=0.01, max_tokens=1, logprobs=0,
                       allowed_token_ids=allowed, repetition_penalty=1.4,
                       logit_bias={top[0]: -1.0, top[4]: 1.5, prompt[1]: 6.0, prompt[2]: 15.0})
    expected = sampling_logits(processed_logits(logits, prompt, [], p), p)
    probs = expected.softmax(-1)
    out = processed.generate([prompt], p)[0]
    tokens = torch.tensor([s.token_ids[0] for s in out.outputs])
    ref = expected.log_softmax(-1)
    for s in out.outputs:
        check_logprob(s.logprobs[0], ref)
    freq = torch.bincount(tokens, minlength=probs.numel()).double() / len(tokens)
    sd = (probs * (1 - probs) / len(tokens)).sqrt()
    assert ((freq - probs).abs() <= 4 * sd + 1e-9).all()
    assert probs[prompt[2]] > 0.05, "the case should sample a prompt token the penalty pushed down"


@pytest.mark.parametrize("in_flight, bitmask", [(False, False), (True, False), (True, True)])
def test_sampler_on_chosen_logits(processed, in_flight, bitmask):
    """The runner's batching and the sampler on logits built so that every processor
    decides something, rows with and without processors side by side; `in_flight`: each
    row's newest token is still a placeholder on the host (overlapped scheduling), so
    bad words and penalties take it from the device; `bitmask`: some rows also have a
    structured output's grammar mask."""
    check_sampler(processed.engine.executor.local_runner, torch.float32, in_flight, bitmask)


def test_seeded_samples_frequencies(processed):
    check_sample_frequencies(processed.engine.executor.local_runner, num_samples=2048)


def test_fused_sampling_branch(processed, monkeypatch):
    """On CUDA, rows with temperature alone take the fused Gumbel-max kernel
    (rlserve.ops.triton_sampling), after the processors. Triton is not here: the kernel's
    definition, argmax(logits / T + Gumbel noise), stands in for it so that the branch
    around it (processed logits in, processed logprobs out) runs on CPU too; the kernel
    itself is checked on the GPU (test_gpu_engine, test_gpu_sampling)."""
    def gumbel_sample(logits, temperature, seeds):
        g = torch.Generator().manual_seed(int(seeds[0]))
        u = torch.rand(logits.shape, generator=g, dtype=torch.float64).clamp_min(1e-300)
        return (logits.double() / temperature.double().unsqueeze(1) - (-u.log()).log()).argmax(-1)

    runner = processed.engine.executor.local_runner
    monkeypatch.setattr(runner, "kernels", dataclasses.replace(runner.kernels, sample=gumbel_sample))
    check_sample_frequencies(runner, num_samples=2048)


def test_no_processors_no_extra_work(raw):
    """Requests without these parameters add nothing to a step: no processors, no arrays."""
    runner = raw.engine.executor.local_runner
    reqs = [Request(f"p{i}", [5, 6, 7], SamplingParams(temperature=t, top_k=k, seed=s, min_tokens=0))
            for i, (t, k, s) in enumerate([(0, 0, None), (0.7, 20, 3), (1.0, 0, None)])]
    assert all(r.processors is None for r in reqs)
    assert runner.sampling_batch(reqs).processing is None
    # Greedy rows drop top-k/p and min-p (vLLM): they cannot change the argmax.
    assert Request("g", [5], SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2)).sampling_row[1:4] \
        == (1.0, 0.0, 0)


def test_seeded_sampling_with_processors_is_reproducible(raw):
    p = SamplingParams(n=2, temperature=1.0, seed=42, max_tokens=16, presence_penalty=0.8,
                       repetition_penalty=1.3, logit_bias={11: 2.0}, bad_words_token_ids=[[13], [30, 198]])
    alone = [s.token_ids for s in raw.generate([PROMPTS[0]], p)[0].outputs]
    assert alone == [s.token_ids for s in raw.generate([PROMPTS[0]], p)[0].outputs]
    others = SamplingParams(temperature=0.7, seed=1, max_tokens=10, frequency_penalty=1.0)
    batched = raw.generate(PROMPTS[1:] + [PROMPTS[0]], [others] * 4 + [p])[-1]
    assert [s.token_ids for s in batched.outputs] == alone
    assert alone[0] != alone[1]  # sample i of n has its own stream


def test_overlapped_scheduling_and_preemption_give_the_same_outputs(model_path, raw):
    """Penalty counts and bad words read the newest token, which overlapped scheduling
    leaves on the device; preemption rebuilds the rows' history from the host."""
    o, all_cases = cases(raw)
    params = [SamplingParams(temperature=0, max_tokens=24, logprobs=1, repetition_penalty=1.3,
                             bad_words_token_ids=[[o[0][2], o[0][3]]], ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=20, presence_penalty=0.7,
                             frequency_penalty=0.4, logit_bias={o[1][0]: 2.0}),
              SamplingParams(temperature=0.8, seed=9, max_tokens=22, min_tokens=8,
                             allowed_token_ids=sorted(set(o[0] + o[1])), bad_words_token_ids=[[o[1][1], o[1][2]]]),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              all_cases["everything"]]

    def run(llm):
        outs = llm.generate(PROMPTS, params)
        return [[(s.token_ids, [round(lp.logprob, 4) for lp in s.logprobs or []]) for s in r.outputs]
                for r in outs]

    plain = run(raw)
    raw.engine.async_scheduling = True
    try:
        assert run(raw) == plain
    finally:
        raw.engine.async_scheduling = False
    tight = LLM(model_path, device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=6,
                async_scheduling=True)
    got = run(tight)
    assert tight.engine.stats().preemptions_total > 0
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in plain]


def test_tensor_parallel_ranks_read_rank0_tokens(model_path, raw):
    """Rank 0 samples (processors, grammar masks, seeds) and broadcasts its tokens; rank 1
    reads them, also where its next step was queued before they reached the host
    (overlapped scheduling) and where a preempted request comes back (its tokens, some
    first sent while still being sampled, recomputed on rank 1). TP=2 gives TP=1's greedy
    tokens, overlapped or not, and the same seeded samples overlapped as not."""
    _, all_cases = cases(raw)
    greedy = [all_cases["everything"], all_cases["logit_bias"], all_cases["allowed_token_ids"],
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)]
    seeded = [dataclasses.replace(all_cases["random"], max_tokens=16), SamplingParams(n=2, temperature=1.0, seed=7,
                                                                                    max_tokens=16)]
    expected = [r.outputs[0].token_ids for r in raw.generate(PROMPTS[:4], greedy)]
    # Six blocks of 16 tokens for seven sequences of up to 35: preemption on every run.
    llm = LLM(model_path, device="cpu", dtype="float32", max_model_len=256, tensor_parallel_size=2,
              num_kv_blocks=6)
    try:
        runs = []
        for overlapped in (False, True):
            llm.engine.async_scheduling = overlapped
            before = llm.engine.stats().preemptions_total
            outs = llm.generate(PROMPTS[:4] + PROMPTS[3:5], greedy + seeded)
            assert llm.engine.stats().preemptions_total > before
            runs.append([[o.token_ids for o in r.outputs] for r in outs])
        for tokens in runs:
            assert [t[0] for t in tokens[:4]] == expected
        assert runs[1] == runs[0]
    finally:
        llm.shutdown()


def test_new_fields_survive_the_step_message():
    from rlserve.worker.channel import _request_from_wire, _request_to_wire
    p = SamplingParams(logit_bias={5: 1.5, 70: -2.0}, allowed_token_ids=[5, 70, 9], presence_penalty=0.5,
                       bad_words_token_ids=[[1, 2], [3]], frequency_penalty=-0.25, repetition_penalty=1.1)
    wire = msgpack.unpackb(msgpack.packb(_request_to_wire(Request("r", [1, 2], p)), use_bin_type=True), raw=False)
    back = _request_from_wire(wire)
    assert back.sampling_params == p
    assert back.processors.penalties == (1.1, -0.25, 0.5)


def test_bad_words_convert_as_vllm_does(raw, processed, hf):
    """Each word without and with a leading space (the spaced form when it is another
    token of the same length); generation never produces them."""
    tok = raw.get_tokenizer()
    paris, space_paris = tok.encode("Paris", add_special_tokens=False), tok.encode(" Paris", add_special_tokens=False)
    assert bad_words_to_token_ids(tok, [" Paris", "Parisian"]) == [
        paris, space_paris, tok.encode("Parisian", add_special_tokens=False),
        tok.encode(" Parisian", add_special_tokens=False)]
    p = SamplingParams(temperature=0, max_tokens=16, bad_words=["Paris", "capital"], logprobs=2)
    out = processed.generate([PROMPTS[0]], p)[0].outputs[0]
    assert raw.generate([PROMPTS[0]],
                        SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text.startswith(" Paris")
    assert "Paris" not in out.text and "capital" not in out.text
    converted = SamplingParams(temperature=0, max_tokens=16, logprobs=2,
                               bad_words_token_ids=bad_words_to_token_ids(tok, ["Paris", "capital"]))
    ids = tok.encode(PROMPTS[0])
    check_sample(model_logits(hf, ids, out.token_ids), ids, converted, out, stop_ids(raw, p), True)
    with pytest.raises(InvalidRequestError) as e:
        raw.generate(["hi"], SamplingParams(bad_words=["  "]))
    assert e.value.param == "bad_words"


@pytest.mark.parametrize("kwargs, field, limit", [
    (dict(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
    (dict(presence_penalty=float("nan")), "presence_penalty", "[-2, 2]"),
    (dict(frequency_penalty=-2.01), "frequency_penalty", "[-2, 2]"),
    (dict(repetition_penalty=0), "repetition_penalty", "> 0"),
    (dict(repetition_penalty=-5), "repetition_penalty", "> 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty", "finite"),
    (dict(logit_bias={5: 100.5}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias={5: -101}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias={5: float("nan")}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias={"five": 1.0}), "logit_bias", "not a token id"),
    (dict(logit_bias={-1: 1.0}), "logit_bias", "negative"),
    (dict(logit_bias={5: "x"}), "logit_bias", "not a number"),
    (dict(allowed_token_ids=[]), "allowed_token_ids", "empty"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids", ">= 0"),
    (dict(allowed_token_ids=["a"]), "allowed_token_ids", ">= 0"),
    (dict(bad_words=[""]), "bad_words", "non-empty"),
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids", "at least one"),
    (dict(bad_words_token_ids=[[1, -2]]), "bad_words_token_ids", ">= 0"),
])
def test_bad_values_name_the_field_and_the_limit(kwargs, field, limit):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field
    assert str(e.value).startswith(f"{field}:") and limit in str(e.value), str(e.value)


def test_token_ids_outside_the_vocabulary_are_refused_before_anything_runs(raw, model_path):
    vocab = raw.engine.vocab_size
    for kwargs, field in [(dict(logit_bias={vocab: 1.0}), "logit_bias"),
                          (dict(allowed_token_ids=[1, vocab]), "allowed_token_ids"),
                          (dict(bad_words_token_ids=[[1, vocab + 5]]), "bad_words_token_ids")]:
        with pytest.raises(InvalidRequestError) as e:
            raw.generate(["hi", "there"], [SamplingParams(), SamplingParams(**kwargs)])
        assert e.value.param == field and f"out of vocabulary (ids 0 to {vocab - 1})" in str(e.value)
        assert not raw.engine.has_unfinished()
    with pytest.raises(InvalidRequestError) as e:  # an engine only reads token ids
        SamplingParams(bad_words=["x"]).validate_token_ids(vocab)
    assert e.value.param == "bad_words"
    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2.0}  # JSON's string keys
    with pytest.raises(ValueError, match="logprobs_mode: must be one of raw_logprobs, processed_logprobs"):
        EngineConfig(model=model_path, logprobs_mode="raw_logits")
