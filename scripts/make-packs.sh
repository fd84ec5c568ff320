#!/usr/bin/env bash
# Builds the shipped kernel packs from source into signed pack directories:
#   scripts/make-packs.sh OUT_DIR KEY_NAME
# OUT_DIR/{cpu-portable,cpu-simd,wasm-simd128,kernels-cuda}/ each get the artefact, a
# pack.toml pinning its sha256, and pack.sig signed with KEY_NAME.key
# (created with `spinfer pack keygen` when absent). Trust KEY_NAME.pub in
# the operator config's `packs.trusted_keys` and list OUT_DIR in
# `packs.dirs`. The WASM pack's build (kernels-wasm/build.sh) installs the
# wasm32 target through rustup when it is missing.
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: $0 OUT_DIR KEY_NAME" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
out=$1
key=$2
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
cargo build --release --quiet -p spinfer-cli -p spinfer-pack-cpu-portable -p spinfer-pack-cpu-simd
# Honour CARGO_TARGET_DIR, so the artefacts are the ones just built.
bin=${CARGO_TARGET_DIR:-target}/release
spinfer=$bin/spinfer
[ -f "$key.key" ] || "$spinfer" pack keygen --name "$(basename "$key")" --dir "$(dirname "$key")"

# pack NAME KIND ARTEFACT DESCRIPTION KERNEL...   (kernel: name:weight:act[:op], op defaults to matmul)
pack() {
    local name=$1 kind=$2 artefact=$3 description=$4
    shift 4
    local dir="$out/$name" file
    file=$(basename "$artefact")
    mkdir -p "$dir"
    cp "$artefact" "$dir/$file"
    {
        echo "name = \"$name\""
        echo "version = \"$version\""
        echo "abi_version = 1"
        echo "kind = \"$kind\""
        echo "min_host_version = \"$version\""
        echo "description = \"$description\""
        echo
        echo "[artefact]"
        echo "file = \"$file\""
        echo "sha256 = \"$(sha256sum "$dir/$file" | cut -d' ' -f1)\""
        for k in "$@"; do
            IFS=: read -r kname w a op <<<"$k"
            printf '\n[[kernels]]\nname = "%s"\nop = "%s"\nweight = "%s"\nact = "%s"\n' "$kname" "${op:-matmul}" "$w" "$a"
        done
    } >"$dir/pack.toml"
    "$spinfer" pack sign --key "$key.key" "$dir" >&2
}

pack cpu-portable native "$bin/libspinfer_pack_cpu_portable.so" \
    "scalar reference kernels" q4_0:q4_0:q8_0 q4_1:q4_1:q8_1 q8_0:q8_0:q8_0 q4_k:q4_k:q8_k q6_k:q6_k:q8_k \
    tq1_0:tq1_0:q8_k tq2_0:tq2_0:q8_k i2_s:i2_s:q8_k:ternary_matmul
pack cpu-simd native "$bin/libspinfer_pack_cpu_simd.so" \
    "AVX2 and AVX-512 (VNNI) quantised matmul kernels" q4_0:q4_0:q8_0 q4_1:q4_1:q8_1 q8_0:q8_0:q8_0 q4_k:q4_k:q8_k q6_k:q6_k:q8_k \
    tq1_0:tq1_0:q8_k tq2_0:tq2_0:q8_k i2_s:i2_s:q8_k:ternary_matmul
kernels-wasm/build.sh target/wasm-packs/spinfer_kernels_wasm.wasm
pack wasm-simd128 wasm target/wasm-packs/spinfer_kernels_wasm.wasm \
    "WebAssembly simd128 f32-activation kernels" f32:f32:f32 q4_1:q4_1:f32 q8_0:q8_0:f32
# The CUDA pack ships CUDA C, compiled by the host's NVRTC for its GPU on
# first use (ABI spinfer_kernels_cuda::PACK_ABI_VERSION): the product kernels'
# source, as spinfer_kernels_cuda::products_source() assembles it.
mkdir -p target/cuda-pack
cu=kernels-cuda/src/cu
{ cat $cu/common.cuh; echo; cat $cu/formats.cuh; echo; cat $cu/gemv.cu; echo; } >target/cuda-pack/kernels.cu
pack kernels-cuda cuda target/cuda-pack/kernels.cu \
    "CUDA GEMV and GEMM on GGUF blocks, f32 activations (NVRTC at load)" \
    cuda_q4_0:q4_0:f32 cuda_q4_1:q4_1:f32 cuda_q5_0:q5_0:f32 cuda_q5_1:q5_1:f32 cuda_q8_0:q8_0:f32 \
    cuda_q4_k:q4_k:f32 cuda_q5_k:q5_k:f32 cuda_q6_k:q6_k:f32 cuda_tq1_0:tq1_0:f32 cuda_tq2_0:tq2_0:f32
echo "packs in $out, signed with $key.pub: $(cat "$key.pub")" >&2
