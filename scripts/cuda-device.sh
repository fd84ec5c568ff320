#!/usr/bin/env bash
# The CUDA checks and benchmarks, on a GPU machine that has the NVIDIA
# driver and a CUDA toolkit (nvcc, libnvrtc) but no Rust toolchain and no
# network: binaries are built here, model and llama.cpp source carried over.
#
#   scripts/cuda-device.sh --build BIN_DIR        # here: the test and bench binaries
#   scripts/cuda-device.sh --stage FILE...        # there: keep carried files in /tmp/spinfer-stage
#   scripts/cuda-device.sh --llama SRC.tar.xz     # there: build llama.cpp (CUDA) in the background
#   scripts/cuda-device.sh --run BIN_DIR OUT_DIR  # there: tests, benchmarks, llama.cpp side by side
#
# --run's steps can be skipped: SKIP_KERNEL_TESTS=1 (the kernel tests),
# SKIP_KERNEL_BENCH=1 (cuda_bench). With a sidecar staged beside a model
# (smollm2.spinfer, gemma3.spinfer) the hybrid CPU/GPU split is benchmarked
# too (hybrid_bench).
#
# --run assembles the SmolLM2 and Gemma 3 GGUFs from staged parts
# (smollm2.part*, gemma3.part*) when they are there and checks their sha256
# before using them.
set -euo pipefail

STAGE=/tmp/spinfer-stage
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GEMMA_SHA=$(sed -n 's/^GEMMA_SHA=//p' "$(dirname "$0")/fetch-models.sh")
LLAMA=/tmp/llama

nvrtc_env() {
    # libnvrtc from the toolkit, under the unversioned name cudarc tries first.
    local nvrtc
    nvrtc=$(ls /usr/local/cuda/lib64/libnvrtc.so.* 2>/dev/null | grep -v builtins | head -1 || true)
    [ -n "$nvrtc" ] || nvrtc=$(find / -name 'libnvrtc.so.*' -not -name '*builtins*' 2>/dev/null | head -1)
    echo "libnvrtc: $nvrtc"
    mkdir -p /tmp/spinfer-nvrtc && ln -sf "$nvrtc" /tmp/spinfer-nvrtc/libnvrtc.so
    export LD_LIBRARY_PATH="/tmp/spinfer-nvrtc:$(dirname "$nvrtc"):${LD_LIBRARY_PATH:-}"
}

case "${1:-}" in
--build)
    bin=${2:?folder}
    mkdir -p "$bin"
    cargo build --release -p spinfer-kernels-cuda -p spinfer-gpu --features spinfer-kernels-cuda/cuda,spinfer-gpu/cuda \
        --tests --examples --message-format=json |
        python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    pkg = m.get("package_id", "")
    if m.get("reason") == "compiler-artifact" and m.get("executable") and ("kernels-cuda" in pkg or "engine/gpu" in pkg):
        kind = m["target"]["kind"][0]
        name = m["target"]["name"] if kind != "lib" else "unit-" + m["target"]["name"]
        shutil.copy(m["executable"], sys.argv[1] + "/" + name)
        print(name)
' "$bin"
    strip "$bin"/* 2>/dev/null || true
    ;;
--stage)
    shift
    mkdir -p "$STAGE"
    for f in "$@"; do cp "$f" "$STAGE/"; done
    ls -la "$STAGE"
    ;;
--llama)
    src=${2:?source tarball}
    rm -rf "$LLAMA" && mkdir -p "$LLAMA" && tar xJf "$src" -C "$LLAMA"
    cd "$LLAMA/llama.cpp"
    # A new session: the build outlives this command (until the machine goes back).
    setsid nohup bash -c '
        cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
            -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF > ../configure.log 2>&1 &&
        cmake --build build -j 16 --target llama-bench > ../build.log 2>&1
        echo $? > ../build.rc' > /dev/null 2>&1 < /dev/null &
    echo "llama.cpp build started in $LLAMA"
    ;;
--run)
    bin=${2:?folder} out=${3:?output folder}
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/device.txt"
    nvrtc_env | tee -a "$out/device.txt"
    export SPINFER_EXPECT_GPU=1 SPINFER_EXPECT_NVRTC=1 SPINFER_CUDA_CACHE=/tmp/spinfer-cuda-cache RUST_BACKTRACE=1
    # The end-to-end tests find tests/data through the path they were built in.
    [ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
    # assemble NAME SHA: the staged parts of NAME as one checked file, or "".
    assemble() {
        ls "$STAGE/$1".part* > /dev/null 2>&1 || return 0
        cat "$STAGE/$1".part* > "$STAGE/$1.gguf"
        if echo "$2  $STAGE/$1.gguf" | sha256sum --check --status; then
            echo "$STAGE/$1.gguf"
        else
            echo "error: the assembled $1 does not have sha256 $2" >&2
        fi
    }
    model=$(assemble smollm2 "$SMOL_SHA")
    gemma=$(assemble gemma3 "$GEMMA_SHA")
    [ -n "$model" ] && export SPINFER_MODEL="$model"
    [ -n "$gemma" ] && export SPINFER_GEMMA_MODEL="$gemma"
    status=0
    # Wait for the background llama.cpp build, at most LLAMA_WAIT seconds.
    wait_llama() {
        [ -d "$LLAMA" ] || return 0
        for _ in $(seq 1 $(( ${LLAMA_WAIT:-300} / 5 ))); do [ -f "$LLAMA/build.rc" ] && break; sleep 5; done
        echo "llama.cpp build: rc $(cat "$LLAMA/build.rc" 2>/dev/null || echo 'not finished')"
        tail -3 "$LLAMA/build.log" 2>/dev/null || true
    }
    lb="$LLAMA/llama.cpp/build/bin/llama-bench"
    # hybrid NAME MODEL: the split against CPU-only and full offload, with
    # the staged sidecar of NAME.
    hybrid() {
        [ -f "$STAGE/$1.spinfer" ] && [ -x "$bin/hybrid_bench" ] || return 0
        echo "== hybrid split ($1)"
        "$bin/hybrid_bench" "$2" "$STAGE/$1.spinfer" --reps 3 | tee -a "$out/hybrid-$1.txt"
    }
    # side_by_side NAME MODEL FILE: spinfer and llama.cpp (CUDA), two rounds
    # interleaved, appended to FILE.
    side_by_side() {
        for round in 1 2; do
            echo "== round $round: spinfer ($1)"
            "$bin/gpu_bench" "$2" --reps 5 | tee -a "$3"
            # An earlier build of the same bench, for a same-machine ratio.
            if [ -x "$bin/gpu_bench_baseline" ]; then
                echo "== round $round: spinfer baseline build ($1)"
                "$bin/gpu_bench_baseline" "$2" --reps 5 | tee -a "$3"
            fi
            if [ -x "$lb" ]; then
                echo "== round $round: llama.cpp ($1)"
                "$lb" -m "$2" -ngl 99 -p 512 -n 128 -r 5 2>&1 | tee -a "$3" | grep -E "model|---|pp|tg"
            fi
        done
    }
    kernel_tests=("$bin"/unit-* "$bin"/probe "$bin"/kernels "$bin"/ops "$bin"/fused)
    [ -n "${SKIP_KERNEL_TESTS:-}" ] && kernel_tests=()
    for t in "${kernel_tests[@]}" "$bin"/hybrid; do
        [ -x "$t" ] || continue
        echo "== $(basename "$t")"
        "$t" --test-threads 1 --nocapture 2>&1 | tee "$out/test-$(basename "$t").txt" | grep -E "^test |test result|panicked|skipped|budgeted|over .* steps" || status=1
    done
    if [ -n "$gemma" ] && [ -x "$bin/gemma3" ]; then
        echo "== gemma3 (gpu model)"
        "$bin/gemma3" --test-threads 1 --nocapture 2>&1 | tee "$out/test-gemma3.txt" | grep -vE "^\s*$" || status=1
        hybrid gemma3 "$gemma"
        wait_llama
        side_by_side gemma3 "$gemma" "$out/side-by-side-gemma3.txt"
    fi
    if [ -n "$model" ]; then
        echo "== smollm2 (gpu model)"
        "$bin/smollm2" --test-threads 1 --nocapture 2>&1 | tee "$out/test-smollm2.txt" | grep -vE "^\s*$" || status=1
        hybrid smollm2 "$model"
    fi
    # The kernel benchmark while llama.cpp may still be building.
    if [ -z "${SKIP_KERNEL_BENCH:-}" ]; then
        echo "== cuda_bench"
        "$bin/cuda_bench" --json "$out/bench.json" > "$out/bench.txt" 2>&1 || status=1
        cat "$out/bench.txt"
    fi
    if [ -n "$model" ]; then
        wait_llama
        side_by_side smollm2 "$model" "$out/side-by-side.txt"
    fi
    exit $status
    ;;
*)
    echo "usage: $0 --build BIN_DIR | --stage FILE... | --llama SRC.tar.xz | --run BIN_DIR OUT_DIR" >&2
    exit 2
    ;;
esac
