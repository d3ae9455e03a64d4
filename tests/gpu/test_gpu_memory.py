"""The KV cache sized from a measured profile, on the GPU: after sizing, the engine runs the
worst step it can admit with the real cache in place and stays inside its share of the
device. Skipped without a GPU.

The engine runs in a process of its own, so that no other test's tensors count as its
memory and its peak is its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

UTILIZATION = 0.3

_SCRIPT = f"""
import json, random
import msgspec, torch
from rlserve import LLM, SamplingParams
from rlserve.model.presets import model_dir
from rlserve.worker import memory_profile as mp

llm = LLM(model_dir("qwen3-0.6b"), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
          max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization={UTILIZATION})
engine = llm.engine
runner = engine.executor.local_runner
torch.cuda.reset_peak_memory_stats()
random.seed(0)
# Real traffic first: long prompts with prompt logprobs, then a full decode batch (graphs)
# sampling with top-p, penalties and logprobs.
prompts = [[random.randrange(1000, 100000) for _ in range(random.randint(500, 3000))] for _ in range(300)]
params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=1.0, top_p=0.9, top_k=50,
                        repetition_penalty=1.1, logprobs=20, detokenize=False)
llm.generate(prompts[:8], SamplingParams(max_tokens=1, prompt_logprobs=20, detokenize=False), use_tqdm=False)
llm.generate(prompts, params, use_tqdm=False)
# Then the profile's worst steps, with the real cache allocated beside them.
mp.run_worst_steps(runner, mp.WorstSteps(8192, 256, 4096, 20, capture_graphs=False))
torch.cuda.synchronize()
print("RESULT", json.dumps(dict(
    total=torch.cuda.mem_get_info()[1], peak_allocated=torch.cuda.max_memory_allocated(),
    peak_reserved=torch.cuda.max_memory_reserved(),
    kv_tokens=engine.kv.capacity_tokens, graphs=runner.graphs is not None,
    preemptions=engine.scheduler.num_preemptions,
    memory=msgspec.to_builtins(engine.memory))))
"""


def test_worst_step_after_sizing_stays_inside_the_share(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result["graphs"] and result["memory"] is not None
    total, weights, activations, graphs, non_torch, kv = (result["memory"][i] for i in (0, 2, 3, 4, 5, 6))
    assert total == result["total"]
    # The parts add up to the share (what was free capped nothing on an idle card)...
    share = int(total * UTILIZATION)
    assert weights + activations + graphs + non_torch + kv <= share
    # ...and the tensors never needed more than the share, the worst step included. (The
    # allocator's cache may reserve a little beyond it; it gives cached blocks back and
    # retries before an allocation fails.)
    assert result["peak_allocated"] <= share, {k: v for k, v in result.items() if k != "memory"} | dict(
        weights=weights, activations=activations, graphs=graphs, non_torch=non_torch, kv=kv)
    (tmp_path / "memory.json").write_text(json.dumps(result))
