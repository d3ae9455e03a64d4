"""Load generator for any OpenAI-compatible server (rlserve, vLLM, SGLang, ...).

Sends a fixed workload of streamed requests with bounded concurrency and reports output
throughput, time to first token (TTFT), inter-token latency (ITL) and end-to-end latency.
The same command against two servers gives numbers that compare side by side.

    rlserve serve --port 8000 &
    python benchmarks/serve.py --base-url http://localhost:8000/v1 \
        --num-requests 64 --concurrency 16 --input-len 256 --output-len 128

ITL is measured between streamed chunks that carry text, as other serving benchmarks do;
a chunk that carries several tokens counts as one gap.

`--weight-checker-calls N` (rlserve, and vLLM with its dev endpoints) sends N concurrent
`POST /weight_checker {"action": "checksum"}` once the load has run `--weight-checker-after`
seconds, and reports how long they took and the longest gap between two tokens of one
stream that overlaps them: how far reading every parameter's checksum stalls generation
(on a large model, the number to watch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

# Common short English words: about one token each for most tokenizers.
_WORDS = ("the of and to in is it that for on was with as by at be this from or have an "
          "are not but had his they you were her which she all their one there we can been "
          "has more if will would so what when out up time about into than them only some "
          "could other new then these two may first any like now my such make over our even "
          "most after also made many before must through back years where much your way "
          "well down should because each just those people how too little state good very "
          "world still own see men work long here get both between life being under never "
          "day same another know while last might great old year off come since against go "
          "came right used take three").split()


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # when each text chunk came (perf_counter)
    error: str = ""


def make_prompt(rng: random.Random, length: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(length))


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _text_of(chunk: dict, chat: bool) -> str:
    if not chunk.get("choices"):
        return ""
    choice = chunk["choices"][0]
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, model: str,
                      prompt: str) -> Result:
    chat = args.endpoint == "chat"
    body: dict = {"model": model, "max_tokens": args.output_len, "stream": True,
                  "temperature": args.temperature, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True  # an extension both rlserve and vLLM understand
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    url = "/chat/completions" if chat else "/completions"
    result = Result(ok=False)
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                now = time.perf_counter()
                if _text_of(chunk, chat):
                    chunks += 1
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                    result.stamps.append(now)
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.output_tokens = usage.get("completion_tokens", 0)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks  # servers without usage in streams
    result.ok = last is not None
    if not result.ok:
        result.error = "no text streamed"
    return result


async def run(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + args.weight_checker_calls + 4)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                                 timeout=args.timeout, limits=limits) as client:
        model = args.model
        if model is None:
            models = (await client.get("/models")).raise_for_status().json()["data"]
            model = models[0]["id"]
        rng = random.Random(args.seed)
        prompts = [make_prompt(rng, args.input_len) for _ in range(args.num_requests)]
        for _ in range(args.warmup):
            await one_request(client, args, model, make_prompt(rng, args.input_len))

        gate = asyncio.Semaphore(args.concurrency)

        async def bounded(prompt: str) -> Result:
            async with gate:
                return await one_request(client, args, model, prompt)

        start = time.perf_counter()
        checker = asyncio.ensure_future(weight_checker_burst(client, args))
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        duration = time.perf_counter() - start
        burst = await checker
    summary = summarize(args, model, results, duration)
    if burst is not None:
        summary.update(burst.summary(results))
    return summary


@dataclass
class Burst:
    """Concurrent /weight_checker calls made while the load ran."""

    start: float
    end: float
    latencies: list[float]
    errors: list[str]

    def summary(self, results: list[Result]) -> dict:
        gaps = [b - a for r in results if r.ok for a, b in zip(r.stamps, r.stamps[1:])
                if b >= self.start and a <= self.end]  # gaps overlapping the burst
        return {"weight_checker_calls": len(self.latencies) + len(self.errors),
                "weight_checker_failed": len(self.errors),
                "weight_checker_max_ms": max(self.latencies, default=float("nan")) * 1e3,
                "weight_checker_window_ms": (self.end - self.start) * 1e3,
                "max_itl_during_checker_ms": max(gaps, default=float("nan")) * 1e3,
                "weight_checker_errors": self.errors[:3]}


async def weight_checker_burst(client: httpx.AsyncClient, args: argparse.Namespace) -> Burst | None:
    if not args.weight_checker_calls:
        return None
    await asyncio.sleep(args.weight_checker_after)
    url = args.base_url.rstrip("/").removesuffix("/v1") + "/weight_checker"
    headers = {"Authorization": f"Bearer {args.admin_key}"} if args.admin_key else None

    async def one() -> float | str:
        t0 = time.perf_counter()
        try:
            r = await client.post(url, json={"action": "checksum"}, headers=headers)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.text[:200]}"
        return time.perf_counter() - t0

    start = time.perf_counter()
    got = await asyncio.gather(*(one() for _ in range(args.weight_checker_calls)))
    return Burst(start, time.perf_counter(), [x for x in got if isinstance(x, float)],
                 [x for x in got if isinstance(x, str)])


def summarize(args: argparse.Namespace, model: str, results: list[Result],
              duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ttfts = [r.ttft * 1e3 for r in ok]
    itls = [x * 1e3 for r in ok for x in r.itls]
    lat = [r.latency * 1e3 for r in ok]
    summary = {
        "base_url": args.base_url, "model": model, "endpoint": args.endpoint,
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "concurrency": args.concurrency, "input_len": args.input_len,
        "output_len": args.output_len, "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
    }
    for name, values in (("ttft_ms", ttfts), ("itl_ms", itls), ("e2e_latency_ms", lat)):
        summary[f"mean_{name}"] = sum(values) / len(values) if values else float("nan")
        for q in (50, 90, 99):
            summary[f"p{q}_{name}"] = percentile(values, q)
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def report(s: dict) -> str:
    lines = [
        f"{'model':<28}{s['model']}",
        f"{'requests ok / failed':<28}{s['completed']} / {s['failed']}",
        f"{'duration':<28}{s['duration_s']:.2f} s",
        f"{'request throughput':<28}{s['request_throughput']:.2f} req/s",
        f"{'output throughput':<28}{s['output_throughput']:.1f} tok/s",
        f"{'total token throughput':<28}{s['total_token_throughput']:.1f} tok/s",
    ]
    for name, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_latency_ms", "E2E")):
        lines.append(f"{label + ' ms mean/p50/p90/p99':<28}" + " / ".join(
            f"{s[k]:.1f}" for k in (f"mean_{name}", f"p50_{name}", f"p90_{name}",
                                    f"p99_{name}")))
    if "weight_checker_calls" in s:
        lines.append(f"{'weight_checker calls':<28}{s['weight_checker_calls']} concurrent "
                     f"({s['weight_checker_failed']} failed), slowest {s['weight_checker_max_ms']:.1f} ms, "
                     f"all within {s['weight_checker_window_ms']:.1f} ms")
        lines.append(f"{'longest ITL meanwhile':<28}{s['max_itl_during_checker_ms']:.1f} ms")
    for e in s.get("errors", []) + s.get("weight_checker_errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://localhost:8000/v1",
                   help="OpenAI base URL of the server (ending in /v1)")
    p.add_argument("--model", default=None, help="model name (default: the first listed)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in words (~tokens)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --output-len tokens")
    p.add_argument("--warmup", type=int, default=1, help="requests sent before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    p.add_argument("--weight-checker-calls", type=int, default=0,
                   help="concurrent POST /weight_checker checksum calls made during the load (0: none)")
    p.add_argument("--weight-checker-after", type=float, default=2.0,
                   help="seconds into the measured load when those calls start")
    p.add_argument("--admin-key", default=None, help="the server's --admin-key, for /weight_checker")
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 1:
        p.error("--num-requests and --concurrency must be at least 1")
    if args.weight_checker_calls < 0 or args.weight_checker_after < 0:
        p.error("--weight-checker-calls and --weight-checker-after must not be negative")

    summary = asyncio.run(run(args))
    print(report(summary))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
