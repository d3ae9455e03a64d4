"""Live weight-update speed: push time and GB/s, packed and unpacked (a script, not a test).

Starts `rlserve serve` on the model's config with dummy weights and the chosen backend,
builds a trainer-side model of the same architecture, and pushes it with WeightSyncClient.

    python benchmarks/weight_sync.py --model smollm2 --backend gloo --device cpu
    python benchmarks/weight_sync.py --model qwen3-0.6b --backend nccl --device cuda   # 2 GPUs

--model takes a preset of benchmarks/throughput.py or an HF directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from throughput import model_dir  # noqa: E402

from rlserve.server.launcher import ServerProcess  # noqa: E402
from rlserve.weight_transfer import WeightSyncClient, get_open_port  # noqa: E402


def start_server(path: str, args, port: int) -> ServerProcess:
    flags = ["--device", args.server_device, "--dtype", args.dtype, "--load-format", "dummy",
             "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
             "--weight-transfer-config", json.dumps({"backend": args.backend, "timeout_s": 300}),
             "--log-level", "warning"]
    if args.skip_tokenizer:  # a bare preset config: any tokenizer will do for pushes
        from rlserve.model.demo_model import demo_model_path
        flags += ["--tokenizer", demo_model_path()]
    return ServerProcess(path, *flags, port=port, timeout_s=600)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--device", default="cpu", help="the trainer's device")
    p.add_argument("--server-device", default=None, help="default: cpu for gloo, cuda:0 for nccl")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mib", type=int, nargs="*", default=[512])
    args = p.parse_args()
    args.server_device = args.server_device or ("cpu" if args.backend == "gloo" else "cuda:0")
    path = model_dir(args.model)
    args.skip_tokenizer = not os.path.exists(os.path.join(path, "tokenizer_config.json"))

    from transformers import AutoConfig, AutoModelForCausalLM
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype).to(args.device)
    tensors = [(n, p.detach()) for n, p in model.named_parameters()]
    size = sum(t.numel() * t.element_size() for _, t in tensors)
    print(f"{args.model}: {len(tensors)} tensors, {size / 1e9:.3f} GB in {args.dtype}, "
          f"backend {args.backend}, trainer on {args.device}, server on {args.server_device}")

    port = get_open_port()
    server = start_server(path, args, port)
    try:
        client = WeightSyncClient(f"http://127.0.0.1:{port}", backend=args.backend)
        client.init()
        for packed in (True, False):
            for mib in args.bucket_mib if packed else [0]:
                times = []
                for i in range(args.repeats):
                    r = client.push(tensors, packed=packed, packed_buffer_size_bytes=(mib or 512) << 20)
                    times.append(r)
                best = min(times, key=lambda r: r.seconds)
                label = f"packed, {mib} MiB buckets" if packed else "unpacked"
                print(f"{label:>26}: transfer {best.transfer_seconds:.3f} s = {best.gb_per_second:.2f} GB/s; "
                      f"pause-push-resume {best.seconds:.3f} s (best of {args.repeats}; "
                      f"first {times[0].seconds:.3f} s)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
