#!/usr/bin/env bash
# Fetches NVIDIA's run-time compiler (libnvrtc 12.8, from the PyPI wheel
# nvidia-cuda-nvrtc-cu12==12.8.93, sha256-verified) into target/nvrtc/ and
# prints the folder holding libnvrtc.so.12, for the CUDA compile check
# without a GPU (kernels-cuda/tests/nvrtc.rs). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL_SHA=a7756528852ef889772a84c6cd89d41dfa74667e24cca16bb31f8f061e3e9994
dir=target/nvrtc
lib=$dir/nvidia/cuda_nvrtc/lib
if [ ! -f "$lib/libnvrtc.so.12" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    echo "fetching libnvrtc (PyPI nvidia-cuda-nvrtc-cu12==12.8.93)" >&2
    python3 -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_12_x86_64 \
        --platform manylinux2010_x86_64 --python-version 3.12 -d "$tmp" nvidia-cuda-nvrtc-cu12==12.8.93
    whl=$(ls "$tmp"/nvidia_cuda_nvrtc_cu12-12.8.93-*.whl)
    if ! echo "$WHEEL_SHA  $whl" | sha256sum --check --status; then
        echo "error: $whl does not have sha256 $WHEEL_SHA" >&2
        exit 1
    fi
    rm -rf "$dir" && mkdir -p "$dir"
    python3 -m zipfile -e "$whl" "$dir"
fi
# cudarc opens libnvrtc.so first: give it that name.
ln -sf libnvrtc.so.12 "$lib/libnvrtc.so"
realpath "$lib"
