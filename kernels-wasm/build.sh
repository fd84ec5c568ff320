#!/usr/bin/env bash
# Builds the WebAssembly kernel pack and copies the module to $1.
#   kernels-wasm/build.sh target/wasm-packs/spinfer_kernels_wasm.wasm
# Needs the wasm32 target: `rustup target add wasm32-unknown-unknown`.
set -euo pipefail
if [ $# -ne 1 ]; then
    echo "usage: $0 OUT.wasm" >&2
    exit 2
fi
out=$1
case "$out" in
    /*) ;;
    *) out="$PWD/$out" ;;
esac
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"
# The crate's own .cargo/config.toml selects the target and simd128.
cargo build --release --quiet
mkdir -p "$(dirname "$out")"
cp target/wasm32-unknown-unknown/release/spinfer_kernels_wasm.wasm "$out"
