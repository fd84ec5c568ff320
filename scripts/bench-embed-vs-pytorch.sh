#!/usr/bin/env bash
# Sentence-embedding throughput, spinfer next to PyTorch (sentence-transformers
# on CPU, same thread count), interleaved per (length, batch), best of N each:
#
#   scripts/bench-embed-vs-pytorch.sh [MODEL_DIR]     (default models/all-MiniLM-L6-v2)
#
# Environment:
#   THREADS=2            threads for both (spinfer --threads, torch.set_num_threads)
#   LENGTHS="16 64 256"  tokens per input ([CLS] + L-2 words + [SEP])
#   BATCHES="1 8 32"     batch sizes
#   REPEATS=3            runs per side and cell; the best one is reported
#   PYTORCH_DIR=DIR      a directory with torch + sentence-transformers
#                        (e.g. /tmp/pyt); default target/bench-embed/pydeps,
#                        installed there from PyPI when missing
#   SPINFER=PATH         the spinfer binary (default target/release/spinfer,
#                        built if missing)
#   SPINFER_EMBED_REDUCED=0 run spinfer's encoder in f32 only (default: bf16
#                        products for Q/K/V, attention output and FFN up where
#                        the CPU has AVX-512 BF16, int16 for all four on AVX2)
#
# Inputs: 64 lines per length, generated deterministically into
# target/bench-embed/. Prints a Markdown table (docs/benchmarks.md):
# inputs (sentences) per second and the ratio spinfer / PyTorch, with the
# load average before and after (timings on a loaded machine mean little).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/all-MiniLM-L6-v2}
threads=${THREADS:-2}
lengths=${LENGTHS:-16 64 256}
batches=${BATCHES:-1 8 32}
repeats=${REPEATS:-3}
work=target/bench-embed
pydir=${PYTORCH_DIR:-$work/pydeps}
spinfer=${SPINFER:-target/release/spinfer}

[ -d "$model" ] || { echo "no model directory $model (scripts/fetch-models.sh)" >&2; exit 1; }
mkdir -p "$work"
[ -x "$spinfer" ] || cargo build --release --quiet -p spinfer-cli
if ! PYTHONPATH="$pydir" python3 -c 'import torch, sentence_transformers' 2>/dev/null; then
    echo "installing torch + sentence-transformers into $pydir" >&2
    python3 -m pip install --quiet --target "$pydir" torch sentence-transformers >&2
fi
# shellcheck disable=SC2086
python3 scripts/bench_embed_pytorch.py gen "$work" $lengths

# One PyTorch process for the whole run (the model loads once).
coproc PT { PYTHONPATH="$pydir" HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error exec python3 scripts/bench_embed_pytorch.py serve "$model" "$threads"; }
trap 'kill "$PT_PID" 2>/dev/null || true' EXIT
read -r ready versions <&"${PT[0]}"
[ "$ready" = ready ] || { echo "the PyTorch side did not start" >&2; exit 1; }

# inputs/s of one spinfer run (its own timing: embedding only, not loading).
spinfer_rate() {
    "$spinfer" embed -m "$model" --file "$1" --batch-size "$2" --threads "$threads" -o /dev/null 2>&1 >/dev/null |
        sed -n 's/.* \([0-9.]*\) inputs\/s.*/\1/p' | tail -1
}
best() { printf '%s\n' "$@" | sort -g | tail -1; }

load() { cut -d' ' -f1-3 /proc/loadavg; }
echo "spinfer $("$spinfer" --version 2>/dev/null | awk '{print $2}') vs $versions;" \
    "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $threads threads, best of $repeats;" \
    "reduced precision ${SPINFER_EMBED_REDUCED:-on}; load average $(load)"
echo
echo "| L | B | spinfer/s | PyTorch/s | ratio |"
echo "|---:|---:|---:|---:|---:|"
for L in $lengths; do
    for B in $batches; do
        s=() p=()
        for _ in $(seq "$repeats"); do
            s+=("$(spinfer_rate "$work/len$L.txt" "$B")")
            echo "$PWD/$work/len$L.txt $B" >&"${PT[1]}"
            read -r rate <&"${PT[0]}"
            p+=("$rate")
        done
        sb=$(best "${s[@]}") pb=$(best "${p[@]}")
        echo "| $L | $B | $sb | $pb | $(awk -v a="$sb" -v b="$pb" 'BEGIN { printf "%.2f", a / b }') |"
    done
done
echo
echo "load average at the end: $(load)"
