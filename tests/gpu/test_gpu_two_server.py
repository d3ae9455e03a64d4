"""The server on two GPUs: vLLM's RLHF-over-HTTP flow over NCCL (server on cuda:0, trainer on
cuda:1), a push while keep-mode streams run, a trainer killed mid-push, and tensor
parallelism across both GPUs. Skipped with fewer than two GPUs.

The model is a small random Llama with the demo model's tokenizer (or the one
RLSERVE_TEST_TOKENIZER names), drawn wide enough that greedy choices are rarely near-ties,
so float32 outputs can be compared token for token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from helpers.servers import start_server, stop_server, stream_completion
from helpers.trainer_agent import TrainerProcess
from helpers.two_gpu import PROMPTS, llama_checkpoint, trainer_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu2,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return llama_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[str, list[int]]:
    return trainer_greedy(checkpoint)


def _server(checkpoint: str, log: Path, *flags: str):
    return start_server(checkpoint, log, "--device", "cuda:0", "--max-num-seqs", "16", *flags)


def _greedy_ids(url: str, model: str, prompt: str, max_tokens: int = 32) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json=dict(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
        return_token_ids=True))
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def test_the_seed_script_over_nccl_serves_the_trainers_model(checkpoint, reference, tmp_path):
    """examples/rlhf_http.py as a user runs it: a dummy-weight server on GPU 0, the script's
    trainer (float32) on GPU 1. After its push, greedy outputs are the trainer's, token for token."""
    srv = _server(checkpoint, tmp_path / "s.log", "--load-format", "dummy",
                  "--weight-transfer-config", '{"backend": "nccl"}')
    try:
        before = _greedy_ids(srv.url, checkpoint, PROMPTS[0])
        env = dict(os.environ, BASE_URL=srv.url, MODEL=checkpoint, TRAIN_DTYPE="float32",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "rlhf_http.py")], env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "AFTER weight update" in run.stdout
        for p in PROMPTS:
            assert _greedy_ids(srv.url, checkpoint, p) == reference[p], p
        assert before != reference[PROMPTS[0]]  # the dummy weights said something else
    finally:
        stop_server(srv)


def _stream(url: str, model: str, prompt: str, results: list, progress: list, i: int) -> None:
    stream_completion(url, model, prompt, 64, results, progress, i)


def test_a_push_while_keep_mode_streams_run_loses_nothing(checkpoint, tmp_path):
    from safetensors.torch import load_file

    from rlserve.weight_transfer import WeightSyncClient
    srv = _server(checkpoint, tmp_path / "s.log", "--load-format", "dummy",
                  "--weight-transfer-config", '{"backend": "nccl"}')
    try:
        client = WeightSyncClient(srv.url, backend="nccl", device="cuda:1")
        client.init()
        weights = [(n, t.to("cuda:1")) for n, t in load_file(os.path.join(checkpoint, "model.safetensors")).items()]
        n = 8
        results, progress = [None] * n, [0] * n
        threads = [threading.Thread(target=_stream, args=(srv.url, checkpoint, f"{PROMPTS[i % 4]} {i}",
                                                          results, progress, i)) for i in range(n)]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while min(progress) < 4 and time.time() < deadline:
            time.sleep(0.01)
        assert min(progress) >= 4
        push = client.push(weights, version=7, pause_mode="keep")
        for t in threads:
            t.join(timeout=120)
        assert push.weight_versions == [7]
        for chunks, finish, spans in results:
            assert finish == "length"
            assert sum(len(ids) for ids, _ in chunks) == 64
            assert spans[0]["start"] == 0 and spans[-1]["end"] == 64 and spans[-1]["version"] == 7
            assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
    finally:
        stop_server(srv)


def test_a_trainer_killed_mid_push_leaves_the_old_weights_serving(checkpoint, tmp_path):
    from rlserve.weight_transfer import get_open_port
    srv = _server(checkpoint, tmp_path / "s.log", "--weight-transfer-config",
                  json.dumps({"backend": "nccl", "timeout_s": TIMEOUT_S}))
    path = os.path.join(checkpoint, "model.safetensors")
    try:
        before = [_greedy_ids(srv.url, checkpoint, p) for p in PROMPTS]
        names, dtypes, shapes = _update_info(path)
        for attempt in ("die", None):
            trainer = TrainerProcess(path, "nccl", "cuda:1")
            port = get_open_port()
            trainer.send(op="init", port=port, timeout_s=TIMEOUT_S)
            r = httpx.post(f"{srv.url}/init_weight_transfer_engine", timeout=120, json={"init_info": dict(
                master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2)})
            assert r.status_code == 200, r.text
            assert trainer.answer().get("ok")
            out = {}
            t = threading.Thread(target=lambda out=out: out.setdefault("r", httpx.post(
                f"{srv.url}/update_weights", timeout=120, json={"update_info": dict(
                    names=names, dtype_names=dtypes, shapes=shapes, packed=True,
                    packed_buffer_size_bytes=4 << 20)})))
            started = time.monotonic()
            t.start()
            trainer.send(op="push", packed=True, bucket_bytes=4 << 20, scale=0.5, fault=attempt, at=2)
            if attempt == "die":
                assert trainer.proc.wait(timeout=60) == 17
                t.join(timeout=TIMEOUT_S + 30)
                assert out["r"].status_code == 502, out["r"].text
                assert time.monotonic() - started < TIMEOUT_S + 30
                assert httpx.get(f"{srv.url}/health").status_code == 200
                assert [_greedy_ids(srv.url, checkpoint, p) for p in PROMPTS] == before
            else:
                assert trainer.answer().get("ok")
                t.join(timeout=60)
                assert out["r"].status_code == 200, out["r"].text
                assert [_greedy_ids(srv.url, checkpoint, p) for p in PROMPTS] != before
                trainer.close()
    finally:
        stop_server(srv)


def _update_info(path: str):
    from safetensors import safe_open
    names, dtypes, shapes = [], [], []
    with safe_open(path, "pt") as f:
        for name in sorted(f.keys()):
            t = f.get_slice(name)
            names.append(name)
            dtypes.append({"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[t.get_dtype()])
            shapes.append(list(t.get_shape()))
    return names, dtypes, shapes


def test_tensor_parallel_2_gives_tensor_parallel_1s_tokens(checkpoint, reference, tmp_path):
    """NCCL all-reduce inside the CUDA graphs of a TP=2 server (cuda:0 and cuda:1)."""
    outs = {}
    for tp in (1, 2):
        srv = _server(checkpoint, tmp_path / f"tp{tp}.log", "--tensor-parallel-size", str(tp))
        try:
            outs[tp] = [_greedy_ids(srv.url, checkpoint, p) for p in PROMPTS]
        finally:
            stop_server(srv)
    assert outs[2] == outs[1]
    assert outs[1] == [reference[p] for p in PROMPTS]


def test_overlapped_tensor_parallel_2_gives_the_same_tokens(checkpoint):
    """Overlapped scheduling at TP=2: rank 1 reads the tokens rank 0 broadcasts on the device,
    for steps queued before those tokens reached the host; greedy and seeded, with preemption."""
    from rlserve import LLM, SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)]
    # Eight blocks of 16 tokens for four sequences of about 60: preemption on both runs.
    llm = LLM(checkpoint, dtype="float32", max_model_len=512, tensor_parallel_size=2, num_kv_blocks=8)
    try:
        runs = []
        for overlapped in (False, True):
            llm.engine.async_scheduling = overlapped
            outs = llm.generate(PROMPTS[:2], params)
            runs.append([[o.token_ids for o in r.outputs] for r in outs])
        assert runs[1] == runs[0]
        assert llm.engine.stats().preemptions_total > 0
    finally:
        llm.shutdown()
