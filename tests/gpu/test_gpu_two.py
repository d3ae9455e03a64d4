"""NCCL weight transfer between two GPUs: a trainer process on cuda:1 (its current device left
at cuda:0, as a user's would be), the receiver in this process on cuda:0.

Skipped with fewer than two GPUs.
"""

from __future__ import annotations

import time

import pytest
import torch

from helpers.trainer_agent import TrainerProcess
from rlserve.weight_transfer import ExpectedParam, WeightTransferError, get_open_port, receive_weights, receiver_init

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu2,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

TIMEOUT_S = 20.0
BUCKET = 16 << 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """About 200 MB in several dtypes and sizes: small tensors that share packed buckets,
    one bigger than a bucket, odd byte counts, a 0-d tensor."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    tensors = {"embed.weight": torch.randn(8192, 1024, generator=g).to(torch.bfloat16),  # 16 MiB
               "head.weight": torch.randn(6000, 1024, generator=g)}  # 23.4 MiB: direct
    for i in range(24):
        tensors[f"layers.{i}.w"] = torch.randn(1024, 1536 + i, generator=g).to(torch.bfloat16)
        tensors[f"layers.{i}.norm"] = torch.randn(1001 + i, generator=g)
        tensors[f"layers.{i}.scale"] = torch.randn((), generator=g).to(torch.float16)
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    save_file(tensors, str(path))
    # safetensors keeps keys sorted: that is the order the trainer sends in.
    return str(path), {n: tensors[n] for n in sorted(tensors)}


def Trainer(path: str) -> TrainerProcess:
    return TrainerProcess(path, "nccl", "cuda:1")


def connect(trainer: TrainerProcess):
    port = get_open_port()
    trainer.send(op="init", port=port, timeout_s=TIMEOUT_S)
    group = receiver_init("nccl", dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2),
                          device="cuda:0", timeout_s=TIMEOUT_S + 60)  # the trainer process is still starting
    group.timeout_s = TIMEOUT_S
    answer = trainer.answer()
    assert answer and answer.get("ok"), answer
    return group


def update_info(tensors: dict[str, torch.Tensor]) -> dict:
    return dict(names=list(tensors), dtype_names=[str(t.dtype).split(".")[-1] for t in tensors.values()],
                shapes=[list(t.shape) for t in tensors.values()], packed=True, packed_buffer_size_bytes=BUCKET)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def expected(tensors) -> dict[str, ExpectedParam]:
    return {n: ExpectedParam(tuple(t.shape)) for n, t in tensors.items()}


def receive(group, trainer: TrainerProcess, tensors, **cmd):
    trainer.send(op="push", packed=True, bucket_bytes=BUCKET, **cmd)
    try:
        out = receive_weights(group, update_info(tensors), expected(tensors), device="cuda:0")
    finally:
        answer = trainer.answer()
    return out, answer


def test_packed_push_between_two_gpus_is_bit_exact_and_checksummed(checkpoint):
    path, tensors = checkpoint
    trainer = Trainer(path)
    try:
        group = connect(trainer)
        assert group.device == torch.device("cuda", 0)
        for _ in range(2):  # the second push reuses the group and the ring buffers
            out, answer = receive(group, trainer, tensors)
            assert answer["ok"], answer
            assert [n for n, _ in out] == list(tensors)
            for name, t in out:
                assert t.device == torch.device("cuda", 0)
                assert same_bytes(t, tensors[name]), name
        # One byte flipped on the wire (after its checksum): the update fails and names it.
        with pytest.raises(WeightTransferError, match=r"bucket 3/\d+ .* does not match the trainer's checksum"):
            receive(group, trainer, tensors, fault="altered", at=3)
        group.close()
    finally:
        trainer.close()


def test_trainer_killed_mid_push_fails_within_the_timeout_then_a_fresh_init_works(checkpoint):
    path, tensors = checkpoint
    trainer = Trainer(path)
    try:
        group = connect(trainer)
        started = time.monotonic()
        with pytest.raises(WeightTransferError):
            receive(group, trainer, tensors, fault="die", at=4)
        assert time.monotonic() - started < TIMEOUT_S + 10
        assert trainer.proc.wait(30) == 17
        group.close()
    finally:
        trainer.close()
    trainer = Trainer(path)
    try:
        group = connect(trainer)
        out, answer = receive(group, trainer, tensors)
        assert answer["ok"], answer
        for name, t in out:
            assert same_bytes(t, tensors[name]), name
        group.close()
    finally:
        trainer.close()
