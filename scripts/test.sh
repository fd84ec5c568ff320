#!/usr/bin/env bash
# The whole test suite, as CI runs it: fetch models, check formatting and
# lints, then run every test in release (model-level tests are too slow in
# debug builds).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh
rustup target add wasm32-unknown-unknown
kernels-wasm/build.sh target/wasm-packs/spinfer_kernels_wasm.wasm
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --release -- -D warnings
cargo test --workspace --release
