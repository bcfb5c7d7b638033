# syntax=docker/dockerfile:1
# moe-control: the gRPC control plane for WNA16 MoE kernels, on a CUDA 13.0 runtime.
#
#   docker build -t moe-control:0.1.0 .
#   docker build --build-arg INSTALL_VLLM=1 -t moe-control:0.1.0-vllm .   # also the whole of vLLM
#   docker run --gpus all -p 50151:50151 -p 9464:9464 moe-control:0.1.0
#
# Three stages: `wheel` builds the package's wheel (nothing from the source tree reaches the
# runtime image but that wheel), `marlin` takes vLLM's compiled Marlin MoE library out of the
# vLLM wheel, and the runtime stage installs torch (cu130 build, the one the GPU fleet runs),
# the wheel and humming-kernels into a virtual environment owned by root and runs as a
# non-root user.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
# Only what the wheel needs: the package, its metadata and the README it embeds.
COPY pyproject.toml README.md ./
COPY service ./service
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# ---------------------------------------------------------------------------------------
# vLLM's Marlin MoE GEMM (`torch.ops._moe_C.moe_wna16_marlin_gemm`) lives in one abi3
# library inside the vLLM wheel; it loads with torch.ops.load_library on torch 2.11, so the
# image carries just that file (45 MB) instead of vLLM and its own torch pin.
FROM ${PYTHON_IMAGE} AS marlin
ARG VLLM_VERSION=0.33.0
WORKDIR /tmp/vllm
RUN python -m pip download --no-cache-dir --no-deps --only-binary=:all: \
        --dest /tmp/vllm "vllm==${VLLM_VERSION}" \
    && python -c "import glob, zipfile; \
zipfile.ZipFile(glob.glob('/tmp/vllm/vllm-*.whl')[0]).extract('vllm/_moe_C_stable_libtorch.abi3.so', '/opt')" \
    && rm -rf /tmp/vllm/*.whl

# ---------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS runtime
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ARG HUMMING_VERSION=0.1.19
ARG VLLM_VERSION=0.33.0
# 1: install the whole of vLLM as well (its torch pin then replaces TORCH_VERSION).
ARG INSTALL_VLLM=0
ARG UID=10001

LABEL org.opencontainers.image.title="moe-control" \
      org.opencontainers.image.description="gRPC control plane for WNA16 MoE kernels" \
      org.opencontainers.image.licenses="Apache-2.0"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Python from the distribution (Ubuntu 24.04: 3.12) and tini, which forwards SIGTERM to
# the server and reaps its worker processes. Distribution packages follow the base image's
# snapshot, so they are not pinned one by one.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv tini ca-certificates \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/moe-control \
    PATH=/opt/moe-control/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY --from=wheel /dist/ /tmp/dist/
# torch first from the CUDA 13.0 index (an open range would take PyPI's default build),
# then the service and humming-kernels with its CUDA 13 JIT toolchain (nvrtc, nvcc headers).
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir /tmp/dist/*.whl "humming-kernels[cu13]==${HUMMING_VERSION}" \
    && if [ "$INSTALL_VLLM" = "1" ]; then pip install --no-cache-dir "vllm==${VLLM_VERSION}"; fi \
    && rm -rf /tmp/dist

COPY --from=marlin /opt/vllm/_moe_C_stable_libtorch.abi3.so /opt/moe-control/lib/

RUN useradd --uid "$UID" --user-group --create-home --home-dir /home/moe --shell /usr/sbin/nologin moe

# In a pod every address must be reachable; the Marlin library path is the worker's
# fallback when vLLM itself is not installed. Caches (humming's and Triton's JIT output)
# go under the user's home, which Kubernetes mounts as an emptyDir.
ENV MOE_CONTROL_HOST=0.0.0.0 \
    MOE_CONTROL_PORT=50151 \
    MOE_CONTROL_METRICS_HOST=0.0.0.0 \
    MOE_CONTROL_METRICS_PORT=9464 \
    MOE_CONTROL_MARLIN_LIBRARY=/opt/moe-control/lib/_moe_C_stable_libtorch.abi3.so \
    XDG_CACHE_HOME=/home/moe/.cache \
    TRITON_CACHE_DIR=/home/moe/.cache/triton

USER ${UID}:${UID}
WORKDIR /home/moe
EXPOSE 50151 9464 8151

# Readiness through the standard gRPC health service: SERVING while at least one worker is ready.
# With TLS on, run `moe-control health --tls-ca ...` instead (see docs/deploying.md, "TLS").
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["/bin/sh", "-c", "moe-control health --ready --server 127.0.0.1:${MOE_CONTROL_PORT} --timeout 4"]

ENTRYPOINT ["tini", "--", "moe-control", "serve"]
