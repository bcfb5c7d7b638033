#!/usr/bin/env bash
# The GPU test run, executed ON the H200 from the repository root (`make gpu-test` prepares
# `.gpu/` here and prints the device command that runs this).
#
# The H200 image has Python 3.12, torch 2.11 (CUDA 13), triton 3.6, grpcio, protobuf,
# safetensors, numpy, pytest; it cannot download anything. The carried `.gpu/` folder holds
# the rest: wheels (humming-kernels, grpcio's companions) installed into /tmp/site, and vLLM's
# MoE ops library for the Marlin adapter.
#
# Steps: install the wheels; `pytest -m gpu` over every GPU-marked test (tests/gpu, the formats
# exactness checks on the GPU, the kernel tests; small shapes); then the
# correctness table (bench/gpu_suite.py) at Mixtral-8x7B and Qwen3-30B-A3B layer shapes.
# Extra arguments go to the suite (e.g. --smoke, --variants ..., --shapes ...).
# Writes logs and the table under $OUT when set (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/moe-control-gpu}
mkdir -p "$OUT"
GPU_ENV_REQUIRE=1 source scripts/gpu_env.sh

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
status=0
"$PY" -m pytest -q -m gpu tests/gpu tests/formats tests/kernels -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log"
(( ${PIPESTATUS[0]} == 0 )) || status=1
"$PY" bench/gpu_suite.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_suite.log"
(( ${PIPESTATUS[0]} == 0 )) || status=1
echo "gpu-test: $([[ $status == 0 ]] && echo PASSED || echo FAILED)"
exit $status
