#!/usr/bin/env bash
# The whole test suite, as CI runs it: fetch models, check formatting and
# lints, run every test in release (model-level tests are too slow in debug
# builds) without stopping at the first failing test binary, run the kernel
# tests again on the AVX2 and scalar paths (SPINFER_CPU caps what the
# kernels may use, so an AVX-512 machine also checks the code a CPU without
# it runs), compile every CUDA kernel through NVRTC (no GPU needed), then end
# with one line: test binaries passed and failed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh
# The official OpenAI client, which the server tests talk to spinfer serve with.
python3 -c 'import openai' 2>/dev/null ||
    python3 -m pip install --quiet --disable-pip-version-check 'openai==3.57.0'
# Installs the wasm32 target when it is missing.
kernels-wasm/build.sh target/wasm-packs/spinfer_kernels_wasm.wasm
cargo fmt --all -- --check
# No import cycle between the source files of any crate.
python3 scripts/import-cycles.py
cargo clippy --workspace --all-targets --release -- -D warnings
# API docs build without a warning (broken links, private items named in
# public docs).
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
# The CUDA code paths (feature `cuda`: cudarc loads libcuda and libnvrtc at
# run time, so they build without a toolkit).
cargo clippy -p spinfer-kernels-cuda -p spinfer-gpu -p spinfer-cli --all-targets --release \
    --features spinfer-kernels-cuda/cuda,spinfer-gpu/cuda,spinfer-cli/cuda -- -D warnings

log=$(mktemp)
trap 'rm -f "$log"' EXIT
failed_runs=()

# run LABEL COMMAND...: runs a cargo test command, keeping its output for the
# summary; a failure is remembered, not fatal.
run() {
    local label=$1
    shift
    echo "=== $label: $*" | tee -a "$log"
    if ! "$@" 2>&1 | tee -a "$log"; then
        failed_runs+=("$label")
    fi
}

run all cargo test --workspace --release --no-fail-fast
# Every kernel (built-in and the packs') against its scalar twin, every
# library's unit tests (the engine's own SIMD helpers among them), on the
# paths this CPU would not pick; the SmolLM2 reference test and the MiniLM
# ones (int16 products there) on the AVX2 path as whole-model checks. `--workspace` with target filters keeps the
# features of the first run, so nothing is rebuilt.
kernel_tests=()
for name in $(for f in engine/kernels/tests/*.rs engine/sparse-kernels/tests/*.rs plugins/cpu-*/tests/*.rs; do basename "$f" .rs; done | sort -u); do
    kernel_tests+=(--test "$name")
done
# avx512: the AVX-512 kernels where AMX tiles would take their shapes.
for cap in avx512 avx2 scalar; do
    extra=()
    [ "$cap" = avx2 ] && extra=(--test reference_smollm2 --test minilm --test minilm_sparse)
    run "SPINFER_CPU=$cap" env SPINFER_CPU=$cap cargo test --workspace --release --no-fail-fast \
        --lib "${kernel_tests[@]}" "${extra[@]}"
done
# CUDA without a GPU: every kernel source compiles through NVRTC (libnvrtc
# from PyPI), and every device test says it is skipped.
nvrtc_lib=$(scripts/fetch-nvrtc.sh)
run "cuda (nvrtc compile check, no gpu)" env LD_LIBRARY_PATH="$nvrtc_lib" SPINFER_EXPECT_NVRTC=1 \
    cargo test --release --no-fail-fast -p spinfer-kernels-cuda -p spinfer-gpu \
    --features spinfer-kernels-cuda/cuda,spinfer-gpu/cuda
if [ -x scripts/fuzz.sh ]; then
    run "fuzz smoke" scripts/fuzz.sh --smoke
fi

# A test binary either ends with "test result: ok", or it failed (a failed
# test, a crash, a timeout): count headers and successes.
binaries=$(grep -cE '^ +(Running [^`].*\(.*\)|Doc-tests .*)$' "$log" || true)
passed=$(grep -cE '^test result: ok\.' "$log" || true)
failed=$((binaries - passed))
# Fuzz targets count as test binaries too (scripts/fuzz.sh's last line).
if fuzz=$(grep -E '^fuzz targets: [0-9]+ passed, [0-9]+ failed$' "$log" | tail -1); then
    read -r fp ff < <(echo "$fuzz" | sed -E 's/^fuzz targets: ([0-9]+) passed, ([0-9]+) failed$/\1 \2/')
    passed=$((passed + fp))
    failed=$((failed + ff))
fi
# A run that failed before any test binary ran (a build error) still counts.
if [ ${#failed_runs[@]} -gt 0 ] && [ "$failed" -eq 0 ]; then
    failed=${#failed_runs[@]}
fi
echo
for r in "${failed_runs[@]}"; do
    echo "FAILED: $r"
done
grep -E '^ {4}`-p .*`$' "$log" | sed 's/^ */FAILED binary: /' || true
echo "binaries: $passed passed, $failed failed"
[ "$failed" -eq 0 ] && [ ${#failed_runs[@]} -eq 0 ]
