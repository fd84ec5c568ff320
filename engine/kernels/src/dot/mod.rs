//! Dot products between weight rows and activation rows.
//!
//! * [`scalar`]: the portable reference for every supported pair, operating
//!   on GGUF weight bytes and GGML activation blocks; fast mode mirrors
//!   ggml's `ggml_vec_dot_*_generic`, precise mode dequantises and
//!   accumulates in f32.
//! * x86-64 only, crate-private: tile kernels that dot `R` weight rows with
//!   `T` activation rows at once, reading activations in the packed layouts
//!   of [`crate::quantize`]: `avx512` (Q4_0/Q4_1/Q5_0/Q5_1, two blocks per
//!   512-bit `vpdpbusd`), `avx512_ymm` (Q8_0, one block per 256-bit
//!   `vpdpbusd`), `avx512_k` (Q4_K/Q5_K/Q6_K), `avx2` and `avx2_k` (the same
//!   with `vpmaddubsw`), `avx2_16` (the 32-element formats against one
//!   16-bit activation plane, [`crate::q16`], with `vpmaddwd`), and
//!   `f32simd` (precise mode, AVX-512 and AVX2).
//!   [`ternary`] (the `spinfer-ternary` crate) holds the TQ1_0/TQ2_0/I2_S
//!   kernels (scalar, AVX2, AVX-512) and the I2_S layout.
//!   They are `#[target_feature]` functions; [`crate::matmul`] selects them
//!   at run time from [`crate::cpu::CpuFeatures`] and the tests check them
//!   against [`scalar`].

pub mod scalar;
pub use spinfer_ternary as ternary;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_16;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_k;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_k;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_ymm;
#[cfg(target_arch = "x86_64")]
pub(crate) mod f32simd;

pub use scalar::*;

#[cfg(target_arch = "x86_64")]
pub(crate) use spinfer_kernel_base::drive::{f16_at, hsum8};

/// Writes `out[t * out_stride + r] = hsum8(acc[r][t])`: a tile's results.
///
/// # Safety
/// `out` must be valid for those `R * T` writes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn store_tile<const R: usize, const T: usize>(
    acc: &[[std::arch::x86_64::__m256; T]; R],
    out: *mut f32,
    out_stride: usize,
) {
    for (r, row) in acc.iter().enumerate() {
        for (t, &v) in row.iter().enumerate() {
            // SAFETY: the caller guarantees `out` covers these positions.
            unsafe { *out.add(t * out_stride + r) = hsum8(v) };
        }
    }
}

/// Weight formats of the 32-element family, as const-generic tags for the
/// SIMD tile kernels.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) mod fmt {
    pub const Q4_0: u8 = 0;
    pub const Q4_1: u8 = 1;
    pub const Q5_0: u8 = 2;
    pub const Q5_1: u8 = 3;
    pub const Q8_0: u8 = 4;

    /// Bytes per block.
    pub const fn block_bytes(f: u8) -> usize {
        match f {
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            _ => 34,
        }
    }

    /// Whether the format has a per-block minimum `m` (`x = d q + m`).
    pub const fn has_min(f: u8) -> bool {
        matches!(f, Q4_1 | Q5_1)
    }

    /// Offset subtracted from the stored unsigned quant (Q4_0: 8, Q5_0: 16),
    /// or added to make a signed quant unsigned (Q8_0: 128, 512-bit kernels
    /// only); folded into the activations' `corr` lanes.
    pub const fn offset(f: u8) -> i32 {
        match f {
            Q4_0 => 8,
            Q5_0 => 16,
            Q8_0 => 128,
            _ => 0,
        }
    }
}
