//! `cpu-simd`: spinfer's AVX2 and AVX-512 (VNNI) kernels as a native pack.
//!
//! It offers, through the native pack ABI of `spinfer-plugin-api`, the SIMD
//! matmul kernels of `spinfer-kernels` (every candidate that
//! `spinfer_kernels::matmul::candidates` lists on the running CPU, minus the
//! scalar references, plus the I2_S kernels of
//! `spinfer_kernels::dot::ternary`) for every (weight type, activation type)
//! pair they support: one kernel per (instruction set, pair), serving
//! [`Op::MAT_MUL`](spinfer_plugin_api::Op::MAT_MUL) (I2_S:
//! `TERNARY_MAT_MUL`) for any number of tokens, named as `spinfer-kernels`
//! names them (`"avx512/q4_1*q8_1"`, `"avx2/tq2_0*q8_K"`).
//!
//! The adapter between `spinfer-kernels` and the ABI is shared with
//! `cpu-portable` in `spinfer-pack-kit`; this crate says only what differs:
//! its name, which kernels ([`PACK`]) and its score.
//!
//! `score` follows ggml's CPU-variant score: 0 on a host without
//! AVX2 + FMA + F16C (the reason is logged through `tracing`, and available
//! from [`unsupported_reason`]), otherwise a bit mask, `1 << 5` for AVX2 plus
//! `1 << 6` for AVX-512 F/BW/VL/VNNI, so it always beats the portable pack's 1.
//!
//! Kernels run single-threaded on the calling thread: the host's thread pool
//! does not cross the ABI (see README.md).
//!
//! Built as `cdylib` (what the host loads) and `rlib` (so tests can call
//! [`instantiate_root_module`] in process).

use spinfer_kernels::cpu::CpuFeatures;
use spinfer_pack_kit::CpuPack;
use spinfer_plugin_api::abi_stable::sabi_extern_fn;
use spinfer_plugin_api::{ActType, CpuFeatureSet, HostInfo, WeightType};

pub use spinfer_pack_kit::{ggml_type, kernel_act};

/// The pack's name as reported to the host.
pub const PACK_NAME: &str = "cpu-simd";

/// Score bit of a host with AVX2 + FMA + F16C (what the AVX2 kernels need).
pub const SCORE_AVX2: u32 = 1 << 5;
/// Score bit added for AVX-512 F/BW/VL/VNNI (what the AVX-512 kernels need).
pub const SCORE_AVX512: u32 = 1 << 6;

/// The kernels served: the AVX-512 and AVX2 candidates of `spinfer-kernels`
/// on the CPU the pack runs on.
pub const PACK: CpuPack = CpuPack { name: PACK_NAME, features: CpuFeatures::detect, isas: &["avx512", "avx2"] };

/// The features the AVX2 kernels need.
const NEED_AVX2: [(CpuFeatureSet, &str); 3] =
    [(CpuFeatureSet::AVX2, "avx2"), (CpuFeatureSet::FMA, "fma"), (CpuFeatureSet::F16C, "f16c")];
/// The features the AVX-512 kernels need on top of [`NEED_AVX2`].
const NEED_AVX512: [CpuFeatureSet; 4] =
    [CpuFeatureSet::AVX512F, CpuFeatureSet::AVX512BW, CpuFeatureSet::AVX512VL, CpuFeatureSet::AVX512VNNI];

spinfer_pack_kit::export_cpu_pack!(PACK, score);

/// Why the pack cannot run on a host with `features`; `None` if it can.
pub fn unsupported_reason(features: CpuFeatureSet) -> Option<String> {
    let missing: Vec<&str> = NEED_AVX2.iter().filter(|(b, _)| !features.contains(*b)).map(|(_, n)| *n).collect();
    if missing.is_empty() {
        None
    } else {
        Some(format!("{PACK_NAME} needs avx2, fma and f16c; this cpu lacks {} (has: {features})", missing.join(", ")))
    }
}

/// The score for a host with `features` (see the crate documentation).
pub fn score_for(features: CpuFeatureSet) -> u32 {
    if unsupported_reason(features).is_some() {
        return 0;
    }
    let mut s = SCORE_AVX2;
    if NEED_AVX512.iter().all(|b| features.contains(*b)) {
        s += SCORE_AVX512;
    }
    s
}

#[sabi_extern_fn]
fn score(host: &HostInfo) -> u32 {
    // Cannot panic, so nothing to catch: it only tests bits and formats.
    if let Some(why) = unsupported_reason(host.cpu_features) {
        tracing::info!(pack = PACK_NAME, "scores 0: {why}");
        return 0;
    }
    score_for(host.cpu_features)
}

/// Every (instruction set, weight type, activation type) the SIMD kernels
/// of `spinfer-kernels` serve on this CPU: catalogue order of the pairs,
/// best instruction set first within a pair. Empty on a CPU without AVX2.
pub fn supported_kernels() -> Vec<(String, WeightType, ActType)> {
    PACK.supported_kernels()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(bits: &[CpuFeatureSet]) -> CpuFeatureSet {
        bits.iter().fold(CpuFeatureSet::empty(), |s, b| s.with(*b))
    }

    #[test]
    fn scores_like_ggml() {
        let avx2 = set(&[CpuFeatureSet::AVX2, CpuFeatureSet::FMA, CpuFeatureSet::F16C]);
        assert_eq!(score_for(CpuFeatureSet::empty()), 0);
        assert_eq!(score_for(set(&[CpuFeatureSet::AVX2, CpuFeatureSet::FMA])), 0);
        assert_eq!(score_for(avx2), SCORE_AVX2);
        let avx512 = NEED_AVX512.iter().fold(avx2, |s, b| s.with(*b));
        assert_eq!(score_for(avx512), SCORE_AVX2 + SCORE_AVX512);
        // AVX-512 without VNNI is scored as AVX2 (the kernels need VNNI).
        assert_eq!(score_for(avx2.with(CpuFeatureSet::AVX512F).with(CpuFeatureSet::AVX512BW)), SCORE_AVX2);
        let why = unsupported_reason(set(&[CpuFeatureSet::AVX2])).unwrap();
        assert!(why.contains("lacks fma, f16c"), "{why}");
        assert!(unsupported_reason(avx2).is_none());
    }
}
