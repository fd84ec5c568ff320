//! `cpu-portable`: the reference kernel pack.
//!
//! It offers, through the native pack ABI of `spinfer-plugin-api`, the
//! portable scalar matmul kernels of `spinfer-kernels` for every
//! (weight type, activation type) pair they support, one [`Kernel`] per
//! pair serving [`Op::MAT_MUL`] for any number of tokens. It runs on every
//! CPU and scores 1, so any pack that scores higher wins; its value is as
//! the bit-exact reference other packs are checked against, and as a
//! working example of a pack.
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
    ABI_VERSION, ActType, CachePolicyBox, HostInfo, Kernel, Kernel_TO, KernelBox, KernelDesc, LoaderBox, Op, PackError,
    PackModule, PackModuleRef, PredictorBox, PredictorSpec, WeightType,
};

/// The pack's name as reported to the host.
pub const PACK_NAME: &str = "cpu-portable";

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

/// The portable reference works everywhere and is preferred nowhere.
#[sabi_extern_fn]
fn score(_host: &HostInfo) -> u32 {
    1
}

#[sabi_extern_fn]
fn kernels() -> RVec<KernelBox> {
    supported_pairs().into_iter().map(|(w, a)| Kernel_TO::from_value(ScalarKernel::new(w, a), TD_Opaque)).collect()
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

/// Every (weight, activation) pair the scalar kernels of `spinfer-kernels`
/// serve, in catalogue order.
pub fn supported_pairs() -> Vec<(WeightType, ActType)> {
    let mut v = Vec::new();
    for w in WeightType::ALL {
        for a in ActType::ALL {
            if scalar_kernel(w, a, 1, min_cols(w)).is_some() {
                v.push((w, a));
            }
        }
    }
    v
}

/// The smallest valid row length of `w` (its block size), 1 for types the
/// kernels do not know.
fn min_cols(w: WeightType) -> usize {
    ggml_type(w).map_or(1, GgmlType::block_size)
}

/// The scalar `spinfer-kernels` kernel for `(w, a)` at `rows x cols`, if
/// there is one. With all CPU features off, `candidates` offers only the
/// scalar reference.
fn scalar_kernel(w: WeightType, a: ActType, rows: usize, cols: usize) -> Option<Box<dyn MatmulKernel>> {
    let desc = MatmulDesc { wtype: ggml_type(w)?, act: kernel_act(a)?, rows, cols };
    sk::candidates(&desc, &CpuFeatures::default()).pop()
}

// === The kernel ===

thread_local! {
    /// Activation-quantisation scratch, per calling thread, reused across
    /// calls so steady-state calls do not allocate.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// One (weight type, activation type) pair, serving any shape whose row
/// length is a whole number of blocks.
pub struct ScalarKernel {
    wtype: WeightType,
    act: ActType,
    name: String,
    block: usize,
    /// A one-thread pool: the caller's thread does all the work, so
    /// concurrent calls from several host threads do not contend.
    pool: ThreadPool,
    /// `spinfer-kernels` kernels are built per shape; the model has a
    /// handful of shapes per type, so keep them.
    by_shape: RwLock<HashMap<(usize, usize), Arc<dyn MatmulKernel>>>,
}

impl ScalarKernel {
    /// A kernel for a pair listed by [`supported_pairs`].
    ///
    /// # Panics
    ///
    /// If the pair is not supported.
    pub fn new(wtype: WeightType, act: ActType) -> Self {
        let block = min_cols(wtype);
        let name = scalar_kernel(wtype, act, 1, block)
            .map(|k| k.name().to_string())
            .unwrap_or_else(|| panic!("no scalar kernel for {wtype}*{act}"));
        ScalarKernel { wtype, act, name, block, pool: ThreadPool::new(1), by_shape: RwLock::new(HashMap::new()) }
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
        let k: Arc<dyn MatmulKernel> = scalar_kernel(self.wtype, self.act, rows, cols)
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

impl Kernel for ScalarKernel {
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
        self.for_shape(rows, cols).map(drop).into()
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
