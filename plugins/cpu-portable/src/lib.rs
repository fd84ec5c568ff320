//! `cpu-portable`: the reference kernel pack.
//!
//! It offers, through the native pack ABI of `spinfer-plugin-api`, the
//! portable scalar matmul kernels of `spinfer-kernels` for every
//! (weight type, activation type) pair they support (the ternary TQ1_0,
//! TQ2_0 and I2_S × Q8_K included), one kernel per pair serving
//! [`Op::MAT_MUL`](spinfer_plugin_api::Op::MAT_MUL) (I2_S:
//! `TERNARY_MAT_MUL`) for any number of tokens. It runs on every CPU and
//! scores 1, so any pack that scores higher wins; its value is as the
//! bit-exact reference other packs are checked against, and as a working
//! example of a pack.
//!
//! It also offers the reference sparsity plugins ([`sparsity`]): the
//! `keep-all` predictor and the `fifo` cache policy.
//!
//! The adapter between `spinfer-kernels` and the ABI is shared with
//! `cpu-simd` in `spinfer-pack-kit`; this crate says only what differs: its
//! name, which kernels ([`PACK`]) and its score.
//!
//! Built as `cdylib` (what the host loads) and `rlib` (so tests can call
//! [`instantiate_root_module`] in process).

use spinfer_kernels::cpu::CpuFeatures;
use spinfer_pack_kit::CpuPack;
use spinfer_plugin_api::abi_stable::sabi_extern_fn;
use spinfer_plugin_api::{ActType, HostInfo, WeightType};

pub use spinfer_pack_kit::{ggml_type, kernel_act};

/// The pack's name as reported to the host.
pub const PACK_NAME: &str = "cpu-portable";

/// The kernels served: the scalar references, chosen as for a CPU without
/// any SIMD extension.
pub const PACK: CpuPack = CpuPack { name: PACK_NAME, features: CpuFeatures::default, isas: &["scalar"] };

pub mod sparsity;

spinfer_pack_kit::export_cpu_pack!(
    PACK,
    score,
    predictors = sparsity::predictors,
    cache_policies = sparsity::cache_policies
);

/// The portable reference works everywhere and is preferred nowhere.
#[sabi_extern_fn]
fn score(_host: &HostInfo) -> u32 {
    1
}

/// Every (weight, activation) pair the scalar kernels of `spinfer-kernels`
/// serve, in catalogue order.
pub fn supported_pairs() -> Vec<(WeightType, ActType)> {
    PACK.supported_kernels().into_iter().map(|(_, w, a)| (w, a)).collect()
}
