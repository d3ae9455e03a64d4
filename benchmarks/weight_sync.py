"""Live weight-update speed: push time and GB/s, packed and unpacked (a script, not a test).

Starts `rlserve serve` on the model's config with dummy weights and the chosen backend,
builds a trainer-side model of the same architecture, and pushes it with WeightSyncClient.

    python benchmarks/weight_sync.py --model smollm2 --backend gloo --device cpu
    python benchmarks/weight_sync.py --model qwen3-0.6b --backend nccl --device cuda   # 2 GPUs
    python benchmarks/weight_sync.py --model qwen3-8b --backend ipc    # trainer and server on one GPU

--model takes a preset of benchmarks/throughput.py or an HF directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from throughput import model_dir  # noqa: E402

from rlserve.server.launcher import ServerProcess  # noqa: E402
from rlserve.weight_transfer import WeightSyncClient, get_open_port  # noqa: E402


def any_tokenizer(path: str) -> str:
    """The demo model's tokenizer, or (where it is not installed) a word-level one written
    next to the preset's config: pushes never tokenize."""
    try:
        from rlserve.model.demo_model import demo_model_path
        return demo_model_path()
    except RuntimeError:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        target = os.path.join(path, "tokenizer")
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(target)
        return target


def start_server(path: str, args, port: int) -> ServerProcess:
    flags = ["--device", args.server_device, "--dtype", args.dtype, "--load-format", "dummy",
             "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
             "--weight-transfer-config", json.dumps({"backend": args.backend, "timeout_s": 300}),
             "--log-level", "warning"]
    if args.skip_tokenizer:  # a bare preset config: any tokenizer will do for pushes
        flags += ["--tokenizer", any_tokenizer(path)]
    return ServerProcess(path, *flags, port=port, timeout_s=600)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl", "ipc"])
    p.add_argument("--device", default="cpu", help="the trainer's device")
    p.add_argument("--server-device", default=None, help="default: cpu for gloo, cuda:0 for nccl")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mib", type=int, nargs="*", default=[512])
    args = p.parse_args()
    if args.backend == "ipc":  # colocated: both on the one GPU, in the model's own dtype
        args.device, args.dtype = "cuda", "bfloat16" if args.dtype == "float32" else args.dtype
    args.server_device = args.server_device or ("cpu" if args.backend == "gloo" else "cuda:0")
    path = model_dir(args.model)
    args.skip_tokenizer = not os.path.exists(os.path.join(path, "tokenizer_config.json"))

    from transformers import AutoConfig, AutoModelForCausalLM
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):  # initialised where it lives: an 8B model on the host is slow
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    tensors = [(n, p.detach()) for n, p in model.named_parameters()]
    size = sum(t.numel() * t.element_size() for _, t in tensors)
    print(f"{args.model}: {len(tensors)} tensors, {size / 1e9:.3f} GB in {args.dtype}, "
          f"backend {args.backend}, trainer on {args.device}, server on {args.server_device}")

    port = get_open_port()
    server = start_server(path, args, port)
    try:
        client = WeightSyncClient(f"http://127.0.0.1:{port}", backend=args.backend)
        client.init()
        if args.backend == "ipc":
            bench_ipc(client, tensors, size, args.repeats)
            return
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


def bench_ipc(client: WeightSyncClient, tensors, size: int, repeats: int) -> None:
    """First push (exports and opens every handle), then warm pushes: the bare update call
    as the trainer sees it, the server's own split, and the whole pause-push-resume cycle."""
    import statistics
    from rlserve.weight_transfer.client import post_update
    url, sender = client.urls[0], client.group[0]

    build = []

    def update() -> dict:
        t0 = time.perf_counter()
        info = sender.update_info(tensors)
        build.append(time.perf_counter() - t0)
        return post_update(url, info, session=client.session)

    # A plain device-to-device copy of the same bytes: the floor for a push.
    dst = [torch.empty_like(t) for _, t in tensors]
    copies = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, (_, t) in zip(dst, tensors):
            d.copy_(t)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - t0)
    del dst
    print(f"{'device copy of the same tensors':>34}: {min(copies) * 1e3:.2f} ms "
          f"({size / min(copies) / 1e9:.0f} GB/s)")

    t0 = time.perf_counter()
    first = update()
    first_s = time.perf_counter() - t0
    print(f"{'first push (export + open)':>34}: {first_s * 1e3:.1f} ms (server: receive "
          f"{first['receive_seconds'] * 1e3:.1f} ms, apply {first['apply_seconds'] * 1e3:.1f} ms; "
          f"{sender.exported_last} storages exported)")
    warm, recv, apply = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = update()
        warm.append(time.perf_counter() - t0)
        recv.append(r["receive_seconds"])
        apply.append(r["apply_seconds"])
    assert sender.exported_last == 0
    med = statistics.median(warm)
    print(f"{'warm push (update call)':>34}: median {med * 1e3:.2f} ms, best {min(warm) * 1e3:.2f} ms "
          f"= {size / med / 1e9:.0f} GB/s (server: receive {statistics.median(recv) * 1e3:.2f} ms, "
          f"apply {statistics.median(apply) * 1e3:.2f} ms; building update_info "
          f"{statistics.median(build[1:]) * 1e3:.2f} ms; {repeats} pushes)")
    cycles = [client.push(tensors).seconds for _ in range(repeats)]
    print(f"{'pause-push-resume (client.push)':>34}: median {statistics.median(cycles) * 1e3:.2f} ms, "
          f"best {min(cycles) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
