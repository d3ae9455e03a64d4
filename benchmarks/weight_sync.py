"""Live weight-update speed: push time and GB/s, packed and unpacked (a script, not a test).

Starts `rlserve serve` on the model's config with dummy weights and the chosen backend,
builds a trainer-side model of the same architecture, and pushes it with WeightSyncClient.
Over nccl and gloo it first times a plain broadcast of the same bytes (in --bucket-mib
pieces) between the trainer's device and a peer process on the server's device, and
reports each push against it; --checksum-cost also pushes without bucket checksums.

    python benchmarks/weight_sync.py --model smollm2 --backend gloo --device cpu --checksum-cost
    python benchmarks/weight_sync.py --model qwen3-8b --backend nccl --device cuda:1 --server-device cuda:0 \
        --bucket-mib 1024 256 --checksum-cost                                        # 2 GPUs
    python benchmarks/weight_sync.py --model qwen3-8b --backend ipc    # trainer and server on one GPU
    python benchmarks/weight_sync.py --model qwen3-8b --backend ipc --lora --repeats 20   # a LoRA push
    python benchmarks/weight_sync.py --model qwen3-8b --backend nccl --device cuda:1 --server-device cuda:0 \
        --lora --repeats 20
    python benchmarks/weight_sync.py --model smollm2 --backend gloo --lora --repeats 10   # CPU
    python benchmarks/weight_sync.py --model qwen3-30b-a3b --backend ipc     # an MoE model, colocated
    python benchmarks/weight_sync.py --model qwen3-30b-a3b --backend ipc --per-expert   # per-expert names
    python benchmarks/weight_sync.py --model qwen3-30b-a3b --plan-only       # host planning alone (CPU)

For a mixture-of-experts model it first times, on the host, what the server does with an
update's names before any byte moves (parse update_info, check the names against the model,
plan the buckets, resolve each name to its parameter slices), for the trainer's stacked
expert names and for the checkpoint's per-expert names.

--lora: the trainer holds a PEFT LoRA adapter (--lora-rank, 16 by default) on every projection
(q/k/v/o, gate/up/down) and pushes only it with WeightSyncClient.push_lora to a server started
with --enable-lora: the first push creates the adapter, the timed ones replace it.

--model takes a preset of benchmarks/throughput.py or an HF directory.

Columns: "send" is the trainer's trainer_send_weights (handshake, packing, checksums,
the broadcasts, until they are through); "update" is the whole /update_weights as the
trainer sees it (the server has received, verified and loaded the weights).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rlserve.model.moe import unstack_experts  # noqa: E402
from rlserve.server.launcher import ServerProcess  # noqa: E402
from rlserve.weight_transfer import TransferGroup, WeightSyncClient, get_open_port, receiver_init  # noqa: E402
from throughput import model_dir  # noqa: E402


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
             "--max-model-len", "256", "--kv-cache-memory-bytes", str(1 << 30), "--max-num-seqs", "8",
             "--weight-transfer-config", json.dumps({"backend": args.backend, "timeout_s": 300}),
             "--log-level", "warning"]
    if args.lora:
        flags += ["--enable-lora", "--max-lora-rank", str(args.lora_rank)]
    if args.skip_tokenizer:  # a bare preset config: any tokenizer will do for pushes
        flags += ["--tokenizer", any_tokenizer(path)]
    return ServerProcess(path, *flags, port=port, timeout_s=600, die_with_parent=True)


def pieces(buf: torch.Tensor, piece_bytes: int) -> list[torch.Tensor]:
    return [buf[i: i + piece_bytes] for i in range(0, buf.numel(), piece_bytes)]


def plain_broadcasts(group: TransferGroup, buf: torch.Tensor, piece_bytes: int) -> None:
    """Every piece of `buf` broadcast (or received) back to back, then waited for."""
    with group.streams():
        works = [group.broadcast(p) for p in pieces(buf, piece_bytes)]
        for w in works:
            group.wait(w, "a plain broadcast")


def peer(args) -> None:
    """The baseline's receiving side, in its own process on the server's device."""
    group = receiver_init(args.backend, dict(master_address="127.0.0.1", master_port=args.peer, rank_offset=1,
                                             world_size=2), device=args.server_device, timeout_s=600)
    buf = torch.empty(args.peer_bytes, dtype=torch.uint8, device=group.device)
    tick = torch.zeros(1, dtype=torch.uint8, device=group.device)
    for _ in range(args.repeats):
        for mib in args.bucket_mib:
            with group.streams():
                group.wait(group.broadcast(tick), "the start signal")
            plain_broadcasts(group, buf, mib << 20)
    group.close()


def baseline(args, size: int) -> dict[int, float]:
    """Best time of a plain broadcast of `size` bytes in pieces of each --bucket-mib."""
    port = get_open_port()
    cmd = [sys.executable, __file__, "--peer", str(port), "--peer-bytes", str(size), "--backend", args.backend,
           "--server-device", args.server_device, "--repeats", str(args.repeats),
           "--bucket-mib", *map(str, args.bucket_mib)]
    proc = subprocess.Popen(cmd)
    try:
        group = TransferGroup(args.backend, "127.0.0.1", port, 0, 2,
                              args.device if args.backend == "nccl" else "cpu", timeout_s=600)
        buf = torch.ones(size, dtype=torch.uint8, device=group.device)
        tick = torch.zeros(1, dtype=torch.uint8, device=group.device)
        best: dict[int, float] = {}
        for _ in range(args.repeats):
            for mib in args.bucket_mib:
                with group.streams():
                    group.wait(group.broadcast(tick), "the start signal")
                t0 = time.perf_counter()
                plain_broadcasts(group, buf, mib << 20)
                best[mib] = min(best.get(mib, float("inf")), time.perf_counter() - t0)
        group.close()
        del buf
        if group.device.type == "cuda":
            torch.cuda.empty_cache()
    finally:
        proc.wait(timeout=120)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl", "ipc"])
    p.add_argument("--device", default="cpu", help="the trainer's device (nccl: the GPU its tensors are on)")
    p.add_argument("--server-device", default=None, help="default: cpu for gloo, cuda:0 for nccl")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mib", type=int, nargs="*", default=[512])
    p.add_argument("--checksum-cost", action="store_true", help="also push without bucket checksums")
    p.add_argument("--no-baseline", action="store_true", help="skip the plain broadcast")
    p.add_argument("--lora", action="store_true", help="push a LoRA adapter on every projection instead")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--plan-only", action="store_true", help="only time the host's name resolution and planning")
    p.add_argument("--per-expert", action="store_true",
                   help="an MoE model: push the checkpoint's per-expert names (views of the stacked experts)")
    p.add_argument("--peer", type=int, help=argparse.SUPPRESS)  # the baseline's receiving process
    p.add_argument("--peer-bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.backend == "ipc":  # colocated: both on the one GPU, in the model's own dtype
        args.device, args.dtype = "cuda", "bfloat16" if args.dtype == "float32" else args.dtype
    args.server_device = args.server_device or ("cpu" if args.backend == "gloo" else "cuda:0")
    if args.peer is not None:
        peer(args)
        return
    path = model_dir(args.model)
    args.skip_tokenizer = not os.path.exists(os.path.join(path, "tokenizer_config.json"))
    if host_planning(path, args.repeats) or args.plan_only:
        if args.plan_only:
            return

    from transformers import AutoConfig, AutoModelForCausalLM
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):  # initialised where it lives: an 8B model on the host is slow
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    tensors = [(n, p.detach()) for n, p in model.named_parameters()]
    if args.per_expert:
        tensors = list(unstack_experts(tensors))
    if args.lora:
        from peft import LoraConfig, get_peft_model

        from rlserve.model.peft import peft_adapter_tensors
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                 target_modules=targets, lora_dropout=0.0))
        with torch.no_grad():  # non-zero B: the pushes carry real values
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 1e-3)
        _, tensors = peft_adapter_tensors(model)
    size = sum(t.numel() * t.element_size() for _, t in tensors)
    print(f"{args.model}: {len(tensors)} tensors, {size / 1e9:.3f} GB in {args.dtype}, "
          f"backend {args.backend}, trainer on {args.device}, server on {args.server_device}")
    plain = {}
    if args.backend != "ipc" and not args.no_baseline:
        plain = baseline(args, size)
        for mib, seconds in plain.items():
            print(f"{f'plain broadcast, {mib} MiB pieces':>34}: {seconds:.4f} s = {size / seconds / 1e9:.1f} GB/s "
                  f"(best of {args.repeats})")

    port = get_open_port()
    server = start_server(path, args, port)
    try:
        client = WeightSyncClient(f"http://127.0.0.1:{port}", backend=args.backend,
                                  device=args.device if args.backend == "nccl" else None)
        client.init()
        if args.lora:
            bench_lora(client, model, size, args.repeats)
            return
        if args.backend == "ipc":
            bench_ipc(client, tensors, size, args.repeats)
            return
        runs = [(True, mib, True) for mib in args.bucket_mib] + [(False, 0, True)]
        if args.checksum_cost:
            runs += [(packed, mib, False) for packed, mib, _ in runs]
        for packed, mib, checksum in runs:
            times = [client.push(tensors, packed=packed, packed_buffer_size_bytes=(mib or 512) << 20,
                                 checksum=checksum) for _ in range(args.repeats)]
            best = min(times, key=lambda r: r.send_seconds)
            label = (f"packed, {mib} MiB buckets" if packed else "unpacked") + ("" if checksum else ", no checksum")
            ref = plain.get(mib) if packed else None
            vs = f" = {best.send_seconds / ref:.2f}x the plain broadcast" if ref else ""
            print(f"{label:>34}: send {best.send_seconds:.4f} s ({size / best.send_seconds / 1e9:.1f} GB/s){vs}; "
                  f"update {best.transfer_seconds:.4f} s; pause-push-resume {best.seconds:.4f} s "
                  f"(best of {args.repeats}; first send {times[0].send_seconds:.4f} s)")
    finally:
        server.stop()


def host_planning(path: str, repeats: int) -> bool:
    """An MoE model's host-side cost of an update's names, per layout (False: not MoE)."""
    import statistics

    from transformers import AutoConfig

    from rlserve.model.loader import load_hf_config
    from rlserve.model.registry import model_class
    from rlserve.weight_transfer.info import UpdateInfo
    from rlserve.weight_transfer.server import receiver
    from rlserve.weight_transfer.server.receiver import ExpectedParam, vet
    config = load_hf_config(path)
    with torch.device("meta"):
        model = model_class(config)(config)
        trainer = __import__("transformers").AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    if not any(n.endswith("experts.gate_up_proj") for n, _ in trainer.named_parameters()):
        return False
    expected = {n: ExpectedParam(e.shape, e.required, covers=e.covers) for n, e in model.expected_weights().items()}
    stacked = [(n, p.detach()) for n, p in trainer.named_parameters()]
    layouts = {"stacked (named_parameters)": stacked, "per expert (checkpoint)": list(unstack_experts(stacked))}
    # As in the engine after start-up (engine/core.py): the objects built so far frozen, so
    # the young-generation collections an update's many small tuples trigger stay cheap.
    gc.collect()
    gc.freeze()
    for label, tensors in layouts.items():
        info = dict(names=[n for n, _ in tensors], dtype_names=["bfloat16"] * len(tensors),
                    shapes=[list(t.shape) for _, t in tensors], packed=True)
        times = {"cold": [], "warm": []}
        for _ in range(repeats):
            for kind in times:  # cold: the first update of this list; warm: the same list again
                if kind == "cold":
                    receiver._last_vetted.clear()
                t0 = time.perf_counter()
                vet(UpdateInfo.parse(info), expected)
                copies = len(model.copy_pairs(tensors))
                times[kind].append(time.perf_counter() - t0)
        cold, warm = (statistics.median(times[k]) * 1e3 for k in ("cold", "warm"))
        print(f"{label:>34}: {len(tensors)} names -> {copies} copies; parse + check + plan + resolve "
              f"{cold:.1f} ms the first time, {warm:.1f} ms for the same list again (medians of {repeats})")
    return True


def bench_lora(client: WeightSyncClient, peft_model, size: int, repeats: int) -> None:
    """The first push creates the adapter (ipc: exports and opens every handle); warm pushes
    replace it: the update call as the trainer sees it, and the whole pause-push-resume."""
    import statistics
    first = client.push_lora("bench", peft_model)
    print(f"{'first LoRA push (creates it)':>34}: update {first.transfer_seconds * 1e3:.2f} ms, "
          f"pause-push-resume {first.seconds * 1e3:.2f} ms")
    runs = [client.push_lora("bench", peft_model) for _ in range(repeats)]
    upd, cyc = [r.transfer_seconds for r in runs], [r.seconds for r in runs]
    recv = [r.answers[0]["receive_seconds"] for r in runs]
    apply = [r.answers[0]["apply_seconds"] for r in runs]
    print(f"{'warm LoRA push (update call)':>34}: median {statistics.median(upd) * 1e3:.2f} ms, "
          f"best {min(upd) * 1e3:.2f} ms ({size / 1e6:.1f} MB; {repeats} pushes; server: receive "
          f"{statistics.median(recv) * 1e3:.2f} ms, apply {statistics.median(apply) * 1e3:.2f} ms)")
    print(f"{'pause-push-resume (push_lora)':>34}: median {statistics.median(cyc) * 1e3:.2f} ms, "
          f"best {min(cyc) * 1e3:.2f} ms")
    # What push_lora does before it starts the clock: pick the adapter's tensors out of the model.
    from rlserve.model.peft import peft_adapter_tensors
    prep = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        peft_adapter_tensors(peft_model)
        prep.append(time.perf_counter() - t0)
    print(f"{'reading the PEFT model (trainer)':>34}: median {statistics.median(prep) * 1e3:.2f} ms")
    # The floor under any control call: HTTP to the API server, a call to the engine and back.
    rtt = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        client.session.get(f"{client.urls[0]}/is_paused", timeout=30).raise_for_status()
        rtt.append(time.perf_counter() - t0)
    print(f"{'control round trip (/is_paused)':>34}: median {statistics.median(rtt) * 1e3:.2f} ms")


def bench_ipc(client: WeightSyncClient, tensors, size: int, repeats: int) -> None:
    """First push (exports and opens every handle), then warm pushes: the bare update call
    as the trainer sees it, the server's own split, and the whole pause-push-resume cycle."""
    import statistics

    from rlserve.weight_transfer.trainer.client import post_update
    url, sender = client.urls[0], client.group[0]

    build = []

    def update() -> dict:
        t0 = time.perf_counter()
        info = sender.update_info(tensors)
        build.append(time.perf_counter() - t0)
        return post_update(url, info, session=client.session)

    # A plain device-to-device copy of the same bytes: the floor for a push. Into one
    # buffer the size of the largest tensor (the same traffic; a 30B model has no room for
    # a third copy of itself beside the trainer's and the server's).
    buf = torch.empty(max(t.numel() * t.element_size() for _, t in tensors), dtype=torch.uint8, device="cuda")
    dst = [buf[:t.numel() * t.element_size()].view(t.dtype).view(t.shape) for _, t in tensors]
    copies = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, (_, t) in zip(dst, tensors):
            d.copy_(t)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - t0)
    del dst, buf
    print(f"{'device copy of the same tensors':>34}: {min(copies) * 1e3:.2f} ms "
          f"({size / min(copies) / 1e9:.0f} GB/s)")

    t0 = time.perf_counter()
    first = update()
    first_s = time.perf_counter() - t0
    print(f"{'first push (export + open)':>34}: {first_s * 1e3:.1f} ms (server: receive "
          f"{first['receive_seconds'] * 1e3:.1f} ms, apply {first['apply_seconds'] * 1e3:.1f} ms; "
          f"{sender.exported_last} storages exported)")
    warm, recv, apply, server = [], [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = update()
        warm.append(time.perf_counter() - t0)
        recv.append(r["receive_seconds"])
        apply.append(r["apply_seconds"])
        server.append(r["server_seconds"])
    assert sender.exported_last == 0
    med = statistics.median(warm)
    print(f"{'warm push (update call)':>34}: median {med * 1e3:.2f} ms, best {min(warm) * 1e3:.2f} ms "
          f"= {size / med / 1e9:.0f} GB/s (server: receive {statistics.median(recv) * 1e3:.2f} ms, "
          f"apply {statistics.median(apply) * 1e3:.2f} ms; building update_info "
          f"{statistics.median(build[1:]) * 1e3:.2f} ms; {repeats} pushes)")
    # Where the rest goes: the API server's handler from the parsed request to the engine's
    # answer, and what is left (HTTP, the request's parsing, the trainer's side).
    beyond = statistics.median([s - a - b for s, a, b in zip(server, recv, apply)])
    outside = statistics.median([w - s for w, s in zip(warm, server)])
    print(f"{'of a warm push':>34}: the server's handler {statistics.median(server) * 1e3:.2f} ms (beyond "
          f"receive and apply: {beyond * 1e3:.2f} ms); HTTP, parsing and the trainer {outside * 1e3:.2f} ms")
    cycles = [client.push(tensors).seconds for _ in range(repeats)]
    print(f"{'pause-push-resume (client.push)':>34}: median {statistics.median(cycles) * 1e3:.2f} ms, "
          f"best {min(cycles) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
