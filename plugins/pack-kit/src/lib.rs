//! `spinfer-pack-kit`: what spinfer's CPU kernel packs (`cpu-portable`,
//! `cpu-simd`) share.
//!
//! Both packs serve the matmul kernels of `spinfer-kernels` through the
//! native pack ABI of `spinfer-plugin-api`; they differ only in their name,
//! which of the kernels they offer, and their score. A pack describes the
//! first two as a [`CpuPack`] and keeps its root module (with `abi_version`
//! first, as every ABI version requires) and its `score` in its own
//! `lib.rs`; this crate does the rest:
//!
//! * [`CpuPack::kernel_boxes`]: one [`CpuKernel`] per (instruction set,
//!   weight type, activation type) the pack serves, as FFI-safe
//!   [`KernelBox`]es;
//! * [`CpuKernel`]: the adapter from a `spinfer-kernels`
//!   [`MatmulKernel`] to the ABI's [`Kernel`] trait (per-shape kernel cache,
//!   per-thread scratch, a one-thread pool, panics caught, errors mapped to
//!   [`PackErrorKind`](spinfer_plugin_api::PackErrorKind)s);
//! * the type mapping between the ABI catalogues and `spinfer-kernels`;
//!   the ternary types (TQ1_0, TQ2_0 and `WeightType::I2_S`, which has no
//!   GGML id and is served by `spinfer_kernels::dot::ternary`) under
//!   [`Op::TERNARY_MAT_MUL`];
//! * [`ColumnAxpyKernel`] (`column_axpy.rs`): the sparse down projection
//!   ([`Op::GATHERED_COLUMN_AXPY`]) over an exact neuron-major repack of
//!   each weight slice the host prepares;
//! * [`kernel_pack_module`]: the root module of a pack that offers only
//!   kernels (`abi_version` first), from the pack's `name`, `score` and
//!   `kernels` entry points;
//! * with feature `testing`, the `testing` module: the checks every CPU
//!   pack passes, in process and through dlopen.

use std::cell::RefCell;
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, PoisonError, RwLock};

use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::dot::ternary;
use spinfer_kernels::kernel::{self as sk, MatmulCall, MatmulDesc, MatmulKernel, Select};
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels::{GgmlType, KernelError, QK_K};
use spinfer_plugin_api::abi_stable::prefix_type::PrefixTypeTrait;
use spinfer_plugin_api::abi_stable::sabi_extern_fn;
use spinfer_plugin_api::abi_stable::sabi_trait::TD_Opaque;
use spinfer_plugin_api::abi_stable::std_types::{RResult, RSlice, RSliceMut, RString, RVec};
use spinfer_plugin_api::{
    ABI_VERSION, ActType, CachePolicyBox, HostInfo, Kernel, Kernel_TO, KernelBox, KernelDesc, LoaderBox, Op, PackError,
    PackModule, PackModuleRef, PredictorBox, PredictorSpec, WeightType,
};

mod column_axpy;
#[cfg(feature = "testing")]
pub mod testing;

pub use column_axpy::{COLUMN_AXPY_TYPES, ColumnAxpyKernel};

// === Type mapping ===

/// The `spinfer-kernels` type for a catalogue weight type (both use GGML's
/// numeric ids); `None` for extension types such as `I2_S`.
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

/// The smallest valid row length of `w` (its block size; 256 for I2_S), 1
/// for types the kernels do not know.
pub fn min_cols(w: WeightType) -> usize {
    if w == WeightType::I2_S { QK_K } else { ggml_type(w).map_or(1, GgmlType::block_size) }
}

/// The operation a kernel for `w` serves: [`Op::TERNARY_MAT_MUL`] for the
/// ternary types (TQ1_0, TQ2_0, and I2_S, which the host feeds with an
/// exact repack of a model's TQ2_0 weights), otherwise [`Op::MAT_MUL`].
pub fn op_for(w: WeightType) -> Op {
    if matches!(w, WeightType::TQ1_0 | WeightType::TQ2_0 | WeightType::I2_S) {
        Op::TERNARY_MAT_MUL
    } else {
        Op::MAT_MUL
    }
}

/// Whether the kernels for `w` also compute a list of rows in place
/// (a `Select::Rows` call, served as [`Op::GATHERED_ROW_MAT_VEC`]):
/// every type but the ternary ones.
pub fn offers_gathered_rows(w: WeightType) -> bool {
    op_for(w) == Op::MAT_MUL
}

/// The instruction-set prefix of a `spinfer-kernels` kernel name
/// (`"avx512"` of `"avx512/q4_1*q8_1"`).
pub fn isa_of(kernel_name: &str) -> &str {
    kernel_name.split_once('/').map_or(kernel_name, |(isa, _)| isa)
}

/// Every `spinfer-kernels` kernel for `(w, a)` at `rows x cols` on a CPU
/// with `features`, best first (scalar last); empty for unsupported pairs
/// and shapes.
pub fn kernel_candidates(
    w: WeightType,
    a: ActType,
    rows: usize,
    cols: usize,
    features: &CpuFeatures,
) -> Vec<Box<dyn MatmulKernel>> {
    if w == WeightType::I2_S {
        return if a == ActType::Q8_K { ternary::i2s_candidates(rows, cols, features) } else { Vec::new() };
    }
    let (Some(wtype), Some(act)) = (ggml_type(w), kernel_act(a)) else { return Vec::new() };
    spinfer_kernels::matmul::candidates(&MatmulDesc::dense(wtype, act, rows, cols), features)
}

// === The pack ===

/// What distinguishes one CPU pack: its name and which `spinfer-kernels`
/// kernels it serves (those of the instruction sets `isas` among the
/// candidates for the CPU `features()` describes).
#[derive(Clone, Copy, Debug)]
pub struct CpuPack {
    /// The pack's name as reported to the host (`"cpu-simd"`).
    pub name: &'static str,
    /// The CPU the kernels are chosen for: `CpuFeatures::detect` for SIMD
    /// kernels, `CpuFeatures::default` (no extensions) for the scalar ones.
    pub features: fn() -> CpuFeatures,
    /// Kernel-name prefixes served (`"scalar"`, `"avx2"`, `"avx512"`).
    pub isas: &'static [&'static str],
}

impl CpuPack {
    /// The served kernels for `(w, a)` at `rows x cols`, best first.
    fn candidates(&self, w: WeightType, a: ActType, rows: usize, cols: usize) -> Vec<Box<dyn MatmulKernel>> {
        kernel_candidates(w, a, rows, cols, &(self.features)())
            .into_iter()
            .filter(|k| self.isas.contains(&isa_of(k.name())))
            .collect()
    }

    /// Every (instruction set, weight type, activation type) the pack
    /// serves on this CPU: catalogue order of the pairs, best instruction
    /// set first within a pair.
    pub fn supported_kernels(&self) -> Vec<(String, WeightType, ActType)> {
        let mut v = Vec::new();
        for w in WeightType::ALL {
            for a in ActType::ALL {
                for k in self.candidates(w, a, 1, min_cols(w)) {
                    v.push((isa_of(k.name()).to_string(), w, a));
                }
            }
        }
        v
    }

    /// The kernel for an entry of [`CpuPack::supported_kernels`], or
    /// `None` if this CPU has no `isa` kernel for the pair.
    pub fn kernel(&self, isa: &str, wtype: WeightType, act: ActType) -> Option<CpuKernel> {
        self.kernel_for_op(isa, wtype, act, op_for(wtype))
    }

    /// As [`CpuPack::kernel`], serving `op`: its dense operation, or
    /// [`Op::GATHERED_ROW_MAT_VEC`] where [`offers_gathered_rows`].
    pub fn kernel_for_op(&self, isa: &str, wtype: WeightType, act: ActType, op: Op) -> Option<CpuKernel> {
        if op != op_for(wtype) && !(op == Op::GATHERED_ROW_MAT_VEC && offers_gathered_rows(wtype)) {
            return None;
        }
        let block = min_cols(wtype);
        let name =
            self.candidates(wtype, act, 1, block).into_iter().find(|k| isa_of(k.name()) == isa)?.name().to_string();
        Some(CpuKernel {
            pack: *self,
            op,
            isa: isa.to_string(),
            wtype,
            act,
            name,
            block,
            pool: ThreadPool::new(1),
            by_shape: RwLock::new(HashMap::new()),
        })
    }

    /// Every kernel of [`CpuPack::supported_kernels`] as an ABI object,
    /// then the gathered-row form of those that have one (same names, op
    /// [`Op::GATHERED_ROW_MAT_VEC`]), then the
    /// [`CpuPack::column_axpy_kernels`]: the body of a pack's `kernels`
    /// entry point. A panic offers nothing (it must not unwind into the host).
    pub fn kernel_boxes(&self) -> RVec<KernelBox> {
        catch_unwind(|| {
            let supported = self.supported_kernels();
            let dense = supported.iter().filter_map(|(isa, w, a)| self.kernel(isa, *w, *a));
            let gathered =
                supported.iter().filter_map(|(isa, w, a)| self.kernel_for_op(isa, *w, *a, Op::GATHERED_ROW_MAT_VEC));
            let boxes = dense.chain(gathered).map(|k| Kernel_TO::from_value(k, TD_Opaque));
            let columns = self.column_axpy_kernels().into_iter().map(|k| Kernel_TO::from_value(k, TD_Opaque));
            boxes.chain(columns).collect::<RVec<KernelBox>>()
        })
        .unwrap_or_default()
    }
}

// === Root modules of kernel-only packs ===

/// Re-exported for [`export_cpu_pack!`].
#[doc(hidden)]
pub use spinfer_plugin_api::abi_stable;

/// Exports the root module of a [`CpuPack`]: `export_cpu_pack!(PACK,
/// score)` defines the pack's `#[export_root_module]` function,
/// `pub fn instantiate_root_module() -> PackModuleRef` (built by
/// [`kernel_pack_module`], so `abi_version` comes first), and its `name`
/// and `kernels` entry points from the `CpuPack` constant `PACK`; `score`
/// is the pack's own `#[sabi_extern_fn] fn(&HostInfo) -> u32`. The pack
/// crate must depend on `abi_stable` (its macros name it).
///
/// `export_cpu_pack!(PACK, score, predictors = p, cache_policies = c)`
/// also exports the pack's own `predictors` and `cache_policies` entry
/// points (`#[sabi_extern_fn]`s, see [`pack_module`]).
#[macro_export]
macro_rules! export_cpu_pack {
    ($pack:path, $score:path, predictors = $predictors:path, cache_policies = $policies:path) => {
        /// The pack's root module (`abi_version` first, then this pack's
        /// entry points; see `spinfer_pack_kit::pack_module`). Not run
        /// until `abi_stable` has checked the layout of the type it
        /// returns against the host's.
        #[$crate::abi_stable::export_root_module]
        pub fn instantiate_root_module() -> $crate::__PackModuleRef {
            $crate::pack_module(__spinfer_pack_name, $score, __spinfer_pack_kernels, $predictors, $policies)
        }

        $crate::export_cpu_pack!(@entry_points $pack);
    };
    ($pack:path, $score:path) => {
        /// The pack's root module (`abi_version` first, then this pack's
        /// entry points; see `spinfer_pack_kit::kernel_pack_module`). Not
        /// run until `abi_stable` has checked the layout of the type it
        /// returns against the host's.
        #[$crate::abi_stable::export_root_module]
        pub fn instantiate_root_module() -> $crate::__PackModuleRef {
            $crate::kernel_pack_module(__spinfer_pack_name, $score, __spinfer_pack_kernels)
        }

        $crate::export_cpu_pack!(@entry_points $pack);
    };
    (@entry_points $pack:path) => {
        #[$crate::abi_stable::sabi_extern_fn]
        fn __spinfer_pack_name() -> $crate::abi_stable::std_types::RString {
            $pack.name.into()
        }

        #[$crate::abi_stable::sabi_extern_fn]
        fn __spinfer_pack_kernels() -> $crate::abi_stable::std_types::RVec<$crate::__KernelBox> {
            $pack.kernel_boxes()
        }
    };
}

#[doc(hidden)]
pub use spinfer_plugin_api::{KernelBox as __KernelBox, PackModuleRef as __PackModuleRef};

/// The root module of a pack that offers only kernels: `abi_version` first
/// (the one field every ABI version keeps in place, so a host can explain
/// a version mismatch), the pack's own `name`, `score` and `kernels` entry
/// points, and [`no_loaders`], [`no_predictors`], [`no_cache_policies`].
/// Call it from the pack's `#[export_root_module]` function; the entry
/// points must be `#[sabi_extern_fn]`s.
pub fn kernel_pack_module(
    name: extern "C" fn() -> RString,
    score: extern "C" fn(&HostInfo) -> u32,
    kernels: extern "C" fn() -> RVec<KernelBox>,
) -> PackModuleRef {
    pack_module(name, score, kernels, no_predictors, no_cache_policies)
}

/// The root module of a pack that offers kernels, FFN neuron predictors
/// and cache policies (no loaders): as [`kernel_pack_module`], with the
/// pack's own `predictors` and `cache_policies` entry points.
pub fn pack_module(
    name: extern "C" fn() -> RString,
    score: extern "C" fn(&HostInfo) -> u32,
    kernels: extern "C" fn() -> RVec<KernelBox>,
    predictors: extern "C" fn(&PredictorSpec) -> RVec<PredictorBox>,
    cache_policies: extern "C" fn(u64) -> RVec<CachePolicyBox>,
) -> PackModuleRef {
    PackModule { abi_version: ABI_VERSION, name, score, kernels, loaders: no_loaders, predictors, cache_policies }
        .leak_into_prefix()
}

/// `loaders` entry point of a pack without loaders.
#[sabi_extern_fn]
pub fn no_loaders() -> RVec<LoaderBox> {
    RVec::new()
}

/// `predictors` entry point of a pack without predictors.
#[sabi_extern_fn]
pub fn no_predictors(_spec: &PredictorSpec) -> RVec<PredictorBox> {
    RVec::new()
}

/// `cache_policies` entry point of a pack without cache policies.
#[sabi_extern_fn]
pub fn no_cache_policies(_capacity: u64) -> RVec<CachePolicyBox> {
    RVec::new()
}

// === The kernel ===

thread_local! {
    /// Activation-quantisation scratch, per calling thread, reused across
    /// calls so steady-state calls do not allocate.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// One (instruction set, weight type, activation type) of a [`CpuPack`],
/// serving any shape whose row length is a whole number of blocks, for any
/// number of tokens, on the calling thread.
pub struct CpuKernel {
    pack: CpuPack,
    /// The dense operation ([`op_for`]), or [`Op::GATHERED_ROW_MAT_VEC`]:
    /// `run_sparse` then computes the listed rows (and `run` all of them).
    op: Op,
    isa: String,
    wtype: WeightType,
    act: ActType,
    name: String,
    block: usize,
    /// A one-thread pool: the caller's thread does all the work. The host's
    /// pool cannot cross the ABI, and concurrent calls from several host
    /// threads do not contend.
    pool: ThreadPool,
    /// `spinfer-kernels` kernels are built per shape; a model has a handful
    /// of shapes per type, so keep them.
    by_shape: RwLock<HashMap<(usize, usize), Arc<dyn MatmulKernel>>>,
}

impl CpuKernel {
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
        let k: Arc<dyn MatmulKernel> = self
            .pack
            .candidates(self.wtype, self.act, rows, cols)
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
        SCRATCH
            .with_borrow_mut(|scratch| k.run(&self.pool, MatmulCall::dense(w, x, n_tokens, out, scratch)))
            .map_err(to_pack_error)
    }

    fn guarded(&self, what: &str, f: impl FnOnce() -> Result<(), PackError>) -> RResult<(), PackError> {
        guarded(&self.name, what, f)
    }

    #[allow(clippy::too_many_arguments, reason = "the ABI's run_sparse arguments")]
    fn rows_impl(
        &self,
        w: &[u8],
        x: &[f32],
        n_tokens: usize,
        rows: usize,
        cols: usize,
        idx: &[u32],
        out: &mut [f32],
    ) -> Result<(), PackError> {
        if self.op != Op::GATHERED_ROW_MAT_VEC {
            return Err(PackError::unsupported(format!("{} ({}) implements no sparse operation", self.name, self.op)));
        }
        let k = self.for_shape(rows, cols)?;
        SCRATCH
            .with_borrow_mut(|scratch| {
                k.run(
                    &self.pool,
                    MatmulCall { w, select: Select::Rows(idx), x, n_tokens, out, scratch, prefill: false },
                )
            })
            .map_err(to_pack_error)
    }
}

impl Kernel for CpuKernel {
    fn describe(&self) -> KernelDesc {
        KernelDesc {
            name: self.name.as_str().into(),
            op: self.op,
            wtype: self.wtype,
            act: self.act,
            cols_multiple: u32::try_from(self.block).unwrap_or(u32::MAX),
            rows_multiple: 1,
        }
    }

    fn prepare(&self, _weights: RSlice<'_, u8>, rows: usize, cols: usize) -> RResult<(), PackError> {
        // CPU kernels read the host's weights in place; only warm the
        // per-shape cache and reject shapes early.
        self.guarded("prepare", || self.for_shape(rows, cols).map(drop))
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
        self.guarded("run", || {
            self.run_impl(weights.as_slice(), x.as_slice(), n_tokens, rows, cols, out.as_mut_slice())
        })
    }

    fn run_sparse(
        &self,
        weights: RSlice<'_, u8>,
        x: RSlice<'_, f32>,
        n_tokens: usize,
        rows: usize,
        cols: usize,
        indices: RSlice<'_, u32>,
        mut out: RSliceMut<'_, f32>,
    ) -> RResult<(), PackError> {
        self.guarded("run_sparse", || {
            let (w, x, idx) = (weights.as_slice(), x.as_slice(), indices.as_slice());
            self.rows_impl(w, x, n_tokens, rows, cols, idx, out.as_mut_slice())
        })
    }
}

/// `f`, with a panic turned into an error naming the kernel: it must not
/// unwind into the host (abi_stable would abort).
fn guarded(kernel: &str, what: &str, f: impl FnOnce() -> Result<(), PackError>) -> RResult<(), PackError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.into(),
        Err(_) => RResult::RErr(PackError::internal(format!("{kernel} panicked in {what}"))),
    }
}

/// Maps a `spinfer-kernels` error onto the ABI's kinds, keeping its text.
pub fn to_pack_error(e: KernelError) -> PackError {
    match e {
        KernelError::Unsupported { .. } | KernelError::NotOffered { .. } | KernelError::RowNotBlockAligned { .. } => {
            PackError::unsupported(e.to_string())
        }
        // Buffer sizes and shapes, and whatever the kernels add later.
        _ => PackError::invalid_argument(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCALAR: CpuPack = CpuPack { name: "scalar-test", features: CpuFeatures::default, isas: &["scalar"] };

    #[test]
    fn type_mapping() {
        assert_eq!(ggml_type(WeightType::TQ2_0), Some(GgmlType::TQ2_0));
        assert_eq!(ggml_type(WeightType::I2_S), None);
        assert_eq!(kernel_act(ActType::Q8_K), Some(sk::ActType::Q8_K));
        assert_eq!(kernel_act(ActType(12345)), None);
        assert_eq!(min_cols(WeightType::I2_S), 256);
        assert_eq!(min_cols(WeightType::Q4_1), 32);
        assert_eq!(min_cols(WeightType::F16), 1);
        assert_eq!(op_for(WeightType::I2_S), Op::TERNARY_MAT_MUL);
        assert_eq!(op_for(WeightType::TQ1_0), Op::TERNARY_MAT_MUL);
        assert_eq!(op_for(WeightType::Q4_1), Op::MAT_MUL);
        assert_eq!(isa_of("avx2/q4_1*q8_1"), "avx2");
    }

    #[test]
    fn scalar_pack_lists_ternary_kernels() {
        let listed = SCALAR.supported_kernels();
        assert!(listed.iter().all(|(isa, _, _)| isa == "scalar"));
        for w in [WeightType::TQ1_0, WeightType::TQ2_0, WeightType::I2_S] {
            assert!(listed.contains(&("scalar".to_string(), w, ActType::Q8_K)), "{w}");
        }
        assert!(!listed.iter().any(|(_, w, a)| *w == WeightType::I2_S && *a != ActType::Q8_K));
        let k = SCALAR.kernel("scalar", WeightType::I2_S, ActType::Q8_K).unwrap();
        let d = k.describe();
        assert_eq!((d.name.as_str(), d.op, d.cols_multiple), ("scalar/i2_s*q8_K", Op::TERNARY_MAT_MUL, 256));
        assert!(SCALAR.kernel("avx2", WeightType::Q4_1, ActType::Q8_1).is_none());
        // Each listed kernel, then the gathered-row form of the non-ternary ones.
        let gathered = listed.iter().filter(|(_, w, _)| offers_gathered_rows(*w)).count();
        assert!(gathered > 0 && gathered < listed.len());
        // ... then the gathered-column AXPYs: f32 and int8 for each exact type.
        let columns: Vec<String> = SCALAR.column_axpy_kernels().iter().map(|k| k.name().to_string()).collect();
        assert_eq!(columns[..2], ["scalar/axpy:q4_0*f32", "scalar/axpy:q4_0*q8_0"]);
        assert_eq!(columns.len(), 2 * COLUMN_AXPY_TYPES.len());
        assert_eq!(SCALAR.kernel_boxes().len(), listed.len() + gathered + columns.len());
        assert!(SCALAR.kernel_for_op("scalar", WeightType::TQ2_0, ActType::Q8_K, Op::GATHERED_ROW_MAT_VEC).is_none());
        let k = SCALAR.kernel_for_op("scalar", WeightType::Q4_1, ActType::Q8_1, Op::GATHERED_ROW_MAT_VEC).unwrap();
        assert_eq!(k.describe().op, Op::GATHERED_ROW_MAT_VEC);
    }
}
