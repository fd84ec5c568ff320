#!/usr/bin/env bash
# Builds the WebAssembly kernel pack and copies the module to $1.
#   kernels-wasm/build.sh target/wasm-packs/spinfer_kernels_wasm.wasm
# Installs the wasm32 target through rustup when it is missing, so this
# (and scripts/make-packs.sh, scripts/test.sh) works on a fresh machine.
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
if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown; then
    echo "installing the wasm32-unknown-unknown target (rustup)" >&2
    rustup target add wasm32-unknown-unknown >&2
fi
# The crate's own .cargo/config.toml selects the target and simd128.
cargo build --release --quiet
mkdir -p "$(dirname "$out")"
cp target/wasm32-unknown-unknown/release/spinfer_kernels_wasm.wasm "$out"
