"""Live weight updates into a served hybrid model (a random Qwen3.5 multimodal checkpoint, of
which the text model is served; dummy weights at start; gloo): a push of the trainer's whole
model (the multimodal wrapper's names, vision tower included) and one of the text model's
names both serve transformers' tokens, the vision tower's names are dropped and counted in
the answer, and malformed pushes are refused by name and change nothing."""

from __future__ import annotations

import copy

import httpx
import pytest
import torch

from helpers.checkpoints import save_word_tokenizer
from helpers.hybrid import hybrid_model, text_names
from helpers.oracle import hf_greedy
from helpers.servers import served, start_push_target, stop_server
from helpers.streams import stream_frozen_mid_way
from rlserve.weight_transfer import UpdateRefusedError, WeightSyncClient

PROMPTS = ["t5 t17 t3 t99", "t1 t2 t3", "t64 t12 t7 t7 t80 t41", "t120"]
MAX_TOKENS = 10
A_LOG = "model.language_model.layers.0.linear_attn.A_log"


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """transformers' Qwen3.5 (multimodal wrapper, float32) and its checkpoint directory."""
    hf = hybrid_model("qwen3_5_vl")
    path = tmp_path_factory.mktemp("hybrid-ckpt")
    hf.save_pretrained(path)
    # Beside the checkpoint: with Qwen3.5's config next to it, transformers would read the
    # word-level tokenizer as Qwen3.5's own.
    save_word_tokenizer(path / "tokenizer", hf.config.text_config.vocab_size)
    return hf, str(path)


@pytest.fixture(scope="module")
def server(trainer, tmp_path_factory):
    srv = start_push_target(trainer[1], tmp_path_factory.mktemp("hybrid") / "server.log",
                            "--tokenizer", f"{trainer[1]}/tokenizer")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def sync(server):
    client = WeightSyncClient(server.url, backend="gloo")
    client.init()
    return client


def reference(hf) -> list[list[int]]:
    ids = [[int(t[1:]) for t in p.split()] for p in PROMPTS]
    return [hf_greedy(hf, i, MAX_TOKENS)[0] for i in ids]


def test_pushes_under_either_spelling_serve_transformers_tokens_and_count_the_vision_tower(server, sync, trainer):
    hf, _ = trainer
    whole = [(n, p.detach()) for n, p in hf.named_parameters()]  # what a multimodal trainer holds
    tower = sum(n.startswith("model.visual.") for n, _ in whole)
    assert tower > 0
    result = sync.push(whole, packed=True)
    assert result.answers is not None and result.answers[0]["skipped"] == tower
    first = served(server.url, PROMPTS, MAX_TOKENS)
    assert [t for t, _ in first] == reference(hf)

    # New random weights, pushed under the text model's names (no vision tower, none skipped)
    gen = torch.Generator().manual_seed(3)
    changed = copy.deepcopy(hf)
    with torch.no_grad():
        for _, p in changed.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    result = sync.push(text_names([(n, p.detach()) for n, p in changed.named_parameters()]))
    assert result.answers is not None and "skipped" not in result.answers[0]
    second = served(server.url, PROMPTS, MAX_TOKENS)
    assert second != first
    assert [t for t, _ in second] == reference(changed)

    sync.push(whole, packed=False)
    assert served(server.url, PROMPTS, MAX_TOKENS) == first  # the same logprobs, float for float


def malformed(whole: list) -> dict[str, tuple[list, str]]:
    """Pushes the server must refuse: (tensors, a name the refusal must mention)."""
    text = "model.layers.0.linear_attn.A_log"
    conv = "model.language_model.layers.1.linear_attn.conv1d.weight"
    return {
        "missing": ([(n, t) for n, t in whole if n != conv], conv),
        "misshapen": ([(n, t[:2] if n == A_LOG else t) for n, t in whole], A_LOG),
        "both spellings of one tensor": (whole + [(text, dict(whole)[A_LOG])], A_LOG),
    }


def test_malformed_pushes_are_refused_by_name_and_change_nothing(server, sync, trainer):
    hf, _ = trainer
    whole = [(n, p.detach()) for n, p in hf.named_parameters()]
    sync.push(whole)
    before = served(server.url, PROMPTS, MAX_TOKENS)
    for case, (tensors, name) in malformed(whole).items():
        with pytest.raises(UpdateRefusedError, match=name.replace(".", r"\.")) as refused:
            sync.push(tensors)
        assert "400" in str(refused.value), case
        assert served(server.url, PROMPTS, MAX_TOKENS) == before, case  # the old weights, bit for bit


def test_pause_keep_spans_an_update_and_sleep_keeps_the_weights(server, sync, trainer):
    """A streamed request frozen by pause(keep) keeps its state slot across a push and goes
    on with the new weights (its version spans say so); sleep frees the state pool with the
    KV cache, and wake-up serves the same bits again."""
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
