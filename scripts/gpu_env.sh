# Sourced (not run) by the scripts that execute ON the H200 from the repository root:
# makes the carried `.gpu/` folder usable, the same way for every one of them.
#
# The H200 image has Python 3.12, torch, triton, grpcio, protobuf, safetensors, numpy and
# pytest, and cannot download anything. `.gpu/` (made here by scripts/prepare_gpu_deps.sh)
# brings the rest: wheels (humming-kernels, grpcio's companions) and vLLM's MoE ops library
# for the Marlin adapter. The wheels go to /tmp/site once per machine: a stamp and a lock
# let several of these scripts start at once (one per GPU) without reinstalling under each
# other's feet.
#
# Sets PY, PYTHONPATH, MOE_CONTROL_MARLIN_LIBRARY (when the library is carried) and
# HUMMING_CACHE_DIR. With GPU_ENV_REQUIRE=1 a missing `.gpu/` is an error (exit 2).
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
GPU_SITE=${GPU_SITE:-/tmp/site}
if [[ -d .gpu/wheels ]]; then
    mkdir -p "$GPU_SITE"
    (
        flock 9
        stamp="$GPU_SITE/.moe-control-wheels"
        wanted=$(ls .gpu/wheels/*.whl | xargs -n1 basename | sort | tr '\n' ' ')
        if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$wanted" ]]; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --upgrade --target "$GPU_SITE" .gpu/wheels/*.whl && echo "$wanted" >"$stamp"
        fi
    ) 9>"$GPU_SITE.lock" || { echo "error: the .gpu wheels did not install" >&2; exit 2; }
    export PYTHONPATH="$GPU_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif [[ "${GPU_ENV_REQUIRE:-0}" == 1 ]]; then
    echo "error: .gpu/ is missing; run scripts/prepare_gpu_deps.sh on the CPU machine and carry .gpu" >&2
    exit 2
else
    echo "warning: .gpu/ not carried; relying on the image's packages" >&2
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ -f .gpu/lib/_moe_C_stable_libtorch.abi3.so ]]; then
    export MOE_CONTROL_MARLIN_LIBRARY="$PWD/.gpu/lib/_moe_C_stable_libtorch.abi3.so"
elif [[ "${GPU_ENV_REQUIRE:-0}" == 1 ]]; then
    echo "error: .gpu/lib/_moe_C_stable_libtorch.abi3.so is missing" >&2
    exit 2
fi
# humming keeps its JIT-compiled kernels here; a carried cache skips recompiling them.
export HUMMING_CACHE_DIR=${HUMMING_CACHE_DIR:-/tmp/humming-cache}
if [[ -d .gpu/humming-cache ]]; then
    mkdir -p "$HUMMING_CACHE_DIR" && cp -r .gpu/humming-cache/. "$HUMMING_CACHE_DIR/"
fi
