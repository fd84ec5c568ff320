//! What the kernel tests share: the device (or why there is none) and the
//! CPU reference dequantisation of every format.

#![allow(dead_code, reason = "each test binary uses part of it")]

use std::sync::OnceLock;

use spinfer_kernels::GgmlType;
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::dot::ternary::dequantize_row_i2s;
use spinfer_kernels_cuda::{CudaBackend, WeightFormat};

pub fn backend() -> Option<&'static CudaBackend> {
    static B: OnceLock<Result<CudaBackend, String>> = OnceLock::new();
    match B.get_or_init(|| CudaBackend::new().map_err(|e| e.to_string())) {
        Ok(b) => Some(b),
        Err(why) => {
            assert!(std::env::var("SPINFER_EXPECT_GPU").as_deref() != Ok("1"), "SPINFER_EXPECT_GPU=1 but: {why}");
            eprintln!("skipped: {why}");
            None
        }
    }
}

/// The matrix dequantised on the CPU, row by row.
pub fn dequantize(format: WeightFormat, bytes: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let rb = format.row_bytes(cols).unwrap();
    let mut out = vec![0f32; rows * cols];
    for (src, dst) in bytes.chunks_exact(rb).zip(out.chunks_exact_mut(cols)) {
        let ty = match format {
            WeightFormat::Q4_0 => GgmlType::Q4_0,
            WeightFormat::Q4_1 => GgmlType::Q4_1,
            WeightFormat::Q5_0 => GgmlType::Q5_0,
            WeightFormat::Q5_1 => GgmlType::Q5_1,
            WeightFormat::Q8_0 => GgmlType::Q8_0,
            WeightFormat::Q4_K => GgmlType::Q4_K,
            WeightFormat::Q5_K => GgmlType::Q5_K,
            WeightFormat::Q6_K => GgmlType::Q6_K,
            WeightFormat::TQ1_0 => GgmlType::TQ1_0,
            WeightFormat::TQ2_0 => GgmlType::TQ2_0,
            WeightFormat::I2_S => {
                dequantize_row_i2s(src, dst).unwrap();
                continue;
            }
        };
        dequantize_row(ty, src, dst).unwrap();
    }
    out
}

/// `got` equals `want` (f64 sums) within f32 accumulation error: `rel`
/// times the sum of |w x| of each output (`mag`), plus 1e-6.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], mag: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, ((&g, &w), &m)) in got.iter().zip(want).zip(mag).enumerate() {
        let tol = rel * m + 1e-6;
        assert!(
            g.is_finite() && (f64::from(g) - w).abs() <= tol,
            "{what}: output {i} is {g}, want {w} (tol {tol:.2e})"
        );
    }
}
