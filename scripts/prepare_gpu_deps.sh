#!/usr/bin/env bash
# Prepare, on this (CPU) machine, everything the H200 run needs that its image lacks.
#
# Why: the GPU machine cannot download anything, has Python 3.12 with torch 2.11 and triton,
# but no vLLM, no humming-kernels and none of grpcio's companion packages. So we fetch them
# here and the device call carries the folder `.gpu/` along:
#   .gpu/wheels/   wheels for CPython 3.12 / manylinux x86_64, installed there with --no-deps
#   .gpu/lib/_moe_C_stable_libtorch.abi3.so   vLLM 0.33.0's compiled MoE ops (Marlin MoE GEMM),
#                  extracted from the vLLM wheel; loaded with torch.ops.load_library
# The vLLM wheel itself (hundreds of MB) stays in `.gpu-cache/`, which is never carried.
# The carried folder must stay well under the device's 64 MiB transfer limit (checked below).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
VLLM_VERSION=0.33.0
HUMMING_VERSION=0.1.19
# The H200 has grpcio 1.84.0: its companions must not require anything newer.
GRPC_VERSION=1.84.0
MAX_CARRY_MIB=${MAX_CARRY_MIB:-55}

OUT=.gpu
CACHE=.gpu-cache
LIB_NAME=_moe_C_stable_libtorch.abi3.so
mkdir -p "$OUT/wheels" "$OUT/lib" "$CACHE"

# pip matches manylinux tags exactly, so name every tag a wheel might carry.
PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_31_x86_64 \
    manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
    PLATFORMS+=(--platform "$tag")
done
download() {  # download DEST SPEC...
    local dest=$1
    shift
    # (this machine's pip config names local mirrors that may be absent: drop those notes)
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${PLATFORMS[@]}" -d "$dest" "$@" 2> >(grep -v "is ignored" >&2)
}

# 1. Wheels installed on the H200 (pure Python apart from humming's abi3 loader). Their own
#    dependencies (torch, triton, numpy, jinja2, cuda-bindings, tqdm, tabulate, protobuf,
#    grpcio) are already in the H200 image.
download "$OUT/wheels" \
    "humming-kernels==$HUMMING_VERSION" \
    "grpcio-health-checking==$GRPC_VERSION" \
    "grpcio-reflection==$GRPC_VERSION" \
    "grpcio-status==$GRPC_VERSION" \
    "googleapis-common-protos==1.76.0"

# 2. vLLM's MoE ops library, from the PyPI wheel (no dependencies, nothing installed).
if [[ ! -s "$OUT/lib/$LIB_NAME" ]]; then
    if ! ls "$CACHE"/vllm-"$VLLM_VERSION"-*.whl >/dev/null 2>&1; then
        download "$CACHE" "vllm==$VLLM_VERSION"
    fi
    wheel=$(ls "$CACHE"/vllm-"$VLLM_VERSION"-*.whl | head -n 1)
    "$PYTHON" - "$wheel" "$OUT/lib/$LIB_NAME" <<'EOF'
import shutil, sys, zipfile
wheel, target = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as archive, archive.open("vllm/_moe_C_stable_libtorch.abi3.so") as src:
    with open(target + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
import os
os.replace(target + ".part", target)
EOF
fi

# 3. Size check: what travels is the working tree plus this folder.
carry_bytes=$(du -sb "$OUT" | cut -f1)
carry_mib=$(( (carry_bytes + 1048575) / 1048576 ))
echo "prepared $OUT: ${carry_mib} MiB ($(ls "$OUT/wheels" | wc -l) wheels, $LIB_NAME)"
if (( carry_mib > MAX_CARRY_MIB )); then
    echo "error: $OUT is ${carry_mib} MiB, over the ${MAX_CARRY_MIB} MiB budget" >&2
    exit 1
fi
