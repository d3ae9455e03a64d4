"""Structured outputs at the module and sampler level: specs are validated and compiled
(off the caller's thread, cached), matchers fill the packed bitmask, and the sampler masks
with it, so that text sampled from the demo model under the mask always parses: a JSON
schema with 20 seeds, a choice, a regex. The engine core's step loop is wired separately;
here the loop is transformers' forward plus the runner's sampler."""

from __future__ import annotations

import json
import re

import msgpack
import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.engine.request import Request
from rlserve.engine.structured_output import (
    GrammarMatcher,
    StructuredOutputCompiler,
    choice_grammar,
    fill_bitmask,
    new_bitmask,
)
from rlserve.model.demo_model import demo_model_path
from rlserve.sampling_params import InvalidRequestError, StructuredOutputsParams
from rlserve.worker import sampler as S
from rlserve.worker.model_runner import StepHandle

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PROMPT = "Describe a person as JSON:"
ROWS = 20


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(demo_model_path(), device="cpu", dtype="float32", max_model_len=256,
               kv_cache_memory_bytes=64 << 20, logprobs_mode="processed_logprobs")


@pytest.fixture(scope="module")
def compiler(llm) -> StructuredOutputCompiler:
    c = StructuredOutputCompiler(llm.get_tokenizer(), llm.engine.vocab_size, llm.engine.eos_token_ids)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def hf(hf_demo):
    return hf_demo


def generate(llm, hf, compiler, spec, temperature: float = 0.8, max_steps: int = 48, rows: int = ROWS
             ) -> list[str]:
    """`rows` seeded samples of PROMPT under the spec's grammar: transformers gives the
    logits, the runner's sampler draws under the mask, each row's matcher advances."""
    tok = llm.get_tokenizer()
    runner = llm.engine.executor.local_runner
    prompt = tok.encode(PROMPT)
    grammar = compiler.compile(spec).result(timeout=120)
    matchers: list[GrammarMatcher | None] = [compiler.matcher(grammar) for _ in range(rows)]
    reqs = [Request(f"g{i}", prompt, SamplingParams(temperature=temperature, seed=i, logprobs=0),
                    llm.engine.eos_token_ids) for i in range(rows)]
    outputs: list[list[int]] = [[] for _ in range(rows)]
    ids, past = torch.tensor([prompt] * rows), None
    for _ in range(max_steps):
        with torch.no_grad():
            step = hf(ids, past_key_values=past, use_cache=True)
        past = step.past_key_values
        handle = StepHandle(list(range(rows)), None, {}, {},
                            pending=(step.logits[:, -1].float().clone(), runner.sampling_batch(reqs)))
        runner.sample(handle, fill_bitmask(matchers, compiler.vocab_size))
        tokens = handle.sampled.token_ids.tolist()
        for i, token in enumerate(tokens):
            if matchers[i] is None:
                continue
            assert matchers[i].accept([token]), f"row {i}: token {token} outside the grammar"
            assert handle.sampled.logprobs[i] > -float("inf")  # processed: never a masked token
            reqs[i].token_ids.append(token)
            outputs[i].append(token)
            if matchers[i].is_terminated():
                matchers[i] = None
        if all(m is None for m in matchers):
            break
        ids = torch.tensor(tokens).view(rows, 1)
    assert all(m is None for m in matchers), "some rows never finished their grammar"
    eos = llm.engine.eos_token_ids
    return [tok.decode([t for t in out if t not in eos]) for out in outputs]


def check_person(text: str) -> None:
    """`text` parses, and validates against SCHEMA."""
    value = json.loads(text)
    assert set(value) == {"name", "age", "city"}, text
    assert isinstance(value["name"], str) and len(value["name"]) <= 10
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert value["city"] in ("Paris", "Rome", "Oslo")


def test_json_schema_outputs_parse_and_validate_for_20_seeds(llm, hf, compiler):
    texts = generate(llm, hf, compiler, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    for text in texts:
        check_person(text)
    assert len(set(texts)) > 1  # seeds differ


def test_choice_outputs_are_one_of_the_choices(llm, hf, compiler):
    choices = ["Paris", "Rome", 'New "York"\n']
    texts = generate(llm, hf, compiler, StructuredOutputsParams(choice=choices), temperature=1.5)
    assert set(texts) <= set(choices) and len(set(texts)) > 1


def test_regex_outputs_match(llm, hf, compiler):
    pattern = r"\d{3}-[a-z]{2,5}"
    texts = generate(llm, hf, compiler, StructuredOutputsParams(regex=pattern))
    assert all(re.fullmatch(pattern, t) for t in texts), texts


def test_json_object_and_grammar(llm, hf, compiler):
    # Any object is unbounded, and sampled ones run long: greedy rows here (the schema
    # test samples 20 seeds).
    for text in generate(llm, hf, compiler, StructuredOutputsParams(json_object=True), temperature=0,
                         max_steps=64, rows=2):
        assert isinstance(json.loads(text), dict)
    grammar = 'root ::= ("yes" | "no") " because " [a-z]{1,8}'
    assert all(re.fullmatch(r"(yes|no) because [a-z]{1,8}", t)
               for t in generate(llm, hf, compiler, StructuredOutputsParams(grammar=grammar), rows=4))


def test_bitmask_unpacks_as_xgrammar_applies_it():
    """The sampler's unpacking matches xgrammar's own kernel, bit for bit, whole batch and rows."""
    import xgrammar as xgr
    g = torch.Generator().manual_seed(0)
    vocab = 1000
    mask = torch.randint(-(2**31), 2**31 - 1, (4, -(-vocab // 32)), generator=g, dtype=torch.int32)
    logits = torch.randn(4, vocab, generator=g)
    ours, theirs = logits.clone(), logits.clone()
    S.apply_token_bitmask(ours, mask, None)
    xgr.apply_token_bitmask_inplace(theirs, mask)
    assert torch.equal(ours, theirs)
    rows = torch.tensor([1, 3])
    ours = logits.clone()
    S.apply_token_bitmask(ours, mask[rows], rows)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, mask, indices=[1, 3])
    assert torch.equal(ours, theirs)


def test_runner_samples_a_launched_step_under_the_mask(llm, compiler):
    """launch(sample=False) queues the forward pass; sample(handle, bitmask) the draw, with
    the mask filled after launch, in handle.sample_requests order."""
    engine = llm.engine
    runner = engine.executor.local_runner
    tok = llm.get_tokenizer()
    reqs = [r for i, text in enumerate([PROMPT, "The capital of Norway is", "Hello"])
            for r in engine.make_requests(tok.encode(text), SamplingParams(temperature=1.0, seed=4), f"mask{i}")]
    for r in reqs:
        engine.add_request(r)
    try:
        sched = engine.scheduler.schedule()
        handle = runner.launch(sched, engine.kv.block_table_array([it.request for it in sched.scheduled]),
                               sample=False)
        assert handle.sampled is None and len(handle.sample_requests) == 3
        grammar = compiler.compile(StructuredOutputsParams(choice=["Oslo", "Rome"])).result(timeout=120)
        matchers = [compiler.matcher(grammar), None, compiler.matcher(grammar)]
        runner.sample(handle, fill_bitmask(matchers, compiler.vocab_size))
        tokens = runner.collect(handle).token_ids
        assert matchers[0].accept([tokens[0]]) and matchers[2].accept([tokens[2]])
    finally:
        engine.abort([r.request_id for r in reqs])


def test_runner_executes_a_step_with_a_mask_in_schedule_order(llm, compiler):
    """The synchronous path (and tensor parallelism's): the mask is filled before the step,
    one row per scheduled request that samples."""
    engine = llm.engine
    tok = llm.get_tokenizer()
    reqs = [r for i, text in enumerate(["Hello", PROMPT]) for r in engine.make_requests(
        tok.encode(text), SamplingParams(temperature=1.0, seed=5), f"exec{i}")]
    for r in reqs:
        engine.add_request(r)
    try:
        sched = engine.scheduler.schedule()
        sampling = [item.request for item in sched.scheduled if item.samples]
        assert len(sampling) == 2
        grammar = compiler.compile(StructuredOutputsParams(regex="[0-9]+")).result(timeout=120)
        matchers = [compiler.matcher(grammar) for _ in sampling]
        out = engine.executor.local_runner.execute(
            sched, engine.kv.block_table_array([it.request for it in sched.scheduled]),
            fill_bitmask(matchers, compiler.vocab_size))
        assert all(m.accept([t]) for m, t in zip(matchers, out.token_ids))
        assert all(tok.decode([t]).isdigit() for t in out.token_ids)
    finally:
        engine.abort([r.request_id for r in reqs])


def test_compiles_are_cached_and_off_the_callers_thread(compiler):
    a = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    b = compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA, separators=(",", ":"))))
    assert a is b  # the same schema as a dict or as its text: one compile
    assert a.result(timeout=120).spec.kind == "json"


@pytest.mark.parametrize("kwargs, field", [
    (dict(), "structured_outputs"),
    (dict(regex="a", choice=["a"]), "structured_outputs"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json="[1, 2]"), "structured_outputs.json"),
    (dict(regex=""), "structured_outputs.regex"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice="yes"), "structured_outputs.choice"),
    (dict(choice=["a", ""]), "structured_outputs.choice"),
    (dict(grammar=3), "structured_outputs.grammar"),
])
def test_bad_specs_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.param == field and str(e.value).startswith(f"{field}:")


@pytest.mark.parametrize("kwargs, field", [
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "structured_outputs.json"),
])
def test_specs_that_do_not_compile_are_refused_by_validate(compiler, kwargs, field):
    spec = StructuredOutputsParams(**kwargs)
    with pytest.raises(InvalidRequestError) as e:
        compiler.validate(spec)
    assert e.value.param == field and "cannot be compiled" in str(e.value)


def test_choice_grammar_escapes_quotes_backslashes_and_controls():
    assert choice_grammar(['a"b', "c\\d", "e\nf\x01"]) == 'root ::= "a\\"b" | "c\\\\d" | "e\\nf\\u0001"'


def test_matcher_rollback_and_bitmask_rows(compiler):
    grammar = compiler.compile(StructuredOutputsParams(regex="ab|ac")).result(timeout=120)
    m = compiler.matcher(grammar)
    tok = compiler.tokenizer
    a = tok.encode("a", add_special_tokens=False)
    assert m.accept(a)
    mask = new_bitmask(2, compiler.vocab_size)
    m.fill(mask, 1)
    assert (mask[0] == -1).all() and not (mask[1] == -1).all()
    m.rollback(len(a))
    assert m.num_accepted == 0 and m.accept(a)
    with pytest.raises(ValueError, match="rollback"):
        m.rollback(5)


def test_spec_survives_the_step_message():
    from rlserve.worker.channel import _request_from_wire, _request_to_wire
    p = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["x", "y"], disable_any_whitespace=True))
    wire = msgpack.unpackb(msgpack.packb(_request_to_wire(Request("r", [1], p)), use_bin_type=True), raw=False)
    assert _request_from_wire(wire).sampling_params == p


# ---------------------------------------------------------------- through the engine's step


def _engine_outputs(llm, spec, overlapped: bool, n: int = 20, max_tokens: int = 64) -> list[str]:
    llm.engine.async_scheduling = overlapped
    try:
        params = SamplingParams(n=n, temperature=0.8, seed=11, max_tokens=max_tokens,
                                structured_outputs=spec)
        return [c.text for c in llm.generate(PROMPT, params)[0].outputs]
    finally:
        llm.engine.async_scheduling = False


@pytest.mark.parametrize("overlapped", [False, True])
def test_the_engine_samples_json_schema_outputs_that_validate(llm, overlapped):
    """The step loop itself: grammars compiled off the loop, rows sampled under their mask
    (with overlapped scheduling, after the previous step's tokens reached the matchers)."""
    texts = _engine_outputs(llm, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
                            overlapped, max_tokens=96)
    for text in texts:
        check_person(text)
    assert len(set(texts)) > 1


@pytest.mark.parametrize("overlapped", [False, True])
def test_the_engine_keeps_choice_and_regex_outputs_in_their_language(llm, overlapped):
    choices = ["Paris", "Rome", "New York City"]
    assert set(_engine_outputs(llm, StructuredOutputsParams(choice=choices), overlapped)) <= set(choices)
    pattern = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}"
    for text in _engine_outputs(llm, StructuredOutputsParams(regex=pattern), overlapped):
        assert re.fullmatch(pattern, text), text


def test_grammar_rows_and_plain_rows_share_a_batch(llm):
    """A batch mixing grammar rows and free rows: each keeps its own rules, and the free
    rows' tokens equal what they get alone."""
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate([PROMPT, "The capital of France is"], free)
    mixed = llm.generate([PROMPT, "The capital of France is", PROMPT],
                         [free, free, SamplingParams(max_tokens=32, temperature=0,
                                                     structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    assert mixed[2].outputs[0].text in ("yes", "no")


def test_a_grammar_request_refuses_min_tokens_and_a_bad_spec_names_its_field(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(PROMPT, SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+")))
    assert e.value.param == "min_tokens"
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(PROMPT, SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    assert e.value.param == "structured_outputs.regex"
