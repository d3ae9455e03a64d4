#!/usr/bin/env bash
# One pass on a GPU machine: GPU tests, then the throughput benchmarks. Logs go to $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -x -m gpu tests/test_gpu_engine.py tests/test_triton_ops.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
for model in ${MODELS:-qwen3-0.6b}; do
  timeout 300 python3 benchmarks/throughput.py --model "$model" ${BENCH_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/throughput-$model.log"
done
