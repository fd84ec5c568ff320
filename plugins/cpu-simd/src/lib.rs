//! `cpu-simd`: spinfer's AVX2 and AVX-512 (VNNI) kernels as a native pack.
//!
//! It offers, through the native pack ABI of `spinfer-plugin-api`, the SIMD
//! matmul kernels of `spinfer-kernels` (every candidate that
//! `spinfer_kernels::kernel::candidates` lists on the running CPU, minus the
//! scalar references) for every (weight type, activation type) pair they
//! support: one [`Kernel`] per (instruction set, pair), serving
//! [`Op::MAT_MUL`] for any number of tokens, named as `spinfer-kernels`
//! names them (`"avx512/q4_1*q8_1"`, `"avx2/q8_0*q8_0"`).
//!
//! [`score`](fn@score) follows ggml's CPU-variant score: 0 on a host without
//! AVX2 + FMA + F16C (the reason is logged through `tracing`, and available
//! from [`unsupported_reason`]), otherwise a bit mask, `1 << 5` for AVX2 plus
//! `1 << 6` for AVX-512 F/BW/VL/VNNI, so it always beats the portable pack's 1.
//!
//! Kernels run single-threaded on the calling thread: the host's thread pool
//! does not cross the ABI (see README.md).
//!
//! Built as `cdylib` (what the host loads) and `rlib` (so tests can call
//! [`instantiate_root_module`] in process).

use std::cell::RefCell;
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, PoisonError, RwLock};

use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{self as sk, MatmulDesc, MatmulKernel};
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels::{GgmlType, KernelError};
use spinfer_plugin_api::abi_stable::prefix_type::PrefixTypeTrait;
use spinfer_plugin_api::abi_stable::sabi_trait::TD_Opaque;
use spinfer_plugin_api::abi_stable::std_types::{RResult, RSlice, RSliceMut, RString, RVec};
use spinfer_plugin_api::abi_stable::{export_root_module, sabi_extern_fn};
use spinfer_plugin_api::{
    ABI_VERSION, ActType, CachePolicyBox, CpuFeatureSet, HostInfo, Kernel, Kernel_TO, KernelBox, KernelDesc, LoaderBox,
    Op, PackError, PackModule, PackModuleRef, PredictorBox, PredictorSpec, WeightType,
};

/// The pack's name as reported to the host.
pub const PACK_NAME: &str = "cpu-simd";

/// Score bit of a host with AVX2 + FMA + F16C (what the AVX2 kernels need).
pub const SCORE_AVX2: u32 = 1 << 5;
/// Score bit added for AVX-512 F/BW/VL/VNNI (what the AVX-512 kernels need).
pub const SCORE_AVX512: u32 = 1 << 6;

/// The features the AVX2 kernels need.
const NEED_AVX2: [(CpuFeatureSet, &str); 3] =
    [(CpuFeatureSet::AVX2, "avx2"), (CpuFeatureSet::FMA, "fma"), (CpuFeatureSet::F16C, "f16c")];
/// The features the AVX-512 kernels need on top of [`NEED_AVX2`].
const NEED_AVX512: [CpuFeatureSet; 4] =
    [CpuFeatureSet::AVX512F, CpuFeatureSet::AVX512BW, CpuFeatureSet::AVX512VL, CpuFeatureSet::AVX512VNNI];

/// The pack's root module. Not run until `abi_stable` has checked the
/// layout of the type it returns against the host's.
#[export_root_module]
pub fn instantiate_root_module() -> PackModuleRef {
    PackModule { abi_version: ABI_VERSION, name, score, kernels, loaders, predictors, cache_policies }
        .leak_into_prefix()
}

#[sabi_extern_fn]
fn name() -> RString {
    PACK_NAME.into()
}

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

#[sabi_extern_fn]
fn kernels() -> RVec<KernelBox> {
    let r = catch_unwind(|| {
        supported_kernels()
            .into_iter()
            .map(|(isa, w, a)| Kernel_TO::from_value(SimdKernel::new(&isa, w, a), TD_Opaque))
            .collect::<RVec<KernelBox>>()
    });
    // A panic must not unwind into the host; offering nothing is the safe answer.
    r.unwrap_or_default()
}

#[sabi_extern_fn]
fn loaders() -> RVec<LoaderBox> {
    RVec::new()
}

#[sabi_extern_fn]
fn predictors(_spec: &PredictorSpec) -> RVec<PredictorBox> {
    RVec::new()
}

#[sabi_extern_fn]
fn cache_policies(_capacity: u64) -> RVec<CachePolicyBox> {
    RVec::new()
}

// === Type mapping ===

/// The `spinfer-kernels` type for a catalogue weight type (both use GGML's
/// numeric ids).
pub fn ggml_type(w: WeightType) -> Option<GgmlType> {
    w.ggml_id().and_then(GgmlType::from_u32)
}

/// The `spinfer-kernels` activation type for a catalogue activation type.
pub fn kernel_act(a: ActType) -> Option<sk::ActType> {
    match a {
        ActType::F32 => Some(sk::ActType::F32),
        ActType::Q8_0 => Some(sk::ActType::Q8_0),
        ActType::Q8_1 => Some(sk::ActType::Q8_1),
        ActType::Q8_K => Some(sk::ActType::Q8_K),
        _ => None,
    }
}

/// The smallest valid row length of `w` (its block size), 1 for types the
/// kernels do not know.
fn min_cols(w: WeightType) -> usize {
    ggml_type(w).map_or(1, GgmlType::block_size)
}

/// The instruction-set prefix of a `spinfer-kernels` kernel name
/// (`"avx512"` of `"avx512/q4_1*q8_1"`).
fn isa_of(kernel_name: &str) -> &str {
    kernel_name.split_once('/').map_or(kernel_name, |(isa, _)| isa)
}

/// The SIMD `spinfer-kernels` kernels for `(w, a)` at `rows x cols` on this
/// CPU, best first (the scalar reference removed).
fn simd_kernels(w: WeightType, a: ActType, rows: usize, cols: usize) -> Vec<Box<dyn MatmulKernel>> {
    let (Some(wtype), Some(act)) = (ggml_type(w), kernel_act(a)) else { return Vec::new() };
    let desc = MatmulDesc { wtype, act, rows, cols };
    sk::candidates(&desc, &CpuFeatures::detect()).into_iter().filter(|k| isa_of(k.name()) != "scalar").collect()
}

/// Every (instruction set, weight type, activation type) the SIMD kernels
/// of `spinfer-kernels` serve on this CPU: catalogue order of the pairs,
/// best instruction set first within a pair. Empty on a CPU without AVX2.
pub fn supported_kernels() -> Vec<(String, WeightType, ActType)> {
    let mut v = Vec::new();
    for w in WeightType::ALL {
        for a in ActType::ALL {
            for k in simd_kernels(w, a, 1, min_cols(w)) {
                v.push((isa_of(k.name()).to_string(), w, a));
            }
        }
    }
    v
}

// === The kernel ===

thread_local! {
    /// Activation-quantisation scratch, per calling thread, reused across
    /// calls so steady-state calls do not allocate.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// One (instruction set, weight type, activation type), serving any shape
/// whose row length is a whole number of blocks.
pub struct SimdKernel {
    isa: String,
    wtype: WeightType,
    act: ActType,
    name: String,
    block: usize,
    /// A one-thread pool: the caller's thread does all the work. The host's
    /// pool cannot cross the ABI, so the pack does not parallelise.
    pool: ThreadPool,
    /// `spinfer-kernels` kernels are built per shape; a model has a handful
    /// of shapes per type, so keep them.
    by_shape: RwLock<HashMap<(usize, usize), Arc<dyn MatmulKernel>>>,
}

impl SimdKernel {
    /// A kernel for an entry of [`supported_kernels`].
    ///
    /// # Panics
    ///
    /// If this CPU has no `isa` kernel for the pair.
    pub fn new(isa: &str, wtype: WeightType, act: ActType) -> Self {
        let block = min_cols(wtype);
        let name = simd_kernels(wtype, act, 1, block)
            .into_iter()
            .find(|k| isa_of(k.name()) == isa)
            .map(|k| k.name().to_string())
            .unwrap_or_else(|| panic!("no {isa} kernel for {wtype}*{act} on this cpu"));
        SimdKernel {
            isa: isa.to_string(),
            wtype,
            act,
            name,
            block,
            pool: ThreadPool::new(1),
            by_shape: RwLock::new(HashMap::new()),
        }
    }

    fn for_shape(&self, rows: usize, cols: usize) -> Result<Arc<dyn MatmulKernel>, PackError> {
        if let Some(k) = self.by_shape.read().unwrap_or_else(PoisonError::into_inner).get(&(rows, cols)) {
            return Ok(Arc::clone(k));
        }
        if !cols.is_multiple_of(self.block) {
            return Err(PackError::unsupported(format!(
                "{}: {cols} columns is not a multiple of the block size {}",
                self.name, self.block
            )));
        }
        let k: Arc<dyn MatmulKernel> = simd_kernels(self.wtype, self.act, rows, cols)
            .into_iter()
            .find(|k| isa_of(k.name()) == self.isa)
            .ok_or_else(|| PackError::unsupported(format!("{}: no kernel for {rows}x{cols}", self.name)))?
            .into();
        self.by_shape.write().unwrap_or_else(PoisonError::into_inner).insert((rows, cols), Arc::clone(&k));
        Ok(k)
    }

    fn run_impl(
        &self,
        w: &[u8],
        x: &[f32],
        n_tokens: usize,
        rows: usize,
        cols: usize,
        out: &mut [f32],
    ) -> Result<(), PackError> {
        let k = self.for_shape(rows, cols)?;
        SCRATCH.with_borrow_mut(|scratch| k.run(&self.pool, w, x, n_tokens, out, scratch)).map_err(to_pack_error)
    }
}

impl Kernel for SimdKernel {
    fn describe(&self) -> KernelDesc {
        KernelDesc {
            name: self.name.as_str().into(),
            op: Op::MAT_MUL,
            wtype: self.wtype,
            act: self.act,
            cols_multiple: u32::try_from(self.block).unwrap_or(u32::MAX),
            rows_multiple: 1,
        }
    }

    fn prepare(&self, _weights: RSlice<'_, u8>, rows: usize, cols: usize) -> RResult<(), PackError> {
        // CPU kernels read the host's weights in place; only warm the
        // per-shape cache and reject shapes early.
        match catch_unwind(AssertUnwindSafe(|| self.for_shape(rows, cols).map(drop))) {
            Ok(r) => r.into(),
            Err(_) => RResult::RErr(PackError::internal(format!("{} panicked in prepare", self.name))),
        }
    }

    fn run(
        &self,
        weights: RSlice<'_, u8>,
        x: RSlice<'_, f32>,
        n_tokens: usize,
        rows: usize,
        cols: usize,
        mut out: RSliceMut<'_, f32>,
    ) -> RResult<(), PackError> {
        // A panic must not unwind into the host (abi_stable would abort).
        let r = catch_unwind(AssertUnwindSafe(|| {
            self.run_impl(weights.as_slice(), x.as_slice(), n_tokens, rows, cols, out.as_mut_slice())
        }));
        match r {
            Ok(r) => r.into(),
            Err(_) => RResult::RErr(PackError::internal(format!("{} panicked", self.name))),
        }
    }
}

/// Maps a `spinfer-kernels` error onto the ABI's kinds, keeping its text.
fn to_pack_error(e: KernelError) -> PackError {
    match e {
        KernelError::Unsupported { .. } | KernelError::RowNotBlockAligned { .. } => {
            PackError::unsupported(e.to_string())
        }
        // Buffer sizes and shapes, and whatever the kernels add later.
        _ => PackError::invalid_argument(e.to_string()),
    }
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
