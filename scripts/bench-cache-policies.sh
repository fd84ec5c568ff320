#!/usr/bin/env bash
# The cold-neuron cache policies under an FFN budget, side by side:
# hit rate, bytes read from the FFN bundle per token (prompt included) and
# decode tok/s, for each budget and policy, rounds interleaved.
#
#   scripts/bench-cache-policies.sh [ROUNDS]      (default 2; BUDGETS="20 30 45 60" in MB,
#                                                POLICIES="lru freq-lru sweep window",
#                                                LOOKAHEAD="off" or "on off": the next
#                                                layer's neurons read ahead, or not)
#
# Calibrates a low-rank sidecar for SmolLM2 into target/bench-cache/ the
# first time (about 30 s). Prints "round budget_mb policy lookahead
# cache_slots hot_neurons hit_rate MB_per_token tok_s" lines (bytes read
# by the gathers; the look-ahead's own reads are not in MB_per_token). docs/sparsity.md,
# "Which cold neurons to keep".
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
bin=target/release/spinfer
[ -x "$bin" ] || cargo build --release -q -p spinfer-cli
dir=target/bench-cache
mkdir -p "$dir"
if [ ! -f "$dir/s.spinfer" ]; then
    "$bin" calibrate -m "$model" --text tests/data/wikitext-2-raw/wiki.test.raw --offset 800000 --tokens 1024 \
        --rank 64 --target-sparsity 0.5 -t 2 --out "$dir/s.spinfer" --quiet
fi
echo "round budget_mb policy lookahead cache_slots hot_neurons hit_rate MB_per_token tok_s"
for round in $(seq "$rounds"); do
    for b in ${BUDGETS:-20 30 45 60}; do
        for pol in ${POLICIES:-lru freq-lru sweep window}; do
          for la in ${LOOKAHEAD:-off}; do
            flag=()
            [ "$la" = on ] && flag=(--lookahead)
            "$bin" generate -m "$model" --sparsity "$dir/s.spinfer" --predictor low-rank --ffn-budget-mb "$b" \
                --cache-policy "$pol" "${flag[@]}" -p "The history of the city is long and complicated. In the early days" \
                -n 128 --temp 0 -t 2 --json 2>/dev/null | python3 -c "
import json, sys
d = json.load(sys.stdin); e = d['sparsity']['budget']; g = e['engine']
tokens = len(d['tokens']) + d['prompt_tokens']
print($round, $b, '$pol', '$la', e['cache_slots'], e['hot_neurons'], round(g['hit_rate'], 3),
      round(g['bytes_read'] / 1e6 / tokens, 2), round(d['decode_tokens_per_second'], 1))"
          done
        done
    done
done
