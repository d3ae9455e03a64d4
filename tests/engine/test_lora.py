"""LoRA adapters offline (CPU, float32) against transformers + peft on the demo model: greedy
output with an adapter equals the merged model's, token for token; a batch mixing adapters
and the base model gives each request its own model's output; refused adapters change
nothing; more adapters than host memory holds are read again from disk; tensor parallelism
serves the same tokens. Over HTTP: more adapters than device slots take turns in them,
pushed ones too."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.lora_adapters import MAX_TOKENS, PROMPTS, greedy, make_adapter
from rlserve.engine.lora import LoRARequest
from rlserve.model.peft import LoRAConfig, canonical_peft_names, parse_peft_name
from rlserve.sampling_params import InvalidRequestError

GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf(demo_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(demo_model)


@pytest.fixture(scope="module")
def adapters(hf, tmp_path_factory):
    """Rank 8 on attention and MLP; rank 16 with rsLoRA on other modules; and a rank-8 one
    whose rank_pattern gives v_proj rank 4."""
    model, tok = hf
    root = tmp_path_factory.mktemp("lora")
    return {
        "a8": make_adapter(model, tok, str(root / "a8"), 8, ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                           seed=1),
        "b16": make_adapter(model, tok, str(root / "b16"), 16, ["k_proj", "v_proj", "gate_proj", "up_proj"],
                            seed=2, alpha=8, use_rslora=True),
        "pat": make_adapter(model, tok, str(root / "pat"), 8, ["q_proj", "v_proj"], seed=3,
                            rank_pattern={"v_proj": 4}, alpha_pattern={"q_proj": 32}),
    }


@pytest.fixture(scope="module")
def base_reference(hf):
    model, tok = hf
    return {p: greedy(model, tok, p) for p in PROMPTS}


@pytest.fixture(scope="module")
def llm(demo_model, adapters):
    from rlserve import LLM
    llm = LLM(demo_model, device="cpu", dtype="float32", max_model_len=256, enable_lora=True,
              max_loras=3, max_lora_rank=16, lora_modules={"a8": adapters["a8"].path})
    yield llm
    llm.shutdown()


def _tokens(llm, prompts, lora_request=None):
    from rlserve import SamplingParams
    outs = llm.generate(list(prompts), SamplingParams(**GREEDY), lora_request=lora_request)
    return [o.outputs[0].token_ids for o in outs]


def test_adapter_output_equals_the_merged_model(llm, adapters, base_reference):
    llm.load_lora_adapter("b16", adapters["b16"].path)
    llm.load_lora_adapter("pat", adapters["pat"].path)
    try:
        for name in ("a8", "b16", "pat"):
            ref = adapters[name].reference
            assert any(ref[p] != base_reference[p] for p in PROMPTS), f"{name} must change the output"
            assert _tokens(llm, PROMPTS, name) == [ref[p] for p in PROMPTS], name
        # vLLM's LoRARequest shape works too
        assert _tokens(llm, PROMPTS[:1], LoRARequest("b16", 2)) == [adapters["b16"].reference[PROMPTS[0]]]
    finally:
        llm.unload_lora_adapter("b16")
        llm.unload_lora_adapter("pat")


def test_one_batch_mixes_two_adapters_and_the_base_model(llm, adapters, base_reference):
    llm.load_lora_adapter("b16", adapters["b16"].path)
    try:
        # every prompt under each model, shuffled, in one generate call (one batch per step)
        jobs = [(p, name) for p in PROMPTS for name in ("a8", None, "b16")]
        jobs = jobs[1::2] + jobs[::2]
        got = _tokens(llm, [p for p, _ in jobs], [n for _, n in jobs])
        for (p, name), tokens in zip(jobs, got):
            want = base_reference[p] if name is None else adapters[name].reference[p]
            assert tokens == want, (p, name)
    finally:
        llm.unload_lora_adapter("b16")


def test_prefix_cache_is_not_shared_between_adapters(llm, adapters, base_reference):
    # The long prompt fills whole KV blocks: with a shared cache the adapter would reuse the
    # base model's keys and values.
    prompt = PROMPTS[2]
    assert _tokens(llm, [prompt]) == [base_reference[prompt]]
    assert _tokens(llm, [prompt], "a8") == [adapters["a8"].reference[prompt]]
    assert _tokens(llm, [prompt]) == [base_reference[prompt]]


def test_lora_request_with_a_path_loads_on_first_use(llm, adapters):
    req = LoRARequest("pat", 7, adapters["pat"].path)
    try:
        assert _tokens(llm, PROMPTS[:1], req) == [adapters["pat"].reference[PROMPTS[0]]]
        assert "pat" in {a["name"] for a in llm.list_lora_adapters()}
    finally:
        llm.unload_lora_adapter("pat")


def _broken_copy(src: str, dst: str, edit_tensors=None, edit_config=None) -> str:
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "adapter_config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    if edit_config:
        edit_config(config)
    if edit_tensors:
        tensors = edit_tensors(tensors)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "adapter_model.safetensors"))
    return dst


def _with(tensors, name, value):
    out = dict(tensors)
    out[name] = value
    return out


def test_refused_adapters_change_nothing(llm, adapters, tmp_path):
    src = adapters["b16"].path
    key_a = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    before = _tokens(llm, PROMPTS, "a8")
    cases = {
        "unknown module": (dict(edit_tensors=lambda t: _with(
            t, "base_model.model.lm_head.lora_A.weight", torch.zeros(16, 576)) | {
            "base_model.model.lm_head.lora_B.weight": torch.zeros(49152, 16)}), "cannot adapt.*lm_head"),
        "wrong rank": (dict(edit_tensors=lambda t: _with(t, key_a, t[key_a][:8])), "rank"),
        "wrong shape": (dict(edit_tensors=lambda t: _with(t, key_a, torch.zeros(16, 100))), "k_proj"),
        "rank above max": (dict(edit_config=lambda c: c.update(r=32)), "exceeds max_lora_rank"),
        "unpaired": (dict(edit_tensors=lambda t: {k: v for k, v in t.items() if k != key_a}), "only lora_B"),
        "dora": (dict(edit_config=lambda c: c.update(use_dora=True)), "use_dora"),
    }
    for i, (what, (edits, message)) in enumerate(cases.items()):
        path = _broken_copy(src, str(tmp_path / f"bad{i}"), **edits)
        with pytest.raises(InvalidRequestError, match=message):
            llm.load_lora_adapter(f"bad{i}", path)
        assert f"bad{i}" not in {a["name"] for a in llm.list_lora_adapters()}, what
    with pytest.raises(InvalidRequestError, match="not a directory"):
        llm.load_lora_adapter("nowhere", str(tmp_path / "missing"))
    with pytest.raises(InvalidRequestError, match="has already been loaded"):
        llm.load_lora_adapter("a8", src)
    with pytest.raises(InvalidRequestError, match="not loaded"):
        _tokens(llm, PROMPTS[:1], "nope")
    assert _tokens(llm, PROMPTS, "a8") == before


def test_more_adapters_than_host_memory_are_read_again_from_disk(llm, adapters):
    """Host memory holds --max-cpu-loras adapters (here --max-loras, 3), as in vLLM: a fourth
    evicts the least recently used one read from disk, which stays loaded and is read again
    when a request needs it (evicting the next)."""
    llm.load_lora_adapter("b16", adapters["b16"].path)
    llm.load_lora_adapter("pat", adapters["pat"].path)
    llm.load_lora_adapter("extra", adapters["b16"].path)
    try:
        table = llm.engine.lora.adapters
        assert sum(a.in_memory for a in table.values()) == 3 and not table["a8"].in_memory
        assert {a["name"] for a in llm.list_lora_adapters()} == {"a8", "b16", "pat", "extra"}
        for name, ref in [("a8", "a8"), ("extra", "b16"), ("pat", "pat"), ("b16", "b16"), ("a8", "a8")]:
            assert _tokens(llm, PROMPTS[:1], name) == [adapters[ref].reference[PROMPTS[0]]], name
    finally:
        for name in ("extra", "b16", "pat"):
            llm.unload_lora_adapter(name)


def test_unload_is_refused_while_a_request_runs_with_the_adapter(llm, adapters):
    from rlserve import SamplingParams
    from rlserve.wire.messages import ConflictError
    engine = llm.engine
    for req in engine.make_requests([1, 2, 3], SamplingParams(max_tokens=4), "busy", lora_name="a8"):
        engine.add_request(req)
    with pytest.raises(ConflictError, match="still run"):
        llm.unload_lora_adapter("a8")
    engine.abort(["busy"])


def test_peft_names_and_config():
    assert parse_peft_name("base_model.model.model.layers.3.mlp.up_proj.lora_B.weight") == (
        "model.layers.3.mlp.up_proj", "B")
    assert parse_peft_name("base_model.model.model.layers.3.mlp.up_proj.lora_A.default.weight") == (
        "model.layers.3.mlp.up_proj", "A")
    assert parse_peft_name("model.layers.3.mlp.up_proj.weight") is None
    names = canonical_peft_names([("base_model.model.x.q_proj.lora_A.default.weight", 1),
                                  ("base_model.model.x.q_proj.base_layer.weight", 2)])
    assert names == [("base_model.model.x.q_proj.lora_A.weight", 1)]
    c = LoRAConfig.parse({"r": 16, "lora_alpha": 8, "use_rslora": True, "rank_pattern": {"v_proj": 4}},
                         "cfg", 16)
    assert c.scaling("model.layers.0.self_attn.q_proj") == 8 / 4
    assert c.rank("model.layers.0.self_attn.v_proj") == 4 and c.scaling("model.layers.0.self_attn.v_proj") == 4
    for bad, message in [({"r": 0}, "r must"), ({"r": 4, "peft_type": "IA3"}, "peft_type"),
                         ({"r": 4, "modules_to_save": ["lm_head"]}, "modules_to_save"),
                         ({"r": 64}, "exceeds max_lora_rank")]:
        with pytest.raises(InvalidRequestError, match=message):
            LoRAConfig.parse(bad, "cfg", 16)


def test_tensor_parallel_serves_the_same_adapter_tokens(demo_model, adapters, base_reference):
    from rlserve import LLM
    with LLM(demo_model, device="cpu", dtype="float32", max_model_len=256, tensor_parallel_size=2,
             enable_lora=True, max_loras=2, max_lora_rank=16,
             lora_modules={"a8": adapters["a8"].path, "b16": adapters["b16"].path}) as tp:
        got = _tokens(tp, PROMPTS * 3, ["a8"] * 3 + [None] * 3 + ["b16"] * 3)
    want = ([adapters["a8"].reference[p] for p in PROMPTS] + [base_reference[p] for p in PROMPTS]
            + [adapters["b16"].reference[p] for p in PROMPTS])
    assert got == want


# -- the server: adapters over HTTP, requests by model name, live pushes over gloo ------------

@pytest.fixture(scope="module")
def lora_server(demo_model, adapters, tmp_path_factory):
    from helpers.servers import start_server, stop_server
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    srv = start_server(demo_model, log, "--served-model-name", "base", "--enable-lora", "--max-loras", "3",
                       "--max-lora-rank", "16", "--lora-modules", f"a8={adapters['a8'].path}",
                       "--weight-transfer-config", json.dumps({"backend": "gloo", "timeout_s": 60}))
    yield srv
    stop_server(srv)


def test_server_adapters_over_http_and_live_pushes_over_gloo(lora_server, adapters, hf):
    """Kept to a few short completions: the offline tests above cover the outputs in depth."""
    import httpx
    from openai import NotFoundError, OpenAI

    from helpers.lora_adapters import rerandomize
    from rlserve.model.peft import peft_adapter_tensors
    from rlserve.weight_transfer import WeightSyncClient, WeightTransferError
    url = lora_server.url
    client = OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=600)
    prompts, n = PROMPTS[:2], 6

    def tokens(model: str, version: int | None = None) -> list[list[int]]:
        r = client.completions.create(model=model, prompt=prompts, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.model == model
        if version is not None:
            assert r.weight_version == version
        return [c.token_ids for c in sorted(r.choices, key=lambda c: c.index)]

    def want(reference: dict) -> list[list[int]]:
        return [reference[p][:n] for p in prompts]

    # an adapter loaded over HTTP, asked for by name; the listing; unknown names
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "b16", "lora_path": adapters["b16"].path})
    assert r.status_code == 200, r.text
    assert tokens("b16") == want(adapters["b16"].reference)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "a8", "b16"}
    assert cards["b16"].parent == "base" and cards["b16"].root == adapters["b16"].path
    with pytest.raises(NotFoundError, match="not loaded"):
        tokens("nope")
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"})
    assert r.status_code == 404 and "lora_path" in r.json()["error"]["message"]  # vLLM: not found
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b16"}).status_code == 200
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b16"}).status_code == 404

    # a trainer pushes an adapter the server does not have yet, then a training step's update
    sync = WeightSyncClient(url, backend="gloo", timeout_s=120)
    sync.init()
    live = adapters["b16"]
    version = sync.push_lora("live", live.peft_model).weight_versions[0]
    new = rerandomize(live, hf[1], seed=11)
    result = sync.push_lora("live", live.peft_model, version=version + 5)
    assert result.weight_versions == [version + 5]
    assert result.num_bytes == sum(t.numel() * 4 for n, t in live.peft_model.named_parameters() if "lora_" in n)
    assert tokens("live", version + 5) == want(new)

    # refused pushes change nothing, and the trainer hears why
    config, good = peft_adapter_tensors(live.peft_model)
    k_a = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    bad = {
        "unknown parameter names": good + [("base_model.model.lm_head.lora_A.weight", torch.ones(16, 576)),
                                           ("base_model.model.lm_head.lora_B.weight", torch.ones(49152, 16))],
        "wrong shapes": [(n, t[:8] if n == k_a else t) for n, t in good],
        "only lora_B": [(n, t) for n, t in good if n != k_a],
    }
    for message, tensors in bad.items():
        with pytest.raises(WeightTransferError, match=message):
            sync.push_lora("live", tensors, lora_config=config)
    with pytest.raises(WeightTransferError, match="exceeds max_lora_rank"):
        sync.push_lora("live", good, lora_config={**config, "r": 32})
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "b16", "lora_path": adapters["b16"].path})
    assert r.status_code == 200, r.text

    # a8, live and b16 fill host memory (--max-cpu-loras: --max-loras, 3). A new adapter evicts
    # one read from disk; one a trainer pushed exists only in memory and is never evicted.
    sync.push_lora("fourth", live.peft_model)
    version = sync.push_lora("fifth", live.peft_model).weight_versions[0]
    with pytest.raises(WeightTransferError, match="max-cpu-loras 3"):
        sync.push_lora("sixth", live.peft_model)
    assert tokens("live", version) == want(new)  # the refusal changed nothing
    r = httpx.post(f"{url}/v1/completions", json={"model": "a8", "prompt": prompts, "max_tokens": n})
    assert r.status_code == 400 and "max-cpu-loras" in r.json()["error"]["message"], r.text
    for name in ("fourth", "fifth"):
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
    assert tokens("a8") == want(adapters["a8"].reference)  # read from its directory again
    for name in ("live", "b16"):  # leave room for the next test's adapter
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200


def test_grpo_example_trains_and_pushes_only_the_adapter(lora_server, demo_model):
    """examples/grpo.py --lora, one step: the server samples with the trainer's adapter
    (its logprobs match the trainer's PeftModel), and only LoRA weights moved."""
    import importlib.util
    import itertools
    import math
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "examples" / "grpo.py"
    spec = importlib.util.spec_from_file_location("grpo_lora_example", path)
    grpo = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = grpo
    spec.loader.exec_module(grpo)
    rewards = itertools.cycle([1.0, 0.0])
    cfg = grpo.Config(steps=1, prompts=2, n=2, max_tokens=4, heldout=2, temperature=1.0, lora=True)
    model, records = grpo.train(cfg, lora_server.url, demo_model, reward_fn=lambda text, answer: next(rewards))
    step, final = records
    assert step["pushed"] and step["trained"] == 4 and math.isfinite(step["loss"])
    assert step["dlogp_max"] < 1e-2  # the server's adapter is the trainer's, to kernel rounding
    assert final["eval_version"] == 1
    assert grpo.LORA_NAME in {m["id"] for m in httpx_get(f"{lora_server.url}/v1/models")["data"]}
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)


def httpx_get(url: str) -> dict:
    import httpx
    r = httpx.get(url, timeout=60)
    r.raise_for_status()
    return r.json()


# -- more adapters than device slots: --max-loras 1 --max-cpu-loras 2 ------------------------

@pytest.fixture(scope="module")
def swap_server(demo_model, adapters, tmp_path_factory):
    from helpers.servers import start_server, stop_server
    log = tmp_path_factory.mktemp("lora-swap") / "server.log"
    srv = start_server(demo_model, log, "--served-model-name", "base", "--enable-lora", "--max-loras", "1",
                       "--max-cpu-loras", "2", "--max-lora-rank", "16", "--lora-modules", f"a8={adapters['a8'].path}",
                       "--weight-transfer-config", json.dumps({"backend": "gloo", "timeout_s": 60}))
    yield srv
    stop_server(srv)


def test_adapters_take_turns_in_one_slot_and_a_push_reaches_the_one_outside(swap_server, adapters, hf,
                                                                             base_reference, tmp_path):
    """Both adapters stay loaded on the host and the one a request needs is copied into the
    one device slot: each request gets its own adapter's output. A push to the adapter
    outside the slot lands in its host copy and is served once it swaps in; one pushed into
    the slot is kept when it swaps out."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from rlserve.weight_transfer import WeightSyncClient
    url = swap_server.url
    prompts, n = PROMPTS[:2], 6

    def tokens(model: str) -> list[list[int]]:
        r = httpx.post(f"{url}/v1/completions", timeout=600, json={
            "model": model, "prompt": prompts, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    def want(reference: dict) -> list[list[int]]:
        return [reference[p][:n] for p in prompts]

    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "b16", "lora_path": adapters["b16"].path})
    assert r.status_code == 200, r.text
    for name in ("a8", "b16", "a8", "b16"):
        assert tokens(name) == want(adapters[name].reference), name
    # at once: one adapter's requests wait for the slot while the other's run, the base model's beside
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(tokens, ["a8", "b16", "base"]))
    assert got == [want(adapters["a8"].reference), want(adapters["b16"].reference), want(base_reference)]

    model, tok = hf
    pushed = make_adapter(model, tok, str(tmp_path / "pushed"), 8, ["q_proj", "v_proj", "o_proj", "up_proj",
                                                                    "down_proj"], seed=21)
    sync = WeightSyncClient(url, backend="gloo", timeout_s=120)
    sync.init()
    assert tokens("b16") == want(adapters["b16"].reference)  # b16 holds the slot
    sync.push_lora("a8", pushed.peft_model)  # a8 is outside the slot: its host copy takes the push
    assert tokens("a8") == want(pushed.reference)
    sync.push_lora("a8", adapters["a8"].peft_model)  # a8 is in the slot now: the push goes there
    assert tokens("b16") == want(adapters["b16"].reference)  # a8 leaves the slot, its push kept
    assert tokens("a8") == want(adapters["a8"].reference)
