#!/usr/bin/env bash
# Greedy continuations of the six reference prompts, dense next to sparse:
#   scripts/greedy-side-by-side.sh MODEL SIDECAR [PREDICTOR] [N]
# Prints a Markdown table (docs/sparsity.md).
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1
sidecar=$2
predictor=${3:-}
n=${4:-24}
spinfer=target/release/spinfer
[ -x "$spinfer" ] || cargo build --release --quiet -p spinfer-cli
extra=()
[ -n "$predictor" ] && extra=(--predictor "$predictor")
echo "| prompt | dense | sparse | same |"
echo "|---|---|---|---|"
python3 -c 'import json; [print(p["text"]) for p in json.load(open("tests/data/reference/smollm2-135m-instruct.json"))["prompts"]]' |
while IFS= read -r prompt; do
    d=$("$spinfer" generate -m "$model" -p "$prompt" -n "$n" --temp 0 --quiet -t 2)
    s=$("$spinfer" generate -m "$model" -p "$prompt" -n "$n" --temp 0 --quiet -t 2 --sparsity "$sidecar" "${extra[@]}")
    esc() { printf '%s' "$1" | tr '\n' ' ' | sed 's/|/\\|/g'; }
    same=no
    [ "$d" = "$s" ] && same=yes
    echo "| $(esc "$prompt") | $(esc "$d") | $(esc "$s") | $same |"
done
