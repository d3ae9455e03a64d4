"""A trainer process the transfer tests drive, one JSON command per line on stdin:

    {"op": "init", "port": P, "world_size": 2, "timeout_s": 6}
    {"op": "push", "packed": true, "bucket_bytes": N, "scale": 0.0, "fault": null, "at": 2}
    {"op": "exit"}

Once loaded it prints {"ready": true}; then it answers one JSON line per command:
{"ok": true, "seconds": s} or {"error": type name, "message": ..., "seconds": s}. The
weights are a checkpoint's tensors (safetensors, in key order), each times (1 + scale).
A fault makes this trainer misbehave for one push:

    short / long / altered   bucket broadcast number `at` (from 1) carries half its bytes,
                             twice its bytes, or one byte flipped (after its checksum)
    plan-not-json / plan-list / plan-missing   the plan message is not what the protocol says
    go-not-json / go-list                       the go message is not what the protocol says
    die                      the process exits (code 17) at bucket broadcast `at`

    python tests/helpers/trainer_agent.py CHECKPOINT.safetensors [nccl DEVICE]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import torch
from safetensors.torch import load_file

from rlserve.weight_transfer import GlooWeightTransferEngine, NCCLWeightTransferEngine, TransferGroup, handshake


class TrainerProcess:
    """The tests' handle on this script running as a process."""

    def __init__(self, checkpoint: str, *backend_and_device: str):
        self.proc = subprocess.Popen([sys.executable, __file__, checkpoint, *backend_and_device],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.answer(180) == {"ready": True}

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout_s: float = 120) -> dict | None:
        """The next answer, or None when the process ended (or said nothing in timeout_s)."""
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("line", self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout_s)
        return json.loads(box["line"]) if box.get("line") else None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send(op="exit")
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


PLAN_FAULTS = {"plan-not-json": "this is not json", "plan-list": "[1, 2, 3]",
               "plan-missing": '{"checksum": true}'}
GO_FAULTS = {"go-not-json": "go go go", "go-list": "[true]"}


def weights(base: dict[str, torch.Tensor], scale: float, device: str) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, each times (1 + scale): a cheap, visible change."""
    return [(name, (t * (1 + scale) if scale else t).to(device)) for name, t in base.items()]


def faulty_broadcast(real, fault: str, at: int):
    calls = [0]

    def broadcast(self, tensor, src=0):
        calls[0] += 1
        if calls[0] == at:
            if fault == "die":
                os._exit(17)
            flat = tensor.reshape(-1)
            if fault == "short":
                tensor = flat[: flat.numel() // 2]
            elif fault == "long":
                tensor = torch.cat([flat, flat])
            elif fault == "altered":
                tensor = flat.clone()
                tensor[tensor.numel() // 2] ^= 0xFF
        return real(self, tensor, src)

    return broadcast


def main() -> None:
    path = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "gloo"
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    engine = NCCLWeightTransferEngine if backend == "nccl" else GlooWeightTransferEngine
    base = load_file(path)
    group = None
    print(json.dumps({"ready": True}), flush=True)  # imports and checkpoint done: commands answer fast
    real_broadcast, real_offer, real_set = TransferGroup.broadcast, handshake._offer, TransferGroup.set
    for line in sys.stdin:
        cmd = json.loads(line)
        started = time.monotonic()
        try:
            if cmd["op"] == "exit":
                break
            if cmd["op"] == "init":
                if group is not None:
                    group.close()
                group = engine.trainer_init(dict(master_address="127.0.0.1", master_port=cmd["port"],
                                                 world_size=cmd.get("world_size", 2),
                                                 timeout_s=cmd.get("timeout_s", 10)),
                                            device=device if backend == "nccl" else None)
            elif cmd["op"] == "push":
                fault, at = cmd.get("fault"), cmd.get("at", 2)
                if fault in ("short", "long", "altered", "die"):
                    TransferGroup.broadcast = faulty_broadcast(real_broadcast, fault, at)
                elif fault in PLAN_FAULTS:
                    handshake._offer = lambda g, rank, text, fault=fault: real_offer(g, rank, PLAN_FAULTS[fault])
                elif fault in GO_FAULTS:
                    def bad_go(self, key, value, fault=fault):
                        return real_set(self, key, GO_FAULTS[fault] if key.endswith("/go") else value)
                    TransferGroup.set = bad_go
                try:
                    engine.trainer_send_weights(iterator=iter(weights(base, cmd.get("scale", 0.0), device)),
                                                group=group, packed=cmd.get("packed", True),
                                                packed_buffer_size_bytes=cmd.get("bucket_bytes", 32 << 20),
                                                checksum=cmd.get("checksum", True))
                finally:
                    TransferGroup.broadcast, handshake._offer, TransferGroup.set = (
                        real_broadcast, real_offer, real_set)
            else:
                raise ValueError(f"unknown op {cmd['op']!r}")
            answer = {"ok": True}
        except Exception as e:
            answer = {"error": type(e).__name__, "message": str(e)}
        answer["seconds"] = time.monotonic() - started
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
