"""Served rollouts against offline generation, in one run (a script, not a test).

The workload is throughput.py's (nano-vllm's: 256 sequences, prompt and output lengths
uniform in [100, 1024], random token ids below 10,000, ignore_eos, dummy weights). It runs
offline through `LLM` (in a child process), then through `rlserve serve` on the same model
and flags: every prompt sent at once as a token-id prompt to /v1/completions, in each mode

    nonstream   whole responses; the server decodes each completion's text
    stream      server-sent events with a chunk per step (or several steps, coalesced)
    notext      whole responses with "detokenize": false: token ids only, nothing decoded

and prints output tok/s for each, its ratio to offline, and the client's TTFT, ITL and
end-to-end percentiles. Presets take a real BPE tokenizer (the demo model's, whose vocabulary
covers the workload's ids) so detokenization costs what it costs.

    python benchmarks/rollout.py --model qwen3-0.6b                  # H200
    python benchmarks/rollout.py --model qwen3-0.6b --repeats 3      # medians of 3 runs each
    python benchmarks/rollout.py --model smollm2                     # its own tokenizer
    python benchmarks/rollout.py --model qwen3-0.6b --data-parallel-size 2 --num-seqs 512   # 2 GPUs
    python benchmarks/rollout.py --model tiny --device cpu --num-seqs 128 --max-len 256 \\
        --max-model-len 1024 --modes nonstream
    python benchmarks/rollout.py --model qwen3-30b-a3b --modes notext --return-routed-experts

--return-routed-experts starts both engines with the capture on: every completion then carries
its `routed_experts` (each served response is checked for them), as vLLM's flag does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rlserve.model.presets import model_dir  # noqa: E402
from serve import percentile  # noqa: E402
from workloads import nano_vllm_draw  # noqa: E402

MODES = ("nonstream", "stream", "notext")


def engine_flags(args) -> dict:
    return dict(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                gpu_memory_utilization=args.gpu_memory_utilization,
                enable_return_routed_experts=args.return_routed_experts)


def offline(args, path: str, queue) -> None:
    """Child process: the offline LLM on the workload; puts output tok/s on `queue`."""
    from rlserve import LLM, SamplingParams
    prompts, out_lens = nano_vllm_draw(args.num_seqs, args.min_len, args.max_len, args.max_out or args.max_len)
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, **engine_flags(args))
    warm, _ = nano_vllm_draw(32, args.min_len, args.max_len, args.max_len, seed=1)
    llm.generate(warm, SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=16,
                                      detokenize=False))
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n,
                             detokenize=False) for n in out_lens]
    rates = []
    for _ in range(args.repeats):
        llm.reset_prefix_cache()  # each run prefills every prompt, as the server's runs do
        sync()
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync()
        elapsed = time.perf_counter() - t
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    queue.put(rates)


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ------------------------------------------------------------------ load generation


def client(base_url: str, items: list, mode: str, temperature: float, routes: bool, ready, go, queue) -> None:
    """Child process: once `go` is set, send `items` ((prompt ids, max_tokens)) all at once."""
    import httpx

    async def one(http: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": temperature}
        if mode == "notext":
            body["detokenize"] = False
        t0 = time.time()
        if mode != "stream":
            r = await http.post("/v1/completions", json=body)
            r.raise_for_status()
            end, answer = time.time(), r.json()
            if routes and not answer["choices"][0].get("routed_experts"):
                raise RuntimeError("a completion came without its routed_experts")
            return {"tokens": answer["usage"]["completion_tokens"], "start": t0, "end": end,
                    "ttft": None, "itl": []}
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        arrivals, usage = [], None
        async with http.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if '"usage"' in line and '"choices":[]' in line:
                    usage = json.loads(line[5:])["usage"]
                elif line != "data: [DONE]":
                    arrivals.append(time.time())
        end = time.time()
        return {"tokens": usage["completion_tokens"], "start": t0, "end": end,
                "ttft": arrivals[0] - t0 if arrivals else None,
                "itl": [b - a for a, b in zip(arrivals, arrivals[1:])]}

    async def main() -> list[dict]:
        limits = httpx.Limits(max_connections=len(items) + 8, max_keepalive_connections=len(items) + 8)
        async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as http:
            ready.put(None)
            await asyncio.to_thread(go.wait)
            return await asyncio.gather(*(one(http, p, n) for p, n in items))

    queue.put(asyncio.run(main()))


def run_mode(url: str, mode: str, prompts, out_lens, args) -> dict:
    ctx = mp.get_context("spawn")
    queue, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    items = list(zip(prompts, out_lens))
    n = max(1, min(args.client_procs, len(items)))
    procs = [ctx.Process(target=client, args=(url, items[i::n], mode, args.temperature, args.return_routed_experts,
                                              ready, go, queue))
             for i in range(n)]
    for p in procs:
        p.start()
    for _ in procs:  # every load generator is up before the first request leaves
        ready.get()
    go.set()
    results = [r for _ in procs for r in queue.get()]
    for p in procs:
        p.join()
    tokens = sum(r["tokens"] for r in results)
    assert tokens == sum(out_lens), (mode, tokens, sum(out_lens))
    duration = max(r["end"] for r in results) - min(r["start"] for r in results)
    ttft = [r["ttft"] * 1e3 for r in results if r["ttft"] is not None]
    itl = [x * 1e3 for r in results for x in r["itl"]]
    e2e = [(r["end"] - r["start"]) * 1e3 for r in results]
    return {"mode": mode, "tok_per_s": tokens / duration, "duration_s": duration,
            "ttft_ms": [percentile(ttft, q) for q in (50, 90, 99)] if ttft else None,
            "itl_ms": [percentile(itl, q) for q in (50, 90, 99)] if itl else None,
            "e2e_ms": [percentile(e2e, q) for q in (50, 90, 99)]}


def serve_and_measure(args, path: str, tokenizer: str, prompts, out_lens) -> list[dict]:
    import httpx

    from rlserve.server.launcher import ServerProcess
    f = engine_flags(args)
    flags = ["--load-format", "dummy", "--served-model-name", "m", "--tokenizer", tokenizer,
             "--device", f["device"], "--dtype", f["dtype"], "--max-model-len", str(f["max_model_len"]),
             "--max-num-seqs", str(f["max_num_seqs"]),
             "--max-num-batched-tokens", str(f["max_num_batched_tokens"]),
             "--gpu-memory-utilization", str(f["gpu_memory_utilization"]),
             # only for /reset_prefix_cache between modes: no group is ever formed
             "--weight-transfer-config", '{"backend": "gloo"}', "--log-level", "warning"]
    if args.api_server_count > 1:
        flags += ["--api-server-count", str(args.api_server_count)]
    if args.return_routed_experts:
        flags += ["--enable-return-routed-experts"]
    if args.data_parallel_size > 1:
        flags += ["--data-parallel-size", str(args.data_parallel_size)]
    warm, _ = nano_vllm_draw(32, args.min_len, args.max_len, args.max_len, seed=1)
    log = os.path.join(args.log_dir, "server.log") if args.log_dir else None
    results = []
    with ServerProcess(path, *flags, log=log, timeout_s=900, die_with_parent=True) as server:
        for mode in args.modes:
            run_mode(server.url, mode, warm, [16] * len(warm), args)  # compiles, connections
        # Repeats go round the modes (a, b, c, a, b, c, ...) so that drift over the run
        # reaches every mode alike.
        for round_ in range(args.repeats):
            for mode in args.modes:
                httpx.post(f"{server.url}/reset_prefix_cache", timeout=60).raise_for_status()
                r = run_mode(server.url, mode, prompts, out_lens, args)
                r["round"] = round_
                print(json.dumps(r), flush=True)
                results.append(r)
    return results


def median_by_mode(results: list[dict]) -> list[dict]:
    """One row per mode: the run with the median throughput (its latencies with it), and
    every run's throughput."""
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in results):
        runs = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["tok_per_s"])
        row = dict(runs[(len(runs) - 1) // 2])
        row["runs_tok_per_s"] = [r["tok_per_s"] for r in results if r["mode"] == mode]
        rows.append(row)
    return rows


def print_profiles(directory: str) -> None:
    import pstats
    for name in sorted(os.listdir(directory)):
        if ".prof" not in name:
            continue
        print(f"---- {name}: by own time")
        stats = pstats.Stats(os.path.join(directory, name))
        stats.sort_stats("tottime").print_stats(25)
        print(f"---- {name}: by cumulative time")
        stats.sort_stats("cumulative").print_stats(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="a preset of throughput.py, smollm2, or a directory")
    p.add_argument("--tokenizer", default=None, help="default: the model's, else the demo model's")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-out", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES),
                   help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--client-procs", type=int, default=4, help="load-generator processes")
    p.add_argument("--api-server-count", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas behind the server (replica i on cuda:i with TP 1); "
                        "offline stays one replica, so the ideal ratio is this number")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs of offline and of each mode (modes in turn); medians are reported")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--log-dir", default=None, help="write the server's log there")
    p.add_argument("--profile-dir", default=None,
                   help="cProfile the engine loop and the API server's event loop (every mode "
                        "of the run together) and print their top functions")
    p.add_argument("--json", default=None, help="also write every figure here")
    p.add_argument("--return-routed-experts", action="store_true",
                   help="capture every token's experts (a mixture of experts), offline and served")
    args = p.parse_args()
    path = model_dir(args.model)
    if args.tokenizer is None:
        has_tokenizer = os.path.exists(os.path.join(path, "tokenizer.json"))
        if has_tokenizer:
            args.tokenizer = path
        else:
            from rlserve.model.demo_model import demo_model_path
            args.tokenizer = demo_model_path()
    prompts, out_lens = nano_vllm_draw(args.num_seqs, args.min_len, args.max_len, args.max_out or args.max_len)
    print(f"workload: {len(prompts)} seqs, {sum(map(len, prompts))} prompt tokens, {sum(out_lens)} "
          f"output tokens; model {args.model} on {args.device}; tokenizer {args.tokenizer}", flush=True)
    report = {"model": args.model, "device": args.device, "num_seqs": args.num_seqs,
              "data_parallel_size": args.data_parallel_size}
    if not args.skip_offline:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=offline, args=(args, path, queue))
        child.start()
        runs = queue.get()
        child.join()
        report["offline_runs_tok_per_s"] = runs
        report["offline_tok_per_s"] = sorted(runs)[(len(runs) - 1) // 2]
        print(f"offline: {report['offline_tok_per_s']:,.0f} output tok/s (runs: "
              f"{', '.join(f'{r:,.0f}' for r in runs)})", flush=True)
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
        os.environ["RLSERVE_ENGINE_PROFILE"] = os.path.join(args.profile_dir, "engine.prof")
        os.environ["RLSERVE_API_PROFILE"] = os.path.join(args.profile_dir, "api.prof")
    report["served"] = serve_and_measure(args, path, args.tokenizer, prompts, out_lens)
    if args.profile_dir:
        print_profiles(args.profile_dir)
    base = report.get("offline_tok_per_s")
    report["served_median"] = median_by_mode(report["served"])
    for r in report["served_median"]:
        ratio = f" = {r['tok_per_s'] / base:.0%} of offline" if base else ""
        if base and args.data_parallel_size > 1:
            ratio += (f" ({r['tok_per_s'] / base / args.data_parallel_size:.0%} of "
                      f"{args.data_parallel_size} x one replica offline)")
        lat = "".join(f"; {k} p50/p90/p99 " + "/".join(f"{x:.1f}" for x in r[k])
                      for k in ("ttft_ms", "itl_ms", "e2e_ms") if r[k])
        runs = "" if len(r["runs_tok_per_s"]) == 1 else \
            f" (median of {', '.join(f'{x:,.0f}' for x in r['runs_tok_per_s'])})"
        print(f"served {r['mode']:<10} {r['tok_per_s']:>9,.0f} output tok/s{runs}{ratio}{lat}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
