//! Checks shared by the in-process and the dlopen tests: the checks every
//! CPU pack passes (`spinfer_pack_kit::testing`), plus this pack's own: it
//! scores as ggml's CPU variants do and lists the SIMD kernels of this CPU.

// The host as the engine describes it to packs: the kernels' view of the
// CPU, capped by SPINFER_CPU like the kernels themselves.
use spinfer_engine::packs::host_info;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_pack_cpu_simd::{PACK, SCORE_AVX2, SCORE_AVX512};
use spinfer_pack_kit::testing;
use spinfer_plugin_api::{CpuFeatureSet, HostInfo, PackModuleRef};

fn host(features: CpuFeatureSet) -> HostInfo {
    HostInfo { host_version: "spinfer-test".into(), cpu_features: features, n_cores: 2 }
}

/// Every check of a loaded root module.
pub fn check_module(module: PackModuleRef) {
    // Scores: 0 without AVX2 + FMA + F16C, more with AVX-512, always > 1.
    let score = module.score();
    assert_eq!(score(&host(CpuFeatureSet::empty())), 0);
    assert_eq!(score(&host(CpuFeatureSet::FMA.with(CpuFeatureSet::F16C))), 0, "no avx2");
    let avx2 = CpuFeatureSet::AVX2.with(CpuFeatureSet::FMA).with(CpuFeatureSet::F16C);
    assert_eq!(score(&host(avx2)), SCORE_AVX2);
    let avx512 = avx2
        .with(CpuFeatureSet::AVX512F)
        .with(CpuFeatureSet::AVX512BW)
        .with(CpuFeatureSet::AVX512VL)
        .with(CpuFeatureSet::AVX512VNNI);
    assert_eq!(score(&host(avx512)), SCORE_AVX2 + SCORE_AVX512);
    assert!(score(&host(avx2)) > 1);

    let kernels = testing::check_module(module, &PACK);
    let features = CpuFeatures::detect();
    if !features.has_avx2() {
        assert!(kernels.is_empty(), "no SIMD kernels on a cpu without avx2");
        assert_eq!(score(&host_info()), 0);
        return;
    }
    assert!(score(&host_info()) >= SCORE_AVX2);

    let names: Vec<String> = kernels.iter().map(|k| k.describe().name.to_string()).collect();
    let mut want = vec!["avx2/q4_1*q8_1", "avx2/q8_0*q8_0", "avx2/tq1_0*q8_K", "avx2/tq2_0*q8_K", "avx2/i2_s*q8_K"];
    if features.has_avx512() {
        want.extend(["avx512/q4_1*q8_1", "avx512/q8_0*q8_0", "avx512/tq2_0*q8_K", "avx512/i2_s*q8_K"]);
    }
    for n in want {
        assert!(names.iter().any(|m| m == n), "{n} missing from {names:?}");
    }
    assert!(!names.iter().any(|n| n.starts_with("scalar/")), "{names:?}");
}
