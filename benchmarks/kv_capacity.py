"""The KV cache a model gets on this GPU, and the measured split of the device that sized it
(rlserve/worker/memory_profile.py): start the engine as the offline throughput runs do
(dummy weights, bf16, max_model_len 4096, 256 sequences, 16,384 tokens a step) and print.

    python benchmarks/kv_capacity.py --model qwen3-30b-a3b qwen3-0.6b llama-3.1-8b

Each model in a process of its own: a process's device memory is only surely back when it
ends, and the next engine sizes its cache from what is free.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

_CHILD = """
import json, sys, time
import torch
from rlserve import LLM
from rlserve.model.presets import PRESETS, model_dir
name, util, eager = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"
path = model_dir(name) if name in PRESETS else name
t = time.perf_counter()
llm = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=4096,
          max_num_seqs=256, max_num_batched_tokens=16384, gpu_memory_utilization=util, enforce_eager=eager)
startup = time.perf_counter() - t
m = llm.engine.memory
print("RESULT", json.dumps(dict(model=name, kv_tokens=llm.engine.kv.capacity_tokens, startup_s=round(startup, 1),
      device=torch.cuda.get_device_name(), **({f: getattr(m, f) for f in m.__struct_fields__} if m else {}))))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["qwen3-30b-a3b", "qwen3-0.6b", "llama-3.1-8b"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--json", default=None, metavar="PATH", help="append each result as a JSON line")
    args = p.parse_args()
    for name in args.model:
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _CHILD, name, str(args.gpu_memory_utilization),
                               "1" if args.enforce_eager else "0"], capture_output=True, text=True)
        line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: failed after {time.perf_counter() - t:.0f}s\n{proc.stderr[-3000:]}")
            continue
        r = json.loads(line.removeprefix("RESULT "))
        gib = {k: r[k] / (1 << 30) for k in ("weights", "activations", "cuda_graphs", "non_torch", "kv_cache")
               if k in r}
        print(f"{name} on {r['device']}: KV cache {r['kv_tokens']:,} tokens; "
              + ", ".join(f"{k} {v:.2f} GiB" for k, v in gib.items()) + f"; start-up {r['startup_s']}s")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
