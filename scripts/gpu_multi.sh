#!/usr/bin/env bash
# The two-GPU run, executed ON the 2xH200 machine from the repository root, in one device
# call (device kind nvidia-h200-x2, carry [".gpu"]; `make gpu-test` prepares .gpu/ here):
#
#     bash scripts/gpu_multi.sh            # about 4-6 minutes
#
# 1. tests/gpu/test_multi_gpu.py: the real server with one worker per GPU; kept layers land
#    on both GPUs (listing + cudaMemGetInfo), RunMoE runs on each, a whole-checkpoint
#    conversion spreads over both and writes what one GPU writes.
# 2. bench/multi_gpu_bench.py: whole-checkpoint conversion throughput (8 Mixtral-8x7B-shaped
#    layers, GPTQ -> TRITON and MARLIN) with 1 and 2 GPU workers, as a Markdown table.
# Logs, the table and its JSON go under $OUT (the device tool brings them back).
# Extra arguments go to the bench (e.g. --layers 4 --rounds 1 --targets TRITON).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/moe-control-gpu-multi}
mkdir -p "$OUT"
source scripts/gpu_env.sh

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt" || true
df -h /dev/shm /tmp 2>/dev/null | tee "$OUT/storage.txt" || true
# Each step runs in its own session under a watchdog, and whatever it started (the server
# and its worker processes) is killed with it, so a step that overruns cannot leave a server
# holding the GPUs for the next one.
run_step() {  # run_step SECONDS LOG COMMAND...
    local limit=$1 log=$2
    shift 2
    setsid "$@" >"$log" 2>&1 &
    local pid=$!
    ( sleep "$limit"; echo "TIMEOUT after ${limit} s" >>"$log"; kill -TERM -- -"$pid" 2>/dev/null
      sleep 10; kill -KILL -- -"$pid" 2>/dev/null ) &
    local watchdog=$!
    wait "$pid"
    local rc=$?
    kill "$watchdog" 2>/dev/null
    wait "$watchdog" 2>/dev/null
    kill -KILL -- -"$pid" 2>/dev/null
    tail -n 80 "$log"
    return $rc
}

status=0
run_step 200 "$OUT/pytest_multi_gpu.log" \
    "$PY" -m pytest -q -m gpu tests/gpu/test_multi_gpu.py -p no:cacheprovider -rA || status=1
run_step 260 "$OUT/multi_gpu_bench.log" "$PY" bench/multi_gpu_bench.py --out "$OUT" "$@" || status=1
echo "gpu-multi: $([[ $status == 0 ]] && echo PASSED || echo FAILED)"
exit $status
