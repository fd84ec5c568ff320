//! Random weight matrices in every format, for tests and benchmarks: random
//! code bytes with every scale field overwritten by a finite value, so the
//! matrix decodes to ordinary numbers (random f16 bits could be NaN).

use crate::{Result, WeightFormat};

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
}

/// Byte offsets of the f16 scale fields in one block.
fn f16_fields(format: WeightFormat) -> &'static [usize] {
    match format {
        WeightFormat::Q4_0 | WeightFormat::Q5_0 | WeightFormat::Q8_0 => &[0],
        WeightFormat::Q4_1 | WeightFormat::Q5_1 | WeightFormat::Q4_K | WeightFormat::Q5_K => &[0, 2],
        WeightFormat::Q6_K => &[208],
        WeightFormat::TQ1_0 => &[52],
        WeightFormat::TQ2_0 => &[64],
        WeightFormat::I2_S => &[],
    }
}

/// `rows x cols` weights in `format`, reproducible from `seed`.
///
/// # Errors
///
/// [`crate::CudaError::Shape`] when `cols` is not a multiple of the block.
pub fn synthetic_matrix(format: WeightFormat, rows: usize, cols: usize, seed: u64) -> Result<Vec<u8>> {
    let row_bytes = format.row_bytes(cols)?;
    let mut rng = Rng(seed);
    let mut out = vec![0u8; rows * row_bytes];
    for chunk in out.chunks_mut(8) {
        let r = rng.next().to_le_bytes();
        chunk.copy_from_slice(&r[..chunk.len()]);
    }
    let bb = format.block_bytes();
    for row in out.chunks_exact_mut(row_bytes) {
        if format == WeightFormat::I2_S {
            let s = rng.uniform(0.01, 0.05);
            row[row_bytes - 4..].copy_from_slice(&s.to_le_bytes());
            continue;
        }
        for blk in row.chunks_exact_mut(bb) {
            for &off in f16_fields(format) {
                let v = half::f16::from_f32(rng.uniform(-0.02, 0.02));
                blk[off..off + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
    }
    Ok(out)
}

/// `n` activations uniform in [-1, 1), reproducible from `seed`.
pub fn synthetic_acts(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed ^ 0xA5A5_5A5A);
    (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect()
}
