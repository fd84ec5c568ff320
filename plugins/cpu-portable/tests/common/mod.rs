//! Checks shared by the in-process and the dlopen tests: the checks every
//! CPU pack passes (`spinfer_pack_kit::testing`), plus this pack's own: it
//! scores 1 and lists the scalar kernel of every pair spinfer-kernels
//! supports.

use spinfer_pack_cpu_portable::{PACK, supported_pairs};
use spinfer_pack_kit::testing;
use spinfer_plugin_api::{ActType, HostInfo, PackModuleRef, WeightType};

/// Every check of a loaded root module.
pub fn check_module(module: PackModuleRef) {
    assert_eq!(module.score()(&HostInfo::detect("spinfer-test")), 1);
    let kernels = testing::check_module(module, &PACK);
    let listed: Vec<(WeightType, ActType)> = kernels
        .iter()
        .map(|k| {
            let d = k.describe();
            assert!(d.name.starts_with("scalar/"), "{}", d.name);
            (d.wtype, d.act)
        })
        .collect();
    assert_eq!(listed, supported_pairs());
    for pair in [
        (WeightType::Q4_1, ActType::Q8_1),
        (WeightType::Q4_1, ActType::F32),
        (WeightType::Q8_0, ActType::Q8_0),
        (WeightType::Q4_K, ActType::Q8_K),
        (WeightType::F16, ActType::F32),
        (WeightType::TQ1_0, ActType::Q8_K),
        (WeightType::TQ2_0, ActType::Q8_K),
        (WeightType::TQ2_0, ActType::F32),
        (WeightType::I2_S, ActType::Q8_K),
    ] {
        assert!(listed.contains(&pair), "{}*{} missing", pair.0, pair.1);
    }
}
