"""A data-parallel replica that dies takes its ranks out of the trainer's transfer group:
the trainer hears so within seconds, never at its timeout, whether it was already
pushing when the replica died or pushes after the replica came back (an update then
needs a new /init_weight_transfer_engine). The server keeps serving the weights it had.
On CPU over gloo, `--data-parallel-size 2`, the tiny model.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from helpers.data_parallel import PROMPTS, complete, health, hf_greedy, trainer_model, wait_for
from helpers.servers import start_tiny_server, stop_server
from rlserve.weight_transfer import GlooWeightTransferEngine, WeightSyncClient, WeightTransferError

TIMEOUT_S = 30  # the group's: the trainer would wait this long for an answer that never comes
FAST_S = 5  # well under it; the docs promise about 2 s


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("dp_refusals") / "server.log"
    cfg = json.dumps({"backend": "gloo", "timeout_s": TIMEOUT_S})
    srv = start_tiny_server(log, "--data-parallel-size", "2", "--weight-transfer-config", cfg,
                            "--max-num-seqs", "4")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def trainer():
    from rlserve.model.presets import model_dir
    return trainer_model(model_dir("tiny"))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rlserve.model.demo_model import demo_model_path
    return AutoTokenizer.from_pretrained(demo_model_path())


def kill_and_wait_back(url: str, index: int) -> None:
    pid = health(url).json()["replicas"][index]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: (lambda x: x["state"] == "up" and x["pid"] != pid)(health(url).json()["replicas"][index]),
             180, f"replica {index} restarted and serving")


def assert_serves(url: str, version: int, trainer, tokenizer) -> None:
    for p in PROMPTS[:3]:
        got = complete(url, p)
        assert got["weight_version"] == version
        assert got["choices"][0]["token_ids"] == hf_greedy(trainer, tokenizer.encode(p)), p


def test_push_after_a_replica_restarted_fails_fast_and_old_weights_serve(dp_server, trainer, tokenizer):
    url = dp_server.url
    sync = WeightSyncClient(url, backend="gloo", timeout_s=TIMEOUT_S)
    sync.init()
    sync.push(trainer.named_parameters(), version=5)
    # Replica 0 holds the group's first ranks: the trainer waits on them first.
    kill_and_wait_back(url, 0)

    from rlserve.model.presets import model_dir
    other = trainer_model(model_dir("tiny"), seed=1)
    started = time.monotonic()
    with pytest.raises(WeightTransferError) as caught:
        sync.push(other.named_parameters(), version=6)
    seconds = time.monotonic() - started
    assert seconds < FAST_S, seconds
    # The server's answer, and the trainer's own send, both say why and what to do.
    assert "409" in str(caught.value) and "init_weight_transfer_engine" in str(caught.value)
    sent = caught.value.__cause__
    assert isinstance(sent, WeightTransferError), caught.value
    assert "replica 0" in str(sent) and "init_weight_transfer_engine" in str(sent), sent

    assert [r["state"] for r in health(url).json()["replicas"]] == ["up", "up"]
    assert_serves(url, 5, trainer, tokenizer)
    # A new init forms a group with every replica again.
    sync.init()
    result = sync.push(other.named_parameters(), version=6)
    assert [r["weight_version"] for r in result.answers[0]["replicas"]] == [6, 6]
    assert_serves(url, 6, other, tokenizer)


def test_trainer_pushing_when_a_replica_dies_hears_it_at_once(dp_server, trainer, tokenizer):
    url = dp_server.url
    wait_for(lambda: health(url).json()["serving"] == 2, 180, "both replicas up")
    sync = WeightSyncClient(url, backend="gloo", timeout_s=TIMEOUT_S)
    sync.init()
    sync.push(trainer.named_parameters(), version=7)
    # vLLM's RLHF-over-HTTP flow, its /update_weights not sent yet: the trainer waits for every rank.
    outcome: dict = {}

    def send() -> None:
        try:
            GlooWeightTransferEngine.trainer_send_weights(iterator=trainer.named_parameters(), group=sync.group)
            outcome["error"] = None
        except Exception as e:
            outcome["error"] = e
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=send)
    thread.start()
    pid = health(url).json()["replicas"][1]["pid"]
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    thread.join(TIMEOUT_S + 10)
    assert isinstance(outcome.get("error"), WeightTransferError), outcome
    assert outcome["at"] - killed < FAST_S, outcome["at"] - killed
    assert "replica 1 died" in str(outcome["error"]), outcome["error"]
    # Replica 0 served on meanwhile, and replica 1 comes back with the same weights.
    assert_serves(url, 7, trainer, tokenizer)
    wait_for(lambda: health(url).json()["serving"] == 2, 180, "replica 1 back")
    assert health(url).json()["replicas"][1]["weight_version"] == 7
    r = httpx.post(f"{url}/update_weights", timeout=TIMEOUT_S, json={"update_info": dict(
        names=["model.norm.weight"], dtype_names=["float32"], shapes=[[128]])})
    assert r.status_code == 409 and "init_weight_transfer_engine" in r.json()["error"]["message"]
