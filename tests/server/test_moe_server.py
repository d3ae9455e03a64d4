"""Live weight updates into a served mixture-of-experts model (a random Qwen3-MoE checkpoint,
dummy weights at start, gloo): pushes with transformers 5's stacked expert names and with
the checkpoint's per-expert names serve the same bits, and transformers' tokens; malformed
expert pushes are refused by name and change nothing; and the rest of the server (pause
modes and version spans, sleep, prefix cache, structured outputs) works on an MoE model."""

from __future__ import annotations

from functools import partial

import httpx
import pytest
import torch

from helpers.checkpoints import save_word_tokenizer, seeded_wide_model
from helpers.moe import moe_config, per_expert
from helpers.oracle import hf_greedy
from helpers.servers import served, start_push_target, start_server, start_side_by_side, stop_server
from helpers.streams import stream_frozen_mid_way
from rlserve.weight_transfer import UpdateRefusedError, WeightSyncClient

PROMPTS = ["t5 t17 t3 t99", "t1 t2 t3", "t64 t12 t7 t7 t80 t41", "t120"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """transformers' Qwen3-MoE (float32, stacked experts) and its checkpoint directory."""
    hf = seeded_wide_model(moe_config("qwen3_moe")).eval()
    path = tmp_path_factory.mktemp("moe-ckpt")
    hf.save_pretrained(path)
    save_word_tokenizer(path, hf.config.vocab_size)
    return hf, str(path)


@pytest.fixture(scope="module")
def servers(trainer, tmp_path_factory):
    """The module's servers, started side by side: "push" (the checkpoint's architecture on
    dummy weights), "tiny" (the moe-tiny preset, dummy weights, the demo model's tokenizer)
    and "dp" (as "push", on two data-parallel replicas)."""
    from rlserve.model.demo_model import demo_model_path
    from rlserve.model.presets import model_dir
    logs = tmp_path_factory.mktemp("moe")
    started = start_side_by_side(
        partial(start_push_target, trainer[1], logs / "server.log"),
        partial(start_server, model_dir("moe-tiny"), logs / "tiny.log", "--load-format", "dummy",
                "--tokenizer", demo_model_path(), "--served-model-name", "m", "--max-model-len", "512"),
        partial(start_push_target, trainer[1], logs / "dp.log", "--data-parallel-size", "2", timeout_s=60))
    yield dict(zip(("push", "tiny", "dp"), started))
    for srv in started:
        stop_server(srv)


@pytest.fixture(scope="module")
def server(servers):
    return servers["push"]


@pytest.fixture(scope="module")
def sync(server):
    client = WeightSyncClient(server.url, backend="gloo")
    client.init()
    return client


def test_stacked_and_per_expert_pushes_serve_the_same_bits_and_transformers_tokens(server, sync, trainer):
    hf, _ = trainer
    named = [(n, p.detach()) for n, p in hf.named_parameters()]
    sync.push(named, packed=True)
    after_stacked = served(server.url, PROMPTS, MAX_TOKENS)
    ids = [[int(t[1:]) for t in p.split()] for p in PROMPTS]
    assert [t for t, _ in after_stacked] == [hf_greedy(hf, i, MAX_TOKENS)[0] for i in ids]
    gen = torch.Generator().manual_seed(3)
    sync.push([(n, torch.randn(t.shape, generator=gen)) for n, t in named])  # something else between
    assert served(server.url, PROMPTS, MAX_TOKENS) != after_stacked
    sync.push(list(per_expert(named, "qwen3_moe")), packed=False)
    assert served(server.url, PROMPTS, MAX_TOKENS) == after_stacked  # the same logprobs, float for float


def malformed(named: list) -> dict[str, tuple[list, str]]:
    """Pushes the server must refuse: (tensors, a name the refusal must mention)."""
    split = list(per_expert(named, "qwen3_moe"))
    up = "model.layers.2.mlp.experts.3.up_proj.weight"
    stacked = "model.layers.0.mlp.experts.gate_up_proj"
    w = dict(named)[stacked]
    extra = "model.layers.0.mlp.experts.8.down_proj.weight"
    return {
        "missing expert": ([(n, t) for n, t in split if n != up], up),
        "expert out of range": (split + [(extra, split[0][1].new_zeros(64, 32))], extra),
        "stacked, wrong expert count": ([(n, w[:4] if n == stacked else t) for n, t in named], stacked),
        "stacked, wrong shape": ([(n, torch.cat([w, w[:, :2]], 1) if n == stacked else t) for n, t in named],
                                 stacked),
        "stacked and per expert at once": (named + [(n, t) for n, t in split if ".layers.0.mlp.experts.0." in n],
                                           "model.layers.0.mlp.experts.0.gate_proj.weight"),
    }


def test_malformed_expert_pushes_are_refused_by_name_and_change_nothing(server, sync, trainer):
    hf, _ = trainer
    named = [(n, p.detach()) for n, p in hf.named_parameters()]
    before = served(server.url, PROMPTS, MAX_TOKENS)
    for case, (tensors, name) in malformed(named).items():
        with pytest.raises(UpdateRefusedError, match=name.replace(".", r"\.")) as refused:
            sync.push(tensors)
        assert "400" in str(refused.value), case
        assert served(server.url, PROMPTS, MAX_TOKENS) == before, case  # the old weights, bit for bit


def test_pause_keep_spans_an_update_and_sleep_keeps_the_weights(server, sync, trainer):
    """A streamed request frozen by pause(keep) across a push says which tokens came from
    which weights; sleep and wake-up serve the same bits again."""
    hf, _ = trainer
    v0 = httpx.get(f"{server.url}/weight_version").json()["weight_version"]
    t, results = stream_frozen_mid_way(server.url, PROMPTS[0])
    sync.push([(n, p.detach()) for n, p in hf.named_parameters()], pause_mode="keep")
    t.join(120)
    chunks, finish, spans = results[0]
    assert finish == "length" and [s["version"] for s in spans] == [v0, v0 + 1]
    before = served(server.url, PROMPTS, MAX_TOKENS)
    assert httpx.post(f"{server.url}/sleep", params={"level": 1}, timeout=60).status_code == 200
    assert httpx.post(f"{server.url}/wake_up", timeout=60).status_code == 200
    assert served(server.url, PROMPTS, MAX_TOKENS) == before


@pytest.fixture(scope="module")
def tiny_moe(servers):
    return servers["tiny"]


def test_prefix_cache_and_structured_outputs_on_an_moe_model(tiny_moe):
    from openai import OpenAI
    client = OpenAI(base_url=f"{tiny_moe.url}/v1", api_key="EMPTY", max_retries=0)
    prompt = "The mixture of experts routes every token to two of its eight experts, " * 3
    first, again = (client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
                    for _ in range(2))
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    assert again.choices[0].text == first.choices[0].text
    choice = client.completions.create(model="m", prompt="Pick one:", max_tokens=8, temperature=1.0,
                                       extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert choice.choices[0].text in ("alpha", "beta")


def test_fp8_kv_cache_serves_an_moe_model():
    from rlserve import LLM, SamplingParams
    from rlserve.model.demo_model import demo_model_path
    from rlserve.model.presets import model_dir
    with LLM(model_dir("moe-tiny"), device="cpu", load_format="dummy", tokenizer=demo_model_path(),
             kv_cache_dtype="fp8", max_model_len=256) as llm:
        out = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_one_push_with_per_expert_names_reaches_both_data_parallel_replicas(trainer, servers):
    """Data parallel with an MoE model: one per-expert push lands on both replicas, and
    requests served by either replica give transformers' tokens."""
    from helpers.data_parallel import complete_all, routed
    hf, _ = trainer
    srv = servers["dp"]
    client = WeightSyncClient(srv.url, backend="gloo")
    client.init()
    client.push(list(per_expert([(n, p.detach()) for n, p in hf.named_parameters()], "qwen3_moe")))
    prompts = PROMPTS * 2
    out = complete_all(srv.url, prompts, max_tokens=MAX_TOKENS)
    assert all(n > 0 for n in routed(srv.url).values()) and len(routed(srv.url)) == 2
    for prompt in prompts:
        ids = [int(t[1:]) for t in prompt.split()]
        assert out[prompt]["choices"][0]["token_ids"] == hf_greedy(hf, ids, MAX_TOKENS)[0], prompt
