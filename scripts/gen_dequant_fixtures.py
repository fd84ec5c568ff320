#!/usr/bin/env python3
"""Generate the dequantisation fixtures for `engine/kernels/tests/dequant_fixtures.rs`.

For every GGML type that the PyPI `gguf` package can dequantise, this writes a
few blocks of seeded random bytes together with the f32 values that
`gguf.quants.dequantize` (numpy) produces for them. The Rust test checks
`spinfer_kernels::dequant::dequantize_row` against these bit for bit, so it
needs no Python at test time.

Requirements: `pip install numpy gguf` (generated with gguf 0.19.0).

Usage (from the repository root):

    python3 scripts/gen_dequant_fixtures.py [--out engine/kernels/tests/fixtures/dequant]

File format, one file `<type>.bin` per type, all integers little-endian:

    magic    4 bytes  b"SPDQ"
    type     u32      GGML type id (e.g. 12 for q4_K)
    n        u32      number of elements (a multiple of the block size)
    nbytes   u32      number of source bytes (= n / block_size * type_size)
    src      nbytes   raw blocks, exactly as stored in a GGUF file
    expected n * 4    f32 values from gguf.quants.dequantize

How the random bytes are chosen:

* Every byte of every block starts uniformly random (numpy PCG64, fixed seed).
* Scale fields of f16 type (`d`, `m`, `dmin` depending on the format) are then
  overwritten with *finite, moderate* f16 values: random sign and mantissa, and
  a biased exponent in 0..=20 (so |x| < 2^6, subnormals and zeros included, no
  Inf/NaN). Without this roughly 1 in 32 blocks would carry an Inf/NaN scale and
  produce NaN outputs whose payloads say nothing about the dequantiser.
* Quantised payloads (nibbles, high bits, packed 6-bit scales, int8 scales,
  ternary digits) stay fully random, which exercises every bit position.
* F32 rows are raw random 32-bit patterns (NaNs included; a plain copy).
* F16 and BF16 rows are raw random 16-bit patterns plus a hand-picked list of
  specials (zeros, subnormals, extremes, infinities, quiet and signalling NaNs).
  Note: numpy converts a signalling f16 NaN to f32 *without* setting the quiet
  bit (it shifts the payload), whereas ggml (F16C `vcvtph2ps` or its software
  path) and the `half` crate return the quieted NaN. The Rust test accepts the
  quieted form for signalling-NaN inputs of F16 and is bit-exact everywhere
  else. BF16 is a plain shift in both, so it is bit-exact including NaNs.
"""

from __future__ import annotations

import argparse
import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

SEED = 0x5EED_DE0A

# Byte offsets of the f16 scale fields inside each block (see ggml-common.h).
F16_SCALE_OFFSETS: dict[T, list[int]] = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [16 + 64, 16 + 64 + 2],  # scales[16], qs[64], d, dmin
    T.Q3_K: [32 + 64 + 12],  # hmask[32], qs[64], scales[12], d
    T.Q4_K: [0, 2],  # d, dmin, scales[12], qs[128]
    T.Q5_K: [0, 2],  # d, dmin, scales[12], qh[32], qs[128]
    T.Q6_K: [128 + 64 + 16],  # ql[128], qh[64], scales[16], d
    T.TQ1_0: [48 + 4],  # qs[48], qh[4], d
    T.TQ2_0: [64],  # qs[64], d
}

# Blocks per fixture: enough to cover several random scale/payload combinations
# while keeping the files small.
N_BLOCKS_SMALL = 16  # 32-element formats -> 512 elements
N_BLOCKS_K = 4  # 256-element formats -> 1024 elements
N_FLOAT = 1024  # F32/F16/BF16 elements (including the specials)

F16_SPECIALS = [
    0x0000, 0x8000,  # +-0
    0x0001, 0x8001, 0x03FF, 0x83FF,  # subnormals
    0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF,  # min normal, +-1, +-max
    0x7C00, 0xFC00,  # +-inf
    0x7E00, 0xFE00, 0x7FFF,  # quiet NaNs
    0x7C01, 0xFC01, 0x7D55,  # signalling NaNs
]
BF16_SPECIALS = [
    0x0000, 0x8000, 0x0001, 0x007F, 0x0080, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F,
    0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF,
]


def moderate_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n finite f16 bit patterns with |x| < 2^6 (exponent field 0..=20)."""
    sign = rng.integers(0, 2, n, dtype=np.uint16) << 15
    exp = rng.integers(0, 21, n, dtype=np.uint16) << 10
    man = rng.integers(0, 1 << 10, n, dtype=np.uint16)
    return (sign | exp | man).astype(np.uint16)


def quant_fixture(rng: np.random.Generator, qtype: T) -> tuple[np.ndarray, np.ndarray]:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = N_BLOCKS_K if block_size == 256 else N_BLOCKS_SMALL
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for off in F16_SCALE_OFFSETS[qtype]:
        blocks[:, off : off + 2] = moderate_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    src = blocks.reshape(-1)
    out = dequantize(src.copy(), qtype).astype(np.float32, copy=False).reshape(-1)
    assert out.size == n_blocks * block_size
    assert np.isfinite(out).all(), qtype.name
    return src, out


def float_fixture(rng: np.random.Generator, qtype: T) -> tuple[np.ndarray, np.ndarray]:
    if qtype == T.F32:
        bits = rng.integers(0, 1 << 32, N_FLOAT, dtype=np.uint64).astype(np.uint32)
        src = bits.view(np.uint8)
    else:
        specials = F16_SPECIALS if qtype == T.F16 else BF16_SPECIALS
        bits = rng.integers(0, 1 << 16, N_FLOAT, dtype=np.uint32).astype(np.uint16)
        bits[: len(specials)] = specials
        src = bits.view(np.uint8)
    out = dequantize(src.copy(), qtype).astype(np.float32, copy=False).reshape(-1)
    assert out.size == N_FLOAT
    return src, out


def write_fixture(path: Path, qtype: T, src: np.ndarray, out: np.ndarray) -> None:
    header = b"SPDQ" + struct.pack("<III", int(qtype), out.size, src.size)
    path.write_bytes(header + src.astype(np.uint8).tobytes() + out.astype("<f4").tobytes())


def main() -> None:
    default_out = Path(__file__).resolve().parent.parent / "engine/kernels/tests/fixtures/dequant"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=default_out)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    rng = np.random.default_rng(SEED)
    total = 0
    for qtype in [T.F32, T.F16, T.BF16]:
        src, out = float_fixture(rng, qtype)
        path = args.out / f"{qtype.name.lower()}.bin"
        write_fixture(path, qtype, src, out)
        total += path.stat().st_size
    for qtype in F16_SCALE_OFFSETS:
        src, out = quant_fixture(rng, qtype)
        path = args.out / f"{qtype.name.lower()}.bin"
        write_fixture(path, qtype, src, out)
        total += path.stat().st_size
    print(f"wrote {len(F16_SCALE_OFFSETS) + 3} fixtures, {total} bytes, to {args.out}")


if __name__ == "__main__":
    main()
