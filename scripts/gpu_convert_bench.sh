#!/usr/bin/env bash
# Weight-conversion throughput on the H200, in one device call (about two minutes).
#
# Runs bench/convert_bench.py's layer part on cuda:0: a Mixtral-8x7B MoE layer (8 experts,
# hidden 4096, intermediate 14336, int4 g128 symmetric) as GPTQ and AWQ checkpoints store it,
# into TRITON and MARLIN by the canonical route, by the direct routes in torch ops
# (service/formats/routes/direct.py, route `direct`) and by their fused Triton kernels
# (service/formats/routes/gpu_repack.py, route `triton`); CUDA-event timings, median of --rounds after a warm-up; the
# floor is (bytes read + written) over the device-to-device copy bandwidth measured in the
# same run; every direct result is compared byte for byte with the canonical one.
#
# From the CPU machine (the device tool carries the working tree; .gpu/ as for gpu_test.sh):
#     bash scripts/gpu_convert_bench.sh            # carry [".gpu"]
# Extra arguments go to the bench (e.g. --rounds 20, --sources gptq, --quick). The run is
# cut at 85 s (rows are logged as they are measured). With COMPILED=1, then, within a 110 s
# limit, the same with the direct transforms through torch.compile (route `compiled`).
# Then (unless PROFILE=0, within a 100 s limit) bench/repack_profile.py: where one layer's
# ms go, per stage (read, w13/w2 weights, other tensors, finish; CUDA events and host time),
# the weight writes alone against their copy floor, and the CUDA kernels by device time
# (torch.profiler), for the direct routes in torch ops and through the fused kernels.
# Writes convert_bench.md (the table), repack_profile.md, the .json and .log files under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/moe-control-gpu}
mkdir -p "$OUT"
# The same environment as scripts/gpu_test.sh (the conversion itself needs only torch and
# numpy; without .gpu/ the image's packages are used).
source scripts/gpu_env.sh

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
timeout 85 "$PY" bench/convert_bench.py --device cuda:0 --skip-checkpoint --rounds 10 \
    --routes canonical direct triton --markdown "$OUT/convert_bench.md" --json "$@" 2>&1 \
    | tee "$OUT/convert_bench.log"
status=${PIPESTATUS[0]}
# The JSON is the tail of the log after the tables.
sed -n '/^{/,$p' "$OUT/convert_bench.log" > "$OUT/convert_bench.json"
if [[ "${PROFILE:-1}" == 1 ]]; then
    timeout 100 "$PY" bench/repack_profile.py --device cuda:0 --rounds 5 \
        --markdown "$OUT/repack_profile.md" --json "$OUT/repack_profile.json" 2>&1 \
        | tee "$OUT/repack_profile.log"
    echo "repack profile: exit ${PIPESTATUS[0]} (124: past the 100 s limit; finished pairs are in the log)"
fi
if [[ "${COMPILED:-0}" == 1 ]]; then
    timeout 110 "$PY" bench/convert_bench.py --device cuda:0 --skip-checkpoint --rounds 10 \
        --routes canonical compiled --markdown "$OUT/convert_bench_compiled.md" "$@" 2>&1 \
        | tee "$OUT/convert_bench_compiled.log"
    echo "compiled route: exit ${PIPESTATUS[0]} (124: past the 110 s limit; finished rows are in the log)"
fi
echo "gpu-convert-bench: $([[ $status == 0 ]] && echo DONE || echo FAILED) ($OUT/convert_bench.md)"
exit "$status"
