#!/usr/bin/env bash
# Per-kernel device time of our TRITON forward in its CUDA graph (bench/profile_forward.py),
# executed ON the H200 from the repository root; `.gpu/` carried as for scripts/bench_gpu.sh
# (only the image's torch and triton are needed: without `.gpu/` it warns and goes on).
#
# Default: Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B and Mixtral-8x7B at M = 1, 4, 16; variants
# shipped (what the dispatcher picks today), v3 (where it differs), v4, decode (v5), plus
# alternative decode tiles at M = 1 (--sweep). Every point is checked against the fp32
# reference. Cut at PROFILE_BUDGET_S (default 200 s): the bench starts no new point after
# its budget and a hard timeout stops it 60 s later. Writes under $OUT: profile_forward.md
# (the command, then the table), profile_forward.json and profile_forward.log.
# Extra arguments go to the bench (e.g. --shapes qwen3 --tokens 1).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/moe-control-profile}
mkdir -p "$OUT"
source scripts/gpu_env.sh

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader || true
budget=${PROFILE_BUDGET_S:-200}
start=$SECONDS
timeout $(( budget + 60 )) "$PY" bench/profile_forward.py --sweep --out "$OUT" \
    --budget-s $(( budget - 20 )) "$@" 2>&1 | tee "$OUT/profile_forward.log"
status=${PIPESTATUS[0]}
echo "profile-forward: exit $status in $((SECONDS - start)) s"
exit "$status"
