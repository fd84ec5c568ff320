#!/usr/bin/env bash
# Runs the CUDA checks and kernel benchmarks on a GPU machine that has the
# NVIDIA driver and a CUDA toolkit (for libnvrtc) but no Rust toolchain.
#
# Build here, with the binaries copied into a folder:
#   scripts/cuda-device.sh --build .gpu/bin
# then, on the GPU machine, from the repository root:
#   scripts/cuda-device.sh --run .gpu/bin OUTDIR
set -euo pipefail

case "${1:-}" in
--build)
    bin=${2:?folder}
    mkdir -p "$bin"
    cargo build --release -p spinfer-kernels-cuda --features cuda --tests --examples --message-format=json |
        python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "spinfer-kernels-cuda" in m["package_id"]:
        name = m["target"]["name"] if m["target"]["kind"][0] != "lib" else "unit"
        shutil.copy(m["executable"], sys.argv[1] + "/" + name)
        print(name)
' "$bin"
    ;;
--run)
    bin=${2:?folder} out=${3:?output folder}
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/device.txt"
    # libnvrtc from the toolkit, under the unversioned name cudarc tries first.
    nvrtc=$(ls /usr/local/cuda/lib64/libnvrtc.so.* 2>/dev/null | grep -v builtins | head -1 || true)
    [ -n "$nvrtc" ] || nvrtc=$(find / -name 'libnvrtc.so.*' -not -name '*builtins*' 2>/dev/null | head -1)
    echo "libnvrtc: $nvrtc" | tee -a "$out/device.txt"
    mkdir -p /tmp/spinfer-nvrtc && ln -sf "$nvrtc" /tmp/spinfer-nvrtc/libnvrtc.so
    export LD_LIBRARY_PATH="/tmp/spinfer-nvrtc:$(dirname "$nvrtc"):${LD_LIBRARY_PATH:-}"
    export SPINFER_EXPECT_GPU=1 SPINFER_EXPECT_NVRTC=1 SPINFER_CUDA_CACHE=/tmp/spinfer-cuda-cache RUST_BACKTRACE=1
    status=0
    for t in unit probe kernels; do
        echo "== $t"
        "$bin/$t" --test-threads 1 --nocapture 2>&1 | tee "$out/test-$t.txt" || status=1
    done
    echo "== cuda_bench"
    "$bin/cuda_bench" --json "$out/bench.json" 2>&1 | tee "$out/bench.txt" || status=1
    exit $status
    ;;
*)
    echo "usage: $0 --build BIN_DIR | --run BIN_DIR OUT_DIR" >&2
    exit 2
    ;;
esac
