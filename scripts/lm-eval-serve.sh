#!/usr/bin/env bash
# lm-evaluation-harness through `spinfer serve`: its `local-completions`
# model (echo + logprobs scoring, the server's /tokenize as its remote
# tokenizer, token-id prompts), on two local tasks built from the repo's
# test data (no download): a rolling log-likelihood over WikiText-2
# paragraphs (word/byte perplexity) and a small multiple-choice set. With
# --hf, the same tasks on lm-eval's own Hugging Face backend over the
# model's weights dequantised to f32 (`spinfer convert`), for comparison.
#
#   scripts/lm-eval-serve.sh [--hf] [--precision fast|precise|int8] [MODEL]
#
# Needs `lm_eval` with its `api` extra (pip install "lm_eval[api]"; set
# LM_EVAL=/path/to/lm_eval if it is not on PATH); --hf also needs torch,
# transformers and accelerate. Results: docs/serving.md, "Evaluation
# harnesses".
set -euo pipefail
cd "$(dirname "$0")/.."
hf=0 precision=fast
while [[ $# -gt 0 ]]; do
    case "$1" in
        --hf) hf=1; shift ;;
        --precision) precision="$2"; shift 2 ;;
        -*) echo "unknown option $1" >&2; exit 2 ;;
        *) break ;;
    esac
done
model="$(realpath "${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")"
lm_eval="${LM_EVAL:-lm_eval}"
spinfer="${SPINFER:-target/release/spinfer}"
[[ -x "$spinfer" ]] || cargo build --release -p spinfer-cli
tmp="$(mktemp -d)"
trap 'kill "${server:-0}" 2>/dev/null || true; rm -rf "$tmp"' EXIT

# The tasks: every WikiText-2 paragraph of over 400 characters in the
# repo's head of the test split (the first 4), and 6 questions.
python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
text = open("tests/data/wikitext-2-raw/wiki.test.head.raw", encoding="utf-8").read()
with open(f"{d}/wiki.jsonl", "w") as f:
    for p in [p.strip() for p in text.split("\n") if len(p.strip()) > 400][:4]:
        f.write(json.dumps({"page": p}) + "\n")
qs = [("The capital of France is", [" Paris", " London", " Berlin", " Madrid"]),
      ("Water freezes at a temperature of", [" zero degrees Celsius", " one hundred degrees Celsius", " fifty degrees Celsius"]),
      ("The largest planet in the Solar System is", [" Jupiter", " Mercury", " Mars", " Venus"]),
      ("A week has", [" seven days", " ten days", " three days"]),
      ("The opposite of hot is", [" cold", " warm", " loud"]),
      ("Bees make", [" honey", " milk", " steel"])]
with open(f"{d}/mc.jsonl", "w") as f:
    for q, c in qs:
        f.write(json.dumps({"question": q, "choices": c, "label": 0}) + "\n")
common = "dataset_path: json\ntest_split: test\n"
open(f"{d}/spinfer_wiki.yaml", "w").write(
    f"task: spinfer_wiki\n{common}dataset_kwargs:\n  data_files:\n    test: {d}/wiki.jsonl\n"
    "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{page}}\"\n"
    "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
open(f"{d}/spinfer_mc.yaml", "w").write(
    f"task: spinfer_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {d}/mc.jsonl\n"
    "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
    "doc_to_target: label\ntarget_delimiter: \"\"\nmetric_list:\n  - metric: acc\n")
PY
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 OPENAI_API_KEY=none
tasks=(--tasks spinfer_mc,spinfer_wiki --include_path "$tmp")

cat > "$tmp/spinfer.toml" <<TOML
[model]
path = "$model"
threads = 2
ctx = 2048
precision = "$precision"
[server]
port = 0
slots = 2
TOML
"$spinfer" serve --config "$tmp/spinfer.toml" > "$tmp/serve.out" 2> "$tmp/serve.log" &
server=$!
for _ in $(seq 100); do grep -q http:// "$tmp/serve.out" && break; sleep 0.2; done
addr="$(grep -o 'http://[^ ]*' "$tmp/serve.out")"
name="$(basename "${model%.*}")"
echo "== spinfer serve ($precision) at $addr"
"$lm_eval" --model local-completions \
    --model_args "model=$name,base_url=$addr/v1/completions,num_concurrent=1,max_retries=1,tokenized_requests=True,max_length=2048" \
    "${tasks[@]}" 2>&1 | grep '^|'

if [[ $hf -eq 1 ]]; then
    "$spinfer" convert -m "$model" -o "$tmp/hf" > /dev/null
    echo "== lm-eval's Hugging Face backend, f32, on the dequantised weights"
    # add_bos_token=False: lm-eval puts the BOS before each rolling window
    # itself (as for the server); the tokenizer's own would make it two.
    "$lm_eval" --model hf --model_args "pretrained=$tmp/hf,dtype=float32,add_bos_token=False" --device cpu --batch_size 1 \
        "${tasks[@]}" 2>&1 | grep '^|'
fi
