//! Bit-exact check of `dequantize_row` against fixtures produced by the PyPI
//! `gguf` package's numpy dequantisers (`scripts/gen_dequant_fixtures.py`,
//! which documents the file format and how the random blocks are chosen).

use std::path::PathBuf;

use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::{GgmlType, KernelError};

struct Fixture {
    ty: GgmlType,
    src: Vec<u8>,
    expected: Vec<f32>,
}

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dequant")
}

fn read_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
}

fn load(name: &str) -> Fixture {
    let path = fixture_dir().join(format!("{name}.bin"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..4], b"SPDQ", "{name}: bad magic");
    let ty = GgmlType::from_u32(read_u32(&bytes, 4)).expect("known type");
    let n = read_u32(&bytes, 8) as usize;
    let nbytes = read_u32(&bytes, 12) as usize;
    assert_eq!(bytes.len(), 16 + nbytes + 4 * n, "{name}: file size");
    let src = bytes[16..16 + nbytes].to_vec();
    let expected = bytes[16 + nbytes..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    Fixture { ty, src, expected }
}

/// Types with a fixture; the file name is the lowercase GGML name.
const FIXTURE_TYPES: [GgmlType; 15] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
];

/// True for an f16 signalling NaN (exponent all ones, mantissa non-zero with
/// the quiet bit clear).
fn is_f16_snan(bits: u16) -> bool {
    bits & 0x7C00 == 0x7C00 && bits & 0x03FF != 0 && bits & 0x0200 == 0
}

fn check(fx: &Fixture, src: &[u8]) {
    let ty = fx.ty;
    let mut got = vec![f32::NAN; fx.expected.len()];
    dequantize_row(ty, src, &mut got).unwrap_or_else(|e| panic!("{ty}: {e}"));
    let mut mismatches = 0;
    for (i, (g, e)) in got.iter().zip(&fx.expected).enumerate() {
        let mut want = e.to_bits();
        // numpy keeps f16 signalling NaNs signalling; ggml (F16C) and `half`
        // quiet them. Accept the quieted form for those inputs only.
        if ty == GgmlType::F16 && is_f16_snan(u16::from_le_bytes([src[2 * i], src[2 * i + 1]])) {
            want |= 0x0040_0000;
        }
        if g.to_bits() != want {
            if mismatches < 8 {
                eprintln!("{ty}[{i}]: got {g:e} ({:#010x}), want {e:e} ({want:#010x})", g.to_bits());
            }
            mismatches += 1;
        }
    }
    assert_eq!(mismatches, 0, "{ty}: {mismatches} of {} elements differ", got.len());
}

#[test]
fn dequantize_matches_gguf_python_bit_exact() {
    for ty in FIXTURE_TYPES {
        let fx = load(&ty.name().to_lowercase());
        assert_eq!(fx.ty, ty);
        assert!(fx.expected.len() >= 4 * ty.block_size(), "{ty}: fixture too small");
        check(&fx, &fx.src);
    }
}

#[test]
fn dequantize_unaligned_source_matches_fixtures() {
    for ty in FIXTURE_TYPES {
        let fx = load(&ty.name().to_lowercase());
        let mut buf = vec![0u8; fx.src.len() + 3];
        for off in 1..4 {
            buf[off..off + fx.src.len()].copy_from_slice(&fx.src);
            check(&fx, &buf[off..off + fx.src.len()]);
        }
    }
}

#[test]
fn block_helpers_match_fixtures() {
    use spinfer_kernels::blocks::{BlockQ4_1, BlockQ4K, BlockQ6K};
    use spinfer_kernels::dequant::{dequantize_block_q4_1, dequantize_block_q4_k, dequantize_block_q6_k};

    let fx = load("q4_1");
    let b: BlockQ4_1 = bytemuck::pod_read_unaligned(&fx.src[20..40]);
    let mut out = [0f32; 32];
    dequantize_block_q4_1(&b, &mut out);
    assert_eq!(out.map(f32::to_bits), <[f32; 32]>::try_from(&fx.expected[32..64]).unwrap().map(f32::to_bits));

    let fx = load("q4_k");
    let b: BlockQ4K = bytemuck::pod_read_unaligned(&fx.src[144..288]);
    let mut out = [0f32; 256];
    dequantize_block_q4_k(&b, &mut out);
    assert!(out.iter().zip(&fx.expected[256..512]).all(|(a, b)| a.to_bits() == b.to_bits()));

    let fx = load("q6_k");
    let b: BlockQ6K = bytemuck::pod_read_unaligned(&fx.src[..210]);
    dequantize_block_q6_k(&b, &mut out);
    assert!(out.iter().zip(&fx.expected[..256]).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn wrong_sizes_are_errors_not_panics() {
    for ty in GgmlType::ALL {
        let bs = ty.block_size();
        let n = 2 * bs;
        let bytes = ty.row_bytes(n).unwrap();
        let mut dst = vec![0f32; n];
        for got in [0, bytes - 1, bytes + 1, 2 * bytes] {
            let src = vec![0u8; got];
            match dequantize_row(ty, &src, &mut dst) {
                Err(KernelError::BufferSize { want, got: g, .. }) => {
                    assert_eq!((want, g), (bytes, got), "{ty}");
                }
                other => panic!("{ty}: {got} bytes gave {other:?}"),
            }
        }
        if bs > 1 {
            let mut dst = vec![0f32; n + 1];
            let src = vec![0u8; bytes];
            assert!(matches!(dequantize_row(ty, &src, &mut dst), Err(KernelError::RowNotBlockAligned { .. })), "{ty}");
        }
        // Garbage bytes of the right size never panic (results may be NaN).
        let src: Vec<u8> = (0..bytes).map(|i| (i * 131 + 7) as u8).collect();
        dequantize_row(ty, &src, &mut dst).unwrap();
    }
}
