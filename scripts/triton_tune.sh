#!/usr/bin/env bash
# Our Triton WNA16 kernel on the H200: check, time the shipped tiles, tune; one call,
# under 6 minutes. Executed ON the GPU machine from the repository root, with `.gpu/`
# carried as for scripts/gpu_test.sh (its wheels are installed when present; the tuner
# itself needs only the image's torch and triton).
#
# (a) correctness of every kernel code path at small shapes on the GPU (tests/kernels/
#     triton/: int4/int8, zero points, groups 16-128 and channelwise,
#     activations, decode and prefill, swap-AB, split-K, workspace reuse);
# (b)+(c) bench/tune_triton.py at Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V3 for M = 1,
#     16, 256, 4096: the shipped tiles at every point, then the search space until
#     TUNE_BUDGET_S; every candidate checked against the fp32 reference at the real shape
#     before it may win; CUDA-graph medians with L2 flushed.
#
# Writes under $OUT: pytest_triton.log, tune.log, tune_table.md, tune_results.json and
# triton_configs/NVIDIA_H200.json (copy that file to service/kernels/triton/configs/).
# Extra arguments go to the tuner (e.g. --shapes Qwen3-30B-A3B --tokens 1 16).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/moe-control-tune}
mkdir -p "$OUT"
source scripts/gpu_env.sh

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader || true
start=$SECONDS
status=0
timeout "${TEST_TIMEOUT_S:-110}" "$PY" -m pytest -q -x tests/kernels/triton/ \
    -p no:cacheprovider 2>&1 | tee "$OUT/pytest_triton.log" | tail -5
(( ${PIPESTATUS[0]} == 0 )) || status=1
echo "tests: $((SECONDS - start)) s"
budget=$(( ${TUNE_BUDGET_S:-280} - (SECONDS - start) ))
(( budget < 60 )) && budget=60
timeout $(( budget + 40 )) "$PY" bench/tune_triton.py --out "$OUT" --budget-s "$budget" "$@" \
    2>&1 | tee "$OUT/tune.log" | grep -v "^\[" | tail -40
(( ${PIPESTATUS[0]} == 0 )) || status=1
grep -c "FAIL" "$OUT/tune.log" | xargs echo "failed trials:"
echo "triton-tune: $([[ $status == 0 ]] && echo PASSED || echo FAILED) in $((SECONDS - start)) s"
exit $status
