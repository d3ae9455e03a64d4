"""Offline throughput on nano-vllm's published workload (a script, not a test).

256 sequences; prompt and output lengths uniform in [100, 1024]; random token ids below
10000 from `random.seed(0)`; ignore_eos; dummy weights. Prints output tokens/s.

    python benchmarks/throughput.py --model qwen3-0.6b                 # GPU, bf16
    python benchmarks/throughput.py --model qwen3-0.6b --runs 3        # median of three, one engine
    python benchmarks/throughput.py --model qwen3-0.6b --transformers  # side by side
    python benchmarks/throughput.py --model smollm2 --device cpu --num-seqs 8 --max-len 128
    python benchmarks/throughput.py --model qwen3-0.6b --device-profile /tmp/t.json  # idle per step

--model takes a preset (qwen3-0.6b, llama-3.1-8b, qwen3-8b, qwen3-30b-a3b, tiny, moe-tiny,
qwen3.5-0.8b, qwen3-next-80b-a3b-12l, qwen3.5-tiny, qwen3-next-tiny, smollm2) or an HF
directory. For a mixture of experts the bound counts the experts each decode step touches,
from the routing the model gives the warm-up's prompt tokens.

--loras N: the same workload on the base model, then with N random rank-`--lora-rank` adapters
on every projection, request i on adapter i mod N (all N in every batch), and the ratio:

    python benchmarks/throughput.py --model qwen3-8b --loras 4
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import statistics
import time

import torch

from bounds import bound_tokens_per_s, roofline_tokens_per_s, shape
from rlserve.model.presets import PRESETS, model_dir  # noqa: F401  (the benchmarks' presets)


def workload(num_seqs: int, min_len: int, max_len: int, max_out: int, seed: int = 0):
    """nano-vllm's bench.py workload, drawn in the same order from the same seed."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_len, max_len))]
               for _ in range(num_seqs)]
    out_lens = [random.randint(min_len, max_out) for _ in range(num_seqs)]
    return prompts, out_lens


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


class RoutingSample:
    """Which experts the model's routers pick for the warm-up's prompt tokens: from each
    expert's share of them, the experts a decode step of B sequences touches, on average
    over the layers (sum over experts of 1 - (1 - share)^B, tokens routed independently)."""

    def __init__(self, llm) -> None:
        from rlserve.model.moe import SparseMoeBlock
        blocks = [m for m in llm.engine.executor.driver.model.modules() if isinstance(m, SparseMoeBlock)]
        self.counts = [None] * len(blocks)
        self.tokens = 0
        self.num_experts = blocks[0].gate.out_features if blocks else 0
        self.top_k = blocks[0].top_k if blocks else 0
        self.hooks = [b.gate.register_forward_hook(self._hook(i, b.top_k)) for i, b in enumerate(blocks)]

    def _hook(self, layer: int, k: int):
        def record(module, inputs, logits) -> None:
            ids = torch.topk(logits, k, dim=-1).indices.flatten()
            counts = torch.bincount(ids, minlength=logits.shape[-1]).cpu()
            self.counts[layer] = counts if self.counts[layer] is None else self.counts[layer] + counts
            if layer == 0:
                self.tokens += logits.shape[0]
        return record

    def stop(self) -> None:
        for h in self.hooks:
            h.remove()

    def touched(self, batch: int) -> float:
        layers = [c.double() / self.tokens for c in self.counts if c is not None]
        return sum(float((1 - (1 - share) ** batch).sum()) for share in layers) / len(layers)

    def report(self) -> None:
        e, k = self.num_experts, self.top_k
        sizes = [1, 8, 32, 64, 128, 256]
        print(f"routing of {self.tokens} warm-up tokens: experts a decode step touches per layer, of {e}: " +
              ", ".join(f"{b} seqs {self.touched(b):.1f} (uniform {e * (1 - (1 - k / e) ** b):.1f})" for b in sizes))


def write_random_adapters(path: str, num: int, rank: int, root: str) -> list[str]:
    """`num` PEFT adapter directories with random weights on every projection of `path`'s
    architecture (Llama / Qwen names)."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(path)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}
    dirs = []
    for i in range(num):
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for module, (fan_in, fan_out) in shapes.items():
                name = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
                tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 1e-3
        d = os.path.join(root, f"adapter{i}")
        os.makedirs(d, exist_ok=True)
        save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": [m.split(".")[1] for m in shapes]}, f)
        dirs.append(d)
    return dirs


def in_own_process(fn, *args):
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def run_rlserve(args, path, prompts, out_lens, profiler=None, loras: list[str] | None = None) -> float:
    """Output tokens/s of the timed run; `profiler` (a torch.profiler context) covers only it.
    `loras`: PEFT adapter directories, request i on adapter i mod len(loras)."""
    from rlserve import LLM, SamplingParams
    lora_kw = {}
    if loras:
        lora_kw = dict(enable_lora=True, max_loras=len(loras), max_lora_rank=args.lora_rank,
                       lora_modules={f"lora{i}": d for i, d in enumerate(loras)})
    llm = LLM(path, device=args.device, dtype=args.dtype, load_format="dummy",
              skip_tokenizer_init=True, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization,
              kv_cache_dtype=args.kv_cache_dtype,
              **({"block_size": args.block_size} if args.block_size else {}), **lora_kw)
    names = [f"lora{i % len(loras)}" for i in range(len(prompts))] if loras else None
    routing = RoutingSample(llm)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n,
                             detokenize=False) for n in out_lens]
    # Warm-up on a slice of the workload's shapes: Triton compiles a kernel variant the first
    # time it meets one (prefill tile sizes, split counts), which is start-up cost, not throughput.
    llm.generate(prompts[:32], SamplingParams(temperature=args.temperature, ignore_eos=True,
                                              max_tokens=16, detokenize=False),
                 lora_request=names[:32] if names else None)
    routing.stop()
    if routing.hooks:
        routing.report()
        args.touched = routing.touched
    rates = []
    for _ in range(1 if profiler else args.runs):
        llm.reset_prefix_cache()  # the timed run must not find these prompts cached
        sync()
        with profiler or contextlib.nullcontext(), triton_variants_met() as met:
            t = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=names)
            sync()
            elapsed = time.perf_counter() - t
        if met:  # each one compiled (or at best loaded from Triton's disk cache) inside the timed run
            print(f"Triton kernel variants first met in the timed run: {len(met)}: {sorted(set(met))}")
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        assert produced == sum(out_lens), (produced, sum(out_lens))
        stats = llm.engine.stats()
        what = f" with {len(loras)} LoRA adapters mixed" if loras else ""
        print(f"rlserve{what}: {produced} tokens in {elapsed:.2f}s = {produced / elapsed:,.0f} output tok/s "
              f"(preemptions {stats.preemptions_total}, KV capacity {stats.kv_cache_capacity_tokens} tokens)",
              flush=True)
        rates.append(produced / elapsed)
    if len(rates) > 1:
        print(f"median of {len(rates)} runs: {statistics.median(rates):,.0f} output tok/s")
    llm.shutdown()  # frees the KV cache and graphs: a second run in this process needs them
    del llm
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return statistics.median(rates)


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024, help="largest prompt")
    p.add_argument("--max-out", type=int, default=None, help="largest output (default: --max-len)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block (default: the engine's)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, or fp8: the engine's option")
    p.add_argument("--enforce-eager", action="store_true")
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
    args = p.parse_args()
    path = model_dir(args.model)
    prompts, out_lens = workload(args.num_seqs, args.min_len, args.max_len, args.max_out or args.max_len)
    print(f"workload: {len(prompts)} seqs, {sum(map(len, prompts))} prompt tokens, "
          f"{sum(out_lens)} output tokens; model {args.model} on {args.device}")
    if args.device_profile and not args.device.startswith("cuda"):
        p.error("--device-profile records CUDA kernels: it needs --device cuda")
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
            ours = run_rlserve(args, path, prompts, out_lens, profiler=prof)
        finally:
            gc.enable()
        prof.export_chrome_trace(args.device_profile)
        intervals = summarize(args.device_profile)
        idle_per_step(intervals)
        longest_gaps(intervals, 30)
        if args.model in PRESETS:
            attention_by_batch(intervals, PRESETS[args.model], prompts, out_lens)
    elif args.profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prof = profile(activities=acts)
        ours = run_rlserve(args, path, prompts, out_lens, profiler=prof)
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
        ours = in_own_process(run_rlserve, args, path, prompts, out_lens)
    else:
        ours = run_rlserve(args, path, prompts, out_lens)
    if args.model in PRESETS and args.device.startswith("cuda"):
        touched = getattr(args, "touched", None)  # an MoE model: the experts a step reads
        bound = bound_tokens_per_s(PRESETS[args.model], prompts, out_lens, touched=touched)
        print(f"byte-counting bound (H200, 4.8 TB/s): {bound:,.0f} tok/s; rlserve at {ours / bound:.0%}")
        roof = roofline_tokens_per_s(PRESETS[args.model], prompts, out_lens, touched=touched)
        print(f"roofline with the prefill's FLOPs (4.8 TB/s, 989 TFLOP/s): {roof:,.0f} tok/s; "
              f"rlserve at {ours / roof:.0%}")
        if args.kv_cache_dtype.startswith("fp8"):
            fp8 = bound_tokens_per_s(PRESETS[args.model], prompts, out_lens, kv_fp8=True, touched=touched)
            print(f"the same bound for an fp8 cache: {fp8:,.0f} tok/s; rlserve at {ours / fp8:.0%}")
    if args.loras:
        import tempfile
        with tempfile.TemporaryDirectory() as root:
            loras = write_random_adapters(path, args.loras, args.lora_rank, root)
            with_loras = in_own_process(run_rlserve, args, path, prompts, out_lens, None, loras)
        print(f"{args.loras} LoRA adapters mixed: {with_loras / ours:.0%} of the base model's throughput")
    if args.transformers:
        theirs = run_transformers(args, path, prompts, out_lens)
        print(f"ratio rlserve / transformers: {ours / theirs:.1f}x")


if __name__ == "__main__":
    main()
