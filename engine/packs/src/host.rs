//! What the host tells packs about itself (its version, this machine's CPU
//! features and cores) and how its types map to the ABI's catalogues.

use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::ActType as KActType;
use spinfer_plugin_api::{ActType, CpuFeatureSet, HostInfo, WeightType};

/// The version of this engine, as packs see it (`min_host_version`).
pub const HOST_VERSION: &str = env!("CARGO_PKG_VERSION");

/// What the engine tells packs about itself and this machine: the CPU
/// features `spinfer-kernels` detects, this engine's version and the
/// logical cores available to the process.
pub fn host_info() -> HostInfo {
    let f = CpuFeatures::detect();
    let mut set = CpuFeatureSet::empty();
    for (on, bit) in [
        (f.avx2, CpuFeatureSet::AVX2),
        (f.fma, CpuFeatureSet::FMA),
        (f.f16c, CpuFeatureSet::F16C),
        (f.avx512f, CpuFeatureSet::AVX512F),
        (f.avx512bw, CpuFeatureSet::AVX512BW),
        (f.avx512vl, CpuFeatureSet::AVX512VL),
        (f.avx512vnni, CpuFeatureSet::AVX512VNNI),
    ] {
        if on {
            set = set.with(bit);
        }
    }
    let n_cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    HostInfo {
        host_version: format!("spinfer {HOST_VERSION}").into(),
        cpu_features: set,
        n_cores: u32::try_from(n_cores).unwrap_or(u32::MAX),
    }
}

/// The ABI catalogue id of a `spinfer-kernels` weight type (both are GGML
/// type ids).
pub fn abi_weight_type(t: GgmlType) -> WeightType {
    WeightType(t as u32)
}

/// The `spinfer-kernels` type of an ABI catalogue weight type; `None` for
/// extension types such as `I2_S`, which have no GGML id.
pub fn ggml_type(w: WeightType) -> Option<GgmlType> {
    w.ggml_id().and_then(GgmlType::from_u32)
}

/// The ABI catalogue id of a `spinfer-kernels` activation type.
pub fn abi_act_type(a: KActType) -> ActType {
    match a {
        KActType::F32 => ActType::F32,
        KActType::Q8_0 => ActType::Q8_0,
        KActType::Q8_1 => ActType::Q8_1,
        KActType::Q8_K => ActType::Q8_K,
        KActType::Q16 => ActType::Q16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_info_matches_detection() {
        let h = host_info();
        assert_eq!(h.host_version.as_str(), concat!("spinfer ", env!("CARGO_PKG_VERSION")));
        assert!(h.n_cores >= 1);
        // The kernels' view of the CPU, capped by SPINFER_CPU: all of it
        // without a cap, a part of it with one.
        let cpu = CpuFeatureSet::detect();
        assert!(cpu.contains(h.cpu_features), "{} not within {cpu}", h.cpu_features);
        if spinfer_kernels::cpu::IsaCap::from_env() == spinfer_kernels::cpu::IsaCap::Native {
            assert_eq!(h.cpu_features, cpu);
        }
    }

    #[test]
    fn catalogue_ids_match_ggml() {
        assert_eq!(abi_weight_type(GgmlType::Q4_1), WeightType::Q4_1);
        assert_eq!(abi_weight_type(GgmlType::Q8_0), WeightType::Q8_0);
        assert_eq!(abi_weight_type(GgmlType::Q4_K), WeightType::Q4_K);
        assert_eq!(abi_weight_type(GgmlType::BF16), WeightType::BF16);
        for (k, a) in [
            (KActType::F32, ActType::F32),
            (KActType::Q8_0, ActType::Q8_0),
            (KActType::Q8_1, ActType::Q8_1),
            (KActType::Q8_K, ActType::Q8_K),
            (KActType::Q16, ActType::Q16),
        ] {
            assert_eq!(abi_act_type(k), a);
            assert_eq!(a.name(), Some(k.name()));
        }
    }
}
