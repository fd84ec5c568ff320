#!/usr/bin/env bash
# Builds and runs the fuzz targets in tests/fuzz (docs/reliability.md).
#
#   scripts/fuzz.sh --smoke               every target for 10 s (part of scripts/test.sh)
#   scripts/fuzz.sh --time 600            every target for 600 s
#   scripts/fuzz.sh --runs 1000000 gguf   1,000,000 executions of the gguf target
#   scripts/fuzz.sh --build               build only
#   scripts/fuzz.sh --time 60 pack -- -jobs=2   extra libFuzzer flags after --
#
# Engine: libFuzzer (the libfuzzer-sys crate) on the stable toolchain, with
# rustc's sanitizer-coverage instrumentation passed as plain -C flags (the
# flags cargo-fuzz passes, minus the nightly-only -Z sanitizer ones), so
# neither nightly nor cargo-fuzz is needed. Each target runs one at a time,
# under the limits the project holds its parsers to: no single allocation
# over 1 GiB (the targets' global allocator aborts; libFuzzer's
# -malloc_limit_mb, also passed, works only under a sanitizer), 2 GiB
# resident at most (-rss_limit_mb), no input over 10 s (-timeout). The committed seeds (tests/fuzz/corpus/TARGET)
# are read, never written: new inputs go to tests/fuzz/target/corpus/TARGET
# and crashes to tests/fuzz/artifacts/TARGET/ (both git-ignored).
# Exits non-zero if any target crashed, hung, ran out of memory or did not build.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
fuzz=$root/tests/fuzz
all_targets=(gguf safetensors operator_toml pack sidecar history gbnf)

mode=time
amount=600
build_only=0
targets=()
extra=()
while [ $# -gt 0 ]; do
    case $1 in
        --smoke) mode=time; amount=10 ;;
        --time) mode=time; amount=$2; shift ;;
        --runs) mode=runs; amount=$2; shift ;;
        --build) build_only=1 ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
        *) targets+=("$1") ;;
    esac
    shift
done
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")

# libfuzzer-sys compiles libFuzzer (C++): a C++ compiler is all it needs
# besides crates.io.
if ! command -v c++ >/dev/null 2>&1; then
    echo "fuzz.sh: installing a C++ compiler (g++) for libFuzzer"
    if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq g++; else sudo apt-get install -y -qq g++; fi
fi

host=$(rustc -vV | sed -n 's/^host: //p')
# What cargo-fuzz passes (sanitizer-coverage: 8-bit counters, PC table,
# comparison tracing) plus --cfg fuzzing. With an explicit --target these
# flags reach only the target's code, not build scripts or proc macros.
flags="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4"
flags+=" -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table"
flags+=" -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing"
export CARGO_TARGET_DIR=$fuzz/target
echo "fuzz.sh: building ${targets[*]} ($host, instrumented release)"
bins=()
for t in "${targets[@]}"; do bins+=(--bin "$t"); done
RUSTFLAGS="$flags ${RUSTFLAGS:-}" cargo build --release --manifest-path "$fuzz/Cargo.toml" \
    --target "$host" "${bins[@]}"
[ "$build_only" = 1 ] && exit 0

if [ "$mode" = time ]; then limit=(-max_total_time="$amount"); else limit=(-runs="$amount"); fi
# The targets write each input to files here (tmpfs if there is one).
scratch_base=/tmp
[ -d /dev/shm ] && [ -w /dev/shm ] && scratch_base=/dev/shm
export SPINFER_FUZZ_SCRATCH
SPINFER_FUZZ_SCRATCH=$(mktemp -d "$scratch_base/spinfer-fuzz.XXXXXX")
trap 'rm -rf "$SPINFER_FUZZ_SCRATCH"' EXIT
summary=()
failed=0
for t in "${targets[@]}"; do
    work=$fuzz/target/corpus/$t
    artifacts=$fuzz/artifacts/$t
    mkdir -p "$work" "$artifacts"
    dict=()
    [ -f "$fuzz/dict/$t.dict" ] && dict=(-dict="$fuzz/dict/$t.dict")
    log=$fuzz/target/fuzz-$t.log
    echo "=== fuzz $t: ${limit[*]}"
    start=$(date +%s)
    rc=0
    "$CARGO_TARGET_DIR/$host/release/$t" "$work" "$fuzz/corpus/$t" "${dict[@]}" "${limit[@]}" \
        -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=10 -print_final_stats=1 \
        -artifact_prefix="$artifacts/" "${extra[@]}" >"$log" 2>&1 || rc=$?
    secs=$(( $(date +%s) - start ))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    if [ "$rc" = 0 ]; then
        line="$t: ${execs:-?} executions in ${secs} s, ok"
    else
        failed=$((failed + 1))
        tail -n 60 "$log"
        line="$t: FAILED (exit $rc) after ${execs:-?} executions in ${secs} s; log $log, inputs in $artifacts/"
    fi
    echo "$line"
    summary+=("$line")
done
echo "=== fuzz summary"
printf '%s\n' "${summary[@]}"
echo "fuzz targets: $(( ${#targets[@]} - failed )) passed, $failed failed"
[ "$failed" = 0 ]
