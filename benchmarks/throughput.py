"""Offline throughput on nano-vllm's published workload (a script, not a test).

256 sequences; prompt and output lengths uniform in [100, 1024]; random token ids below
10000 from `random.seed(0)`; ignore_eos; dummy weights. Prints output tokens/s, the KV
cache's capacity in tokens, the run's preemptions, the engine's measured device memory
split (where it has one) and, on a GPU, the bounds of the card it runs on (bounds.py).

    python benchmarks/throughput.py --model qwen3-0.6b                 # GPU, bf16
    python benchmarks/throughput.py --model qwen3-0.6b --runs 3        # median of three, one engine
    python benchmarks/throughput.py --model qwen3-0.6b --transformers  # side by side
    python benchmarks/throughput.py --model smollm2 --device cpu --num-seqs 8 --max-len 128
    python benchmarks/throughput.py --model qwen3-0.6b --device-profile /tmp/t.json  # idle per step

--model takes a preset (qwen3-0.6b, llama-3.1-8b, qwen3-8b, qwen3-30b-a3b, tiny, moe-tiny,
qwen3.5-0.8b, qwen3-next-80b-a3b-12l, qwen3.5-tiny, qwen3-next-tiny, smollm2) or an HF
directory. For a mixture of experts the bound counts the experts each decode step touches,
from the routing the model gives the warm-up's prompt tokens.

--workload grpo: a GRPO-shaped rollout instead (workloads.py): 128 prompts x n=8 samples,
prompts U[200, 1000], each prompt's output length from a long tail (mean 400, cut at 2000),
T=1.0, the sampled token's logprob; --num-prompts, --n, --max-len, --max-out shrink it:

    python benchmarks/throughput.py --model qwen3-30b-a3b --workload grpo
    python benchmarks/throughput.py --model smollm2 --device cpu --workload grpo --num-prompts 4 --n 2 \
        --max-len 64 --max-out 32

--loras N: the same workload on the base model, then with N random rank-`--lora-rank` adapters
on every projection, request i on adapter i mod N (all N in every batch), and the ratio:

    python benchmarks/throughput.py --model qwen3-8b --loras 4
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

import torch

from bounds import add_peak_args, bound_tokens_per_s, device_peak, roofline_tokens_per_s, shape, unknown_card
from expert_routing import RoutingSample
from random_adapters import write_random_adapters
from rlserve.model.presets import PRESETS, model_dir  # noqa: F401  (the benchmarks' presets)
from workloads import Workload, grpo, nano_vllm


def attention_by_batch(intervals, cfg: dict, prompts, out_lens) -> None:
    """From a device profile: decode attention's read rate, and the rest of each step's
    busy time, by the number of sequences still decoding. The steps map onto the workload when
    every prompt was prefilled before the first decode step and nothing was preempted
    (throughput.py's default workload): decode step j reads each live sequence's prompt
    and j + 1 generated tokens."""
    from trace_summary import kernel_time_per_step
    steps = kernel_time_per_step(intervals, "_paged_attn")
    if len(steps) != max(out_lens) - 1:
        print(f"attention by batch size: {len(steps)} graph steps where the workload has "
              f"{max(out_lens) - 1} decode steps; the steps do not map onto it")
        return
    kv_per_token = shape(cfg).kv_per_token
    lens = list(map(len, prompts))
    buckets = [(192, 256), (128, 191), (96, 127), (64, 95), (32, 63), (16, 31), (1, 15)]
    sums = {b: [0, 0.0, 0.0, 0.0] for b in buckets}  # steps, attention us, KV bytes, rest us
    for j, (attn, other) in enumerate(steps):
        live = [p + j + 1 for p, o in zip(lens, out_lens) if o > j + 1]
        for lo, hi in buckets:
            if lo <= len(live) <= hi:
                acc = sums[(lo, hi)]
                acc[0] += 1
                acc[1] += attn
                acc[2] += kv_per_token * sum(live)
                acc[3] += other
    print("decode steps by live sequences: attention's read rate, the rest of a step's busy time")
    for (lo, hi), (n, attn, kv, other) in sums.items():
        if n:
            print(f"  {lo:3d}-{hi:3d}: {n:4d} steps, attention {attn / 1e6:.3f} s at {kv / attn / 1e6:.2f} TB/s, "
                  f"the rest {other / 1e6:.3f} s ({other / n:.0f} us a step)")


def in_own_process(fn, *args):
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def run_rlserve(args, path, wl: Workload, profiler=None, loras: list[str] | None = None) -> float:
    """Output tokens/s of the timed run; `profiler` (a torch.profiler context) covers only it.
    `loras`: PEFT adapter directories, prompt i on adapter i mod len(loras)."""
    from rlserve import LLM
    lora_kw = {}
    if loras:
        lora_kw = dict(enable_lora=True, max_loras=len(loras), max_lora_rank=args.lora_rank,
                       lora_modules={f"lora{i}": d for i, d in enumerate(loras)})
    llm = LLM(path, device=args.device, dtype=args.dtype, load_format="dummy",
              skip_tokenizer_init=True, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization,
              batch_invariant=args.batch_invariant, kv_cache_dtype=args.kv_cache_dtype,
              enable_return_routed_experts=args.return_routed_experts,
              tensor_parallel_size=args.tensor_parallel_size, async_scheduling=args.async_scheduling,
              **({"block_size": args.block_size} if args.block_size else {}), **lora_kw)
    print_memory(llm.engine)
    names = [f"lora{i % len(loras)}" for i in range(len(wl.prompts))] if loras else None
    routing = RoutingSample(llm)
    params = wl.params()
    # Warm-up on a slice of the workload's shapes: Triton compiles a kernel variant the first
    # time it meets one (prefill tile sizes, split counts), which is start-up cost, not throughput.
    warm_prompts, warm_params = wl.warm_up()
    llm.generate(warm_prompts, warm_params, lora_request=names[:len(warm_prompts)] if names else None)
    routing.stop()
    if routing.hooks:
        routing.report()
        args.touched = routing.touched
    rates = []
    for _ in range(1 if profiler else args.runs):
        llm.reset_prefix_cache()  # the timed run must not find these prompts cached
        preempted = llm.engine.stats().preemptions_total
        sync()
        with profiler or contextlib.nullcontext(), triton_variants_met() as met:
            t = time.perf_counter()
            outs = llm.generate(wl.prompts, params, lora_request=names)
            sync()
            elapsed = time.perf_counter() - t
        if met:  # each one compiled (or at best loaded from Triton's disk cache) inside the timed run
            print(f"Triton kernel variants first met in the timed run: {len(met)}: {sorted(set(met))}")
        samples = [c for o in outs for c in o.outputs]
        produced = sum(len(c.token_ids) for c in samples)
        assert produced == wl.output_tokens, (produced, wl.output_tokens)
        if wl.logprobs is not None:  # one logprob entry per sampled token
            assert sum(len(c.logprobs or ()) for c in samples) == produced
        stats = llm.engine.stats()
        what = f" with {len(loras)} LoRA adapters mixed" if loras else ""
        print(f"rlserve{what}: {produced} tokens in {elapsed:.2f}s = {produced / elapsed:,.0f} output tok/s "
              f"(preemptions in this run {stats.preemptions_total - preempted}, "
              f"KV capacity {stats.kv_cache_capacity_tokens} tokens)", flush=True)
        rates.append(produced / elapsed)
    if len(rates) > 1:
        print(f"median of {len(rates)} runs: {statistics.median(rates):,.0f} output tok/s")
    llm.shutdown()  # frees the KV cache and graphs: a second run in this process needs them
    del llm
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return statistics.median(rates)


def print_memory(engine) -> None:
    """The KV cache's capacity and, where the engine measured it at start (its `memory`, a
    rlserve.memory.MemoryProfile), how the device's memory was split."""
    capacity = engine.kv.capacity_tokens
    memory = getattr(engine, "memory", None)
    if memory is None:
        print(f"KV cache: {capacity} tokens (no measured memory split on this engine)")
        return
    describe = getattr(memory, "describe", None)
    print(f"device memory: {describe(capacity) if describe else memory}")


@contextlib.contextmanager
def triton_variants_met():
    """Names of the Triton kernels that met a new variant (a compile) inside the block."""
    met: list[str] = []
    try:
        from triton import knobs
    except ImportError:  # no Triton (or one without knobs): nothing to watch
        yield met
        return

    def hook(*, fn, **_):
        met.append(fn.name)

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield met
    finally:
        knobs.runtime.jit_post_compile_hook = None


def run_transformers(args, path, prompts, out_lens) -> float:
    """transformers' own continuous batching (generate_batch) on the same workload."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    cfg = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,
                                             attn_implementation="paged|sdpa").to(args.device).eval()
    n = args.transformers_num_seqs or len(prompts)
    prompts, out_lens = prompts[:n], out_lens[:n]
    # generate_batch takes one max_new_tokens for all requests: group by length.
    groups: dict[int, list] = {}
    for p, o in zip(prompts, out_lens):
        groups.setdefault(o, []).append(p)
    gen = GenerationConfig(max_new_tokens=max(out_lens), do_sample=args.temperature > 0,
                           temperature=args.temperature or 1.0, eos_token_id=-1, pad_token_id=0,
                           use_cuda_graph=False)
    sync()
    t = time.perf_counter()
    produced = 0
    if len(set(out_lens)) == 1:
        results = model.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
        produced = sum(len(r.generated_tokens) for r in results.values())
    else:
        # One manager, every request with its own budget.
        manager = model.init_continuous_batching(generation_config=gen)
        manager.start()
        for i, (p, o) in enumerate(zip(prompts, out_lens)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=o)
        for _ in range(len(prompts)):
            r = manager.get_result(timeout=600)
            produced += len(r.generated_tokens)
        manager.stop(block=True)
    sync()
    elapsed = time.perf_counter() - t
    print(f"transformers continuous batching ({n} seqs): {produced} tokens in {elapsed:.2f}s = "
          f"{produced / elapsed:,.0f} output tok/s")
    return produced / elapsed


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workload", choices=("nano-vllm", "grpo"), default="nano-vllm")
    p.add_argument("--num-seqs", type=int, default=256, help="nano-vllm: sequences")
    p.add_argument("--num-prompts", type=int, default=128, help="grpo: prompts")
    p.add_argument("--n", type=int, default=8, help="grpo: samples per prompt")
    p.add_argument("--min-len", type=int, default=None,
                   help="smallest prompt (default: nano-vllm 100, grpo 200, or --max-len if smaller)")
    p.add_argument("--max-len", type=int, default=None, help="largest prompt (default: nano-vllm 1024, grpo 1000)")
    p.add_argument("--max-out", type=int, default=None,
                   help="largest output (default: nano-vllm --max-len, grpo 2000)")
    p.add_argument("--mean-out", type=float, default=400, help="grpo: the long tail's mean output length")
    p.add_argument("--temperature", type=float, default=None, help="default: nano-vllm 0.6, grpo 1.0")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block (default: the engine's)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, or fp8: the engine's option")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--async-scheduling", type=lambda v: {"on": True, "off": False}[v], default=None,
                   metavar="on|off", help="overlapped scheduling (default: the engine's, on for one CUDA rank)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the engine's batch-invariant mode (docs/on-policy.md)")
    p.add_argument("--return-routed-experts", action="store_true",
                   help="MoE models: capture and return every token's experts (routing replay), to time "
                        "capture on against off")
    p.add_argument("--runs", type=int, default=1,
                   help="timed runs on one engine (each after a prefix-cache reset); the median is "
                        "what the bounds are compared with")
    p.add_argument("--profile", action="store_true",
                   help="profile the rlserve run with torch.profiler and print the top ops")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="with --profile: write the chrome trace to PATH and summarise the device timeline")
    p.add_argument("--device-profile", default=None, metavar="PATH",
                   help="record only the device's kernels (no host-side ops, so the host runs at "
                        "nearly full speed), write the trace to PATH, and summarise the device's "
                        "busy share and its idle time per step")
    p.add_argument("--loras", type=int, default=0,
                   help="also run with this many random LoRA adapters mixed in every batch")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--transformers", action="store_true", help="also run transformers' continuous batching")
    p.add_argument("--transformers-num-seqs", type=int, default=None,
                   help="run transformers on the first N sequences only (it is slow)")
    add_peak_args(p)
    args = p.parse_args()
    if args.device_profile and not args.device.startswith("cuda"):
        p.error("--device-profile records CUDA kernels: it needs --device cuda")
    if args.transformers and args.workload != "nano-vllm":
        p.error("--transformers runs nano-vllm's workload only")
    return args


def make_workload(args) -> Workload:
    grpo_shaped = args.workload == "grpo"
    max_len = args.max_len or (1000 if grpo_shaped else 1024)
    # A --max-len below the default smallest prompt lowers that too.
    min_len = args.min_len or min(max_len, 200 if grpo_shaped else 100)
    if grpo_shaped:
        wl = grpo(args.num_prompts, args.n, min_len, max_len, args.mean_out, args.max_out or 2000,
                  1.0 if args.temperature is None else args.temperature)
    else:
        wl = nano_vllm(args.num_seqs, min_len, max_len, args.max_out or max_len,
                       0.6 if args.temperature is None else args.temperature)
    args.temperature = wl.temperature  # transformers' run samples as the workload does
    return wl


def print_bounds(args, wl: Workload, ours: float) -> None:
    """The bytes-moved bound and the roofline on the card this runs on, and rlserve's share."""
    cfg, touched = PRESETS[args.model], getattr(args, "touched", None)  # MoE: the experts a step reads
    peak = device_peak(args.hbm_tb_s, args.tflops)
    if peak.hbm_bytes_per_s is None:
        print(unknown_card(peak, "--hbm-tb-s and --tflops"))
        return
    work = dict(prompts=wl.prompts, out_lens=wl.out_lens, n=wl.n, touched=touched)
    bound = bound_tokens_per_s(cfg, hbm_bytes_per_s=peak.hbm_bytes_per_s, **work)
    print(f"byte-counting bound ({peak.describe()}): {bound:,.0f} tok/s; rlserve at {ours / bound:.0%}")
    if peak.flops_per_s is None:
        print(unknown_card(peak, "--tflops") + " (the roofline)")
    else:
        roof = roofline_tokens_per_s(cfg, hbm_bytes_per_s=peak.hbm_bytes_per_s, flops_per_s=peak.flops_per_s,
                                     **work)
        print(f"roofline with the prefill's FLOPs ({peak.describe(flops=True)}): {roof:,.0f} tok/s; "
              f"rlserve at {ours / roof:.0%}")
    if args.kv_cache_dtype.startswith("fp8"):
        fp8 = bound_tokens_per_s(cfg, hbm_bytes_per_s=peak.hbm_bytes_per_s, kv_fp8=True, **work)
        print(f"the same bound for an fp8 cache: {fp8:,.0f} tok/s; rlserve at {ours / fp8:.0%}")


def main() -> None:
    args = parse_args()
    path = model_dir(args.model)
    wl = make_workload(args)
    print(f"workload {wl.describe()}; model {args.model} on {args.device}")
    if args.device_profile:
        from torch.profiler import ProfilerActivity, profile

        from trace_summary import idle_per_step, longest_gaps, summarize
        prof = profile(activities=[ProfilerActivity.CUDA])
        # The profiler allocates Python objects for every kernel it records; with the
        # collector on they trigger a collection of a few ms every ~70 steps (an unprofiled
        # run has a couple of dozen short ones), which stalls the host and shows as device
        # idle time that is not the engine's. The engine's explicit collections still run.
        gc.disable()
        try:
            ours = run_rlserve(args, path, wl, profiler=prof)
        finally:
            gc.enable()
        prof.export_chrome_trace(args.device_profile)
        intervals = summarize(args.device_profile)
        idle_per_step(intervals)
        longest_gaps(intervals, 30)
        if args.model in PRESETS and wl.n == 1:
            attention_by_batch(intervals, PRESETS[args.model], wl.prompts, wl.out_lens)
    elif args.profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prof = profile(activities=acts)
        ours = run_rlserve(args, path, wl, profiler=prof)
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        if args.trace:
            from trace_summary import summarize
            prof.export_chrome_trace(args.trace)
            summarize(args.trace)
    elif args.loras:
        # Each run in a process of its own: a run's device memory is only surely back when
        # its process ends, and the next run sizes its KV cache from what is free.
        ours = in_own_process(run_rlserve, args, path, wl)
    else:
        ours = run_rlserve(args, path, wl)
    if args.model in PRESETS and args.device.startswith("cuda"):
        print_bounds(args, wl, ours)
    if args.loras:
        import tempfile
        with tempfile.TemporaryDirectory() as root:
            loras = write_random_adapters(path, args.loras, args.lora_rank, root)
            with_loras = in_own_process(run_rlserve, args, path, wl, None, loras)
        print(f"{args.loras} LoRA adapters mixed: {with_loras / ours:.0%} of the base model's throughput")
    if args.transformers:
        theirs = run_transformers(args, path, wl.prompts, wl.out_lens)
        print(f"ratio rlserve / transformers: {ours / theirs:.1f}x")


if __name__ == "__main__":
    main()
