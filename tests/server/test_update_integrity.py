"""Nothing is served that no trainer sent: a transaction is owned and checked, a level-2
sleep ends what it invalidates (open transactions, requests in flight) and only a complete
update brings generation back, every refusal reaches the trainer, and the control plane
answers every input with a 2xx or a 4xx naming the field, never a 500.

A two-layer dummy model (conftest.start_tiny_server); the trainer pushes a transformers
model of the same config over gloo."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest
import torch

from helpers.servers import start_tiny_server, stop_server
from rlserve.weight_transfer import GlooTrainerSendWeightsArgs, GlooWeightTransferEngine, get_open_port

TIMEOUT_S = 30  # the server's transfer timeout: a trainer not told of a refusal waits this long


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = json.dumps({"backend": "gloo", "timeout_s": TIMEOUT_S, "max_world_size": 64})
    srv = start_tiny_server(tmp_path_factory.mktemp("integrity") / "s.log", "--weight-transfer-config", cfg,
                            "--max-model-len", "4096")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def named():
    """The tiny model's tensors under their checkpoint names (what a trainer sends)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlserve.model.presets import model_dir
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir("tiny")))
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def post(url: str, path: str, body: dict | None = None, **params) -> httpx.Response:
    return httpx.post(f"{url}/{path}", json=body, params=params, timeout=120)


def generate(url: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json=dict(
        model="m", prompt=[1, 2, 3], max_tokens=max_tokens, temperature=0, ignore_eos=True))


def checksums(url: str) -> dict[str, str]:
    r = post(url, "weight_checker", {"action": "checksum"})
    assert r.status_code == 200, r.text
    return r.json()["checksums"]


class Trainer:
    """Rank 0 of a gloo group with the server's one worker."""

    def __init__(self, url: str, world_size: int = 2):
        self.url = url
        info = dict(master_address="127.0.0.1", master_port=get_open_port(), rank_offset=1, world_size=world_size)
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("r", post(url, "init_weight_transfer_engine",
                                                                     {"init_info": info})))
        t.start()
        self.group = GlooWeightTransferEngine.trainer_init(dict(
            master_address="127.0.0.1", master_port=info["master_port"], world_size=world_size))
        t.join()
        assert box["r"].status_code == 200, box["r"].text

    def push(self, named: list, **extra) -> tuple[httpx.Response, BaseException | None, float]:
        """/update_weights beside trainer_send_weights: the answer, what the trainer raised
        (if anything), and how long the trainer took."""
        info = dict(names=[n for n, _ in named], dtype_names=["float32"] * len(named),
                    shapes=[list(t.shape) for _, t in named], packed=True, **extra)
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("r", post(self.url, "update_weights",
                                                                     {"update_info": info})))
        t.start()
        t0 = time.monotonic()
        error = None
        try:
            GlooWeightTransferEngine.trainer_send_weights(
                iterator=iter(named), trainer_args=GlooTrainerSendWeightsArgs(group=self.group, packed=True))
        except Exception as e:
            error = e
        seconds = time.monotonic() - t0
        t.join()
        return box["r"], error, seconds

    def update(self, named: list) -> None:
        """A whole update, as one transaction."""
        assert post(self.url, "start_weight_update").status_code == 200
        r, error, _ = self.push(named)
        assert r.status_code == 200 and error is None, r.text
        r = post(self.url, "finish_weight_update")
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def trainer(server, named):
    trainer = Trainer(server.url)
    trainer.update(named)
    return trainer


@pytest.fixture
def served(server, trainer, named):
    """Each test starts from the trainer's weights serving (and leaves them so)."""
    if httpx.get(f"{server.url}/is_sleeping").json()["is_sleeping"]:
        assert post(server.url, "wake_up").status_code == 200
    if generate(server.url).status_code != 200:
        trainer.update(named)
    yield checksums(server.url)
    post(server.url, "wake_up")
    trainer.update(named)


# -- 1. after a level-2 sleep, only a complete update serves ---------------------------------------

def test_a_level2_sleep_aborts_the_open_transaction_and_its_finish_says_so(server, trainer, named, served):
    url = server.url
    half = len(named) // 2
    assert post(url, "start_weight_update").status_code == 200
    r, error, _ = trainer.push(named[:half])
    assert r.status_code == 200 and error is None, r.text
    assert post(url, "sleep", level=2).status_code == 200
    assert post(url, "wake_up").status_code == 200
    r = post(url, "finish_weight_update")
    assert r.status_code == 400, r.text
    assert "/sleep?level=2" in r.json()["error"]["message"] and "abandoned" in r.json()["error"]["message"]
    assert generate(url).status_code == 503  # the weights were dropped: nothing served from them
    trainer.update(named)
    assert checksums(url) == served and generate(url).status_code == 200


def test_after_a_level2_sleep_a_partial_transaction_commits_nothing(server, trainer, named, served):
    url = server.url
    half = len(named) // 2
    assert post(url, "sleep", level=2).status_code == 200
    assert post(url, "wake_up").status_code == 200
    before = checksums(url)
    assert post(url, "start_weight_update").status_code == 200
    r, error, _ = trainer.push(named[:half])
    assert r.status_code == 200 and error is None, r.text
    r = post(url, "finish_weight_update")
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "nothing was committed" in message and "missing required parameters" in message
    assert named[-1][0] in message
    assert checksums(url) == before  # no half of the new weights landed
    assert generate(url).status_code == 503
    trainer.update(named)  # the whole model ends the no-weights state
    assert checksums(url) == served and generate(url).status_code == 200


# -- 6. requests in flight at a level-2 sleep end, with a reason ----------------------------------

def test_requests_in_flight_at_a_level2_sleep_end_with_finish_reason_abort(server, served):
    url = server.url
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", generate(url, max_tokens=3000)))
    t.start()
    deadline = time.monotonic() + 60
    while not any(line.startswith("vllm:num_requests_running{") and float(line.split()[1]) >= 1
                  for line in httpx.get(f"{url}/metrics").text.splitlines()):
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    t0 = time.monotonic()
    assert post(url, "sleep", level=2).status_code == 200
    t.join(20)
    assert not t.is_alive(), "the request was held with no answer after /sleep?level=2"
    assert time.monotonic() - t0 < 20
    assert out["r"].status_code == 200 and out["r"].json()["choices"][0]["finish_reason"] == "abort"


# -- 7. a transaction has an owner ---------------------------------------------------------------------

def test_a_transaction_is_owned_by_its_id(server, trainer, named, served):
    url = server.url
    r = post(url, "start_weight_update", {"transaction_id": "mine"})
    assert r.status_code == 200 and r.json()["transaction_id"] == "mine", r.text
    r = post(url, "start_weight_update", {"transaction_id": "theirs"})
    assert r.status_code == 409 and "'mine'" in r.json()["error"]["message"], r.text
    r = post(url, "finish_weight_update", {"transaction_id": "theirs"})
    assert r.status_code == 409 and "'mine'" in r.json()["error"]["message"], r.text
    noise = [(n, torch.randn_like(t)) for n, t in named]
    r, error, _ = trainer.push(noise[:2], transaction_id="theirs")  # another client's part: refused
    assert r.status_code == 409 and error is not None, r.text
    r, error, _ = trainer.push(noise[:2], transaction_id="mine")
    assert r.status_code == 200 and r.json()["staged"] is True, r.text
    assert checksums(url) == served
    r = post(url, "finish_weight_update", {"transaction_id": "mine"})
    assert r.status_code == 200 and r.json()["parts"] == 1, r.text
    changed = checksums(url)
    assert changed != served
    # A part of a finished transaction is refused, never applied as a whole update of its own.
    r, error, _ = trainer.push(named[:2], transaction_id="mine")
    assert r.status_code == 409 and "is not open" in r.text, r.text
    assert checksums(url) == changed


# -- 8. every refusal reaches the trainer at once --------------------------------------------------------

@pytest.mark.parametrize("extra", [{"weight_version": 2**70}, {"weight_version": "²"},
                                   {"packed_buffer_size_bytes": 2**64}])
def test_a_refusal_made_by_the_api_server_reaches_the_trainer_at_once(server, trainer, named, served, extra):
    r, error, seconds = trainer.push(named, **extra)
    if extra.get("weight_version") == "²":  # a label: taken, as vLLM takes any string
        assert r.status_code == 200 and error is None, r.text
        assert httpx.get(f"{server.url}/weight_info").json() == {"weight_version": "²"}
        return
    assert r.status_code == 400, r.text
    assert error is not None and seconds < 10, (error, seconds)  # not the group's 30 s timeout
    assert checksums(server.url) == served


# -- 5. world_size is bounded ---------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [65, 2**31 - 1, 2**40])
def test_world_size_is_bounded_by_the_configured_maximum(server, world_size):
    info = dict(master_address="127.0.0.1", master_port=get_open_port(), rank_offset=1, world_size=world_size)
    t0 = time.monotonic()
    r = post(server.url, "init_weight_transfer_engine", {"init_info": info})
    assert r.status_code == 400 and "max_world_size" in r.text and "64" in r.text, r.text
    assert time.monotonic() - t0 < 5


# -- 9. a transaction stages at most the model's size -----------------------------------------------------

def test_staging_more_than_the_model_in_one_transaction_is_a_413(server, trainer, named, served):
    url = server.url
    assert post(url, "start_weight_update").status_code == 200
    noise = [(n, torch.randn_like(t)) for n, t in named]
    r, error, _ = trainer.push(noise)
    assert r.status_code == 200, r.text
    r, error, seconds = trainer.push(noise)
    assert r.status_code == 413 and "the cap on a transaction's staging" in r.text, r.text
    assert error is not None and seconds < 10
    r = post(url, "finish_weight_update")
    assert r.status_code == 413 and "nothing was committed" in r.text, r.text
    assert checksums(url) == served


def test_concurrent_weight_checkers_share_one_reading_and_agree(server, served):
    results: list = [None] * 20

    def check(i: int) -> None:
        results[i] = post(server.url, "weight_checker", {"action": "checksum"})

    threads = [threading.Thread(target=check, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None and r.status_code == 200 for r in results)
    assert all(r.json()["checksums"] == served for r in results)


# -- weight versions: labels, one parser ---------------------------------------------------------------

def test_versions_are_numbers_or_labels_and_the_tokens_carry_the_label(server, trainer, named, served):
    url = server.url
    assert post(url, "start_weight_update").status_code == 200
    r = post(url, "finish_weight_update", {"weight_version": "step-100"})
    assert r.status_code == 200 and r.json()["weight_version"] == "step-100", r.text
    assert httpx.get(f"{url}/weight_info").json() == {"weight_version": "step-100"}
    body = httpx.post(f"{url}/v1/completions", timeout=60, json=dict(
        model="m", prompt=[1, 2, 3], max_tokens=3, temperature=0, return_weight_versions=True)).json()
    assert [s["version"] for s in body["choices"][0]["weight_versions"]] == ["step-100"]
    r = post(url, "update_weight_version", {"new_version": "v7"})
    assert r.status_code == 200 and r.json() == {"success": True, "new_version": "v7"}
    assert httpx.get(f"{url}/weight_info").json() == {"weight_version": "v7"}
    assert post(url, "update_weight_version", {"new_version": "42"}).status_code == 200
    assert httpx.get(f"{url}/weight_info").json() == {"weight_version": "42"}


VERSION_INPUTS = [2**63 - 1, 2**63, 2**64, 2**70, -1, True, 1.5, "²", "①", "٣", "", " ", "\x00", "a\nb",
                  "9" * 19, "9" * 20, "1" * 400, "x" * 300, [], {}, ["1"], None]


def _version_cases(rng: random.Random) -> list:
    cases = list(VERSION_INPUTS)
    alphabet = [chr(c) for c in (*range(0x20, 0x7f), 0xb2, 0x2460, 0x663, 0x200b, 0xff11, 0x1d7ce, 0x0)]
    for _ in range(200):
        cases.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))))
    return cases


def test_every_version_field_answers_2xx_or_a_400_naming_it(server, served):
    """/update_weight_version, /finish_weight_update and update_info's weight_version, with
    overflowing integers, non-ASCII digits and random unicode: a 200, or a 400 that names
    the field. Never a 500."""
    url, rng = server.url, random.Random(54)
    with httpx.Client(base_url=url, timeout=60) as client:
        for value in _version_cases(rng):
            r = client.post("/update_weight_version", json={"new_version": value})
            assert r.status_code in (200, 400) and (r.status_code == 200 or r.json()["error"]["param"] ==
                                                    "new_version"), (value, r.text)
            assert client.post("/start_weight_update").status_code == 200
            r = client.post("/finish_weight_update", json={"weight_version": value})
            assert r.status_code in (200, 400), (value, r.text)
            if r.status_code == 400:
                assert r.json()["error"]["param"] == "weight_version", (value, r.text)
                assert client.post("/finish_weight_update").status_code == 200
        # A numbered version of 64 bits or more, or ASCII-free digits, as the issue found them.
        for value in (2**64, 2**70, "18446744073709551616"):
            r = client.post("/update_weight_version", json={"new_version": value})
            assert r.status_code == 400 and "64-bit" in r.json()["error"]["message"], r.text


# -- sleep and wake by tags, as vLLM's RL loop does them -------------------------------------------------

def test_wake_the_weights_update_them_then_wake_the_kv_cache(server, trainer, named, served):
    url = server.url
    assert post(url, "sleep", level=2).status_code == 200
    r = post(url, "wake_up", tags="weights")
    assert r.status_code == 200 and r.json()["status"] == "sleeping", r.text
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}  # the KV cache still sleeps
    trainer.update(named)  # the weights are awake: an update lands
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
    assert post(url, "wake_up", tags="kv_cache").json()["status"] == "awake"
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    assert checksums(url) == served and generate(url).status_code == 200
    r = post(url, "wake_up", tags="gpu")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags", r.text


def test_sleep_level_0_and_release_kv_cache_memory(server, served):
    url = server.url
    assert post(url, "sleep", level=0).status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
    assert post(url, "wake_up").status_code == 200
    assert post(url, "sleep", level=3).status_code == 400
    assert post(url, "release_kv_cache_memory").status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
    assert post(url, "release_kv_cache_memory").status_code == 409  # released already
    assert post(url, "wake_up", tags="kv_cache").status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    assert generate(url).status_code == 200 and checksums(url) == served


# -- /weight_checker as vLLM shapes it ---------------------------------------------------------------

def test_weight_checker_keys_full_digests_as_vllm_and_reset_needs_a_full_update(server, trainer, named, served):
    url = server.url
    assert set(served) == {f"dp0:pp0:pcp0:tp0:{name}" for name in served_names(named)}
    assert all(len(d) == 64 and int(d, 16) >= 0 for d in served.values())
    r = post(url, "weight_checker", {"action": "reset"})
    assert r.status_code == 200, r.text
    assert all(checksums(url)[k] != v for k, v in served.items())
    assert generate(url).status_code == 503  # noise is not served
    trainer.update(named)
    assert checksums(url) == served and generate(url).status_code == 200


def served_names(named: list) -> set[str]:
    """The server's parameter names for the tiny model: q/k/v and gate/up are fused."""
    out = set()
    for name, _ in named:
        for part, fused in ((".q_proj.", ".qkv_proj."), (".k_proj.", ".qkv_proj."), (".v_proj.", ".qkv_proj."),
                            (".gate_proj.", ".gate_up_proj."), (".up_proj.", ".gate_up_proj.")):
            name = name.replace(part, fused)
        out.add(name)
    return out
