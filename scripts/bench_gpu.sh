#!/usr/bin/env bash
# The MoE forward benchmark, executed ON the H200 from the repository root (`make bench-gpu`
# prepares `.gpu/` here and prints the device command that runs this; carry [".gpu"]).
#
# Same setup as scripts/gpu_test.sh (humming and grpc wheels into /tmp/site, vLLM's Marlin
# MoE library, humming's JIT cache), then bench/moe_bench.py: the ceilings, then every
# backend against the floor at four layer shapes and seven token counts, in one process.
# Extra arguments go to the bench (e.g. --quick, --shapes qwen3, --budget-s 300).
# The table and its JSON land under $OUT (moe_bench.md starts with the command).
#
# `bash scripts/bench_gpu.sh overhead [args]` runs the service-overhead bench instead:
# bench/runmoe_overhead.py against a real server on cuda:0 (RunMoE at M = 1 and 4096 split
# into client, transport, server and device time; then SelectBackend MEASURED, first call
# and repeats) -> $OUT/runmoe_overhead.md.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/moe-control-bench}
mkdir -p "$OUT"
GPU_ENV_REQUIRE=1 source scripts/gpu_env.sh

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader || true
if [[ "${1:-}" == overhead ]]; then
    shift
    "$PY" bench/runmoe_overhead.py --devices cuda:0 --measured --out "$OUT" "$@" 2>&1 \
        | tee "$OUT/runmoe_overhead.log"
    status=${PIPESTATUS[0]}
    echo "bench-gpu overhead: exit $status"
    exit "$status"
fi
"$PY" bench/moe_bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/moe_bench.log"
status=${PIPESTATUS[0]}
# humming's compiled kernels, so the next run can carry them (.gpu/humming-cache) and skip the JIT
if [[ -d "$HUMMING_CACHE_DIR" ]]; then
    tar -C "$HUMMING_CACHE_DIR" -czf "$OUT/humming-cache.tgz" . 2>/dev/null || true
fi
echo "bench-gpu: exit $status"
exit "$status"
