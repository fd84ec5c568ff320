//! The gathered-column AXPY of a CPU pack ([`Op::GATHERED_COLUMN_AXPY`]):
//! the sparse FFN's down projection over the neurons the host kept.
//!
//! `prepare` repacks each weight slice the host hands it into an exact
//! neuron-major copy ([`NeuronMajor`]: as many bytes as the slice, Q4_0,
//! Q4_1 and Q8_0), keyed by the slice's address and length; `run_sparse`
//! looks the copy up and accumulates the selected columns on the calling
//! thread. The host splits `W` into ranges of rows, one per thread, so each
//! thread reads a copy of its own outputs only.
//!
//! Activation type `F32` is `NeuronMajor::axpy_with` (f32 coefficients,
//! the pack's instruction set); `Q8_0` is the int8 arithmetic of
//! `NeuronMajor::axpy_fast` (coefficients as two int8 planes per run of
//! neurons in one block), offered by the scalar pack everywhere and by the
//! `avx512` kernels where the CPU has VNNI and VBMI. Either way a row range
//! gives bit for bit the values the whole matrix gives for those rows.
//!
//! The repacks live as long as the kernel: the ABI has no call that tells
//! a pack a weight slice is gone (a host keeps its slices alive while it
//! uses the kernel), so a host that loads models again and again grows by
//! one `W_down` per layer each time.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::pool::ThreadPool;
use spinfer_plugin_api::abi_stable::std_types::{RResult, RSlice, RSliceMut};
use spinfer_plugin_api::{ActType, Kernel, KernelDesc, Op, PackError, WeightType};
use spinfer_sparse_kernels::{AxpyIsa, NeuronMajor};

use crate::{CpuPack, ggml_type, guarded, to_pack_error};

/// The weight types with an exact neuron-major form.
pub const COLUMN_AXPY_TYPES: [WeightType; 3] = [WeightType::Q4_0, WeightType::Q4_1, WeightType::Q8_0];

/// The AXPY implementation a kernel-name prefix stands for, if the CPU
/// `features` describes (and the running CPU) can run it.
fn axpy_isa(isa: &str, features: &CpuFeatures) -> Option<AxpyIsa> {
    let best = AxpyIsa::select(features);
    let want = match isa {
        "scalar" => AxpyIsa::Scalar,
        "avx2" => AxpyIsa::Avx2,
        "avx512" => AxpyIsa::Avx512,
        _ => return None,
    };
    (want <= best).then_some(want)
}

impl CpuPack {
    /// The gathered-column AXPY kernels the pack serves on this CPU, best
    /// instruction set first: for each of its instruction sets with an
    /// AXPY, each of [`COLUMN_AXPY_TYPES`] with `F32` activations, and with
    /// `Q8_0` where the int8 arithmetic runs (see the module documentation).
    pub fn column_axpy_kernels(&self) -> Vec<ColumnAxpyKernel> {
        let features = (self.features)();
        let mut isas: Vec<(&str, AxpyIsa)> =
            self.isas.iter().filter_map(|&name| axpy_isa(name, &features).map(|i| (name, i))).collect();
        isas.sort_by_key(|&(_, i)| std::cmp::Reverse(i));
        let mut v = Vec::new();
        for (name, isa) in isas {
            let int8 = match isa {
                AxpyIsa::Scalar => true,
                AxpyIsa::Avx512 => NeuronMajor::axpy_fast_is_int8(),
                AxpyIsa::Avx2 => false,
            };
            for wtype in COLUMN_AXPY_TYPES {
                for act in [ActType::F32, ActType::Q8_0] {
                    if act == ActType::F32 || int8 {
                        v.push(ColumnAxpyKernel::new(name, isa, wtype, act));
                    }
                }
            }
        }
        v
    }
}

/// One (instruction set, weight type, activation type) of a pack's
/// gathered-column AXPY.
pub struct ColumnAxpyKernel {
    /// `"avx512/axpy:q4_1*f32"`.
    name: String,
    isa: AxpyIsa,
    wtype: WeightType,
    act: ActType,
    /// A one-thread pool: the caller's thread does all the work.
    pool: ThreadPool,
    /// The neuron-major copies, by weight slice (address, length).
    repacked: RwLock<HashMap<(usize, usize), Arc<NeuronMajor>>>,
}

impl ColumnAxpyKernel {
    fn new(isa_name: &str, isa: AxpyIsa, wtype: WeightType, act: ActType) -> Self {
        Self {
            name: format!("{isa_name}/axpy:{wtype}*{act}"),
            isa,
            wtype,
            act,
            pool: ThreadPool::new(1),
            repacked: RwLock::new(HashMap::new()),
        }
    }

    /// `"avx512/axpy:q4_1*f32"`: the instruction set, then the pair.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Repacks `w` (`rows x cols`) and keeps the copy under its slice.
    fn repack(&self, w: &[u8], rows: usize, cols: usize) -> Result<Arc<NeuronMajor>, PackError> {
        let ty = ggml_type(self.wtype).ok_or_else(|| PackError::unsupported(format!("{}: no GGML type", self.name)))?;
        let nm = Arc::new(NeuronMajor::from_weights(ty, w, rows, cols).map_err(to_pack_error)?);
        let key = (w.as_ptr() as usize, w.len());
        self.repacked.write().unwrap_or_else(PoisonError::into_inner).insert(key, Arc::clone(&nm));
        Ok(nm)
    }

    /// The copy of `w`, made now if `prepare` was not called for it.
    fn repacked(&self, w: &[u8], rows: usize, cols: usize) -> Result<Arc<NeuronMajor>, PackError> {
        let key = (w.as_ptr() as usize, w.len());
        let found = self.repacked.read().unwrap_or_else(PoisonError::into_inner).get(&key).cloned();
        let nm = match found {
            Some(nm) => nm,
            None => self.repack(w, rows, cols)?,
        };
        if (nm.outputs(), nm.neurons()) != (rows, cols) {
            return Err(PackError::invalid_argument(format!(
                "{}: this weight slice was prepared as {}x{}, not {rows}x{cols}",
                self.name,
                nm.outputs(),
                nm.neurons()
            )));
        }
        Ok(nm)
    }

    #[allow(clippy::too_many_arguments, reason = "the ABI's run_sparse arguments")]
    fn axpy(
        &self,
        w: &[u8],
        x: &[f32],
        n_tokens: usize,
        rows: usize,
        cols: usize,
        idx: &[u32],
        out: &mut [f32],
    ) -> Result<(), PackError> {
        let k = idx.len();
        if x.len() != n_tokens * k || out.len() != n_tokens * rows {
            return Err(PackError::invalid_argument(format!(
                "{}: {n_tokens} tokens of {k} columns of {rows}x{cols}: {} inputs, {} outputs",
                self.name,
                x.len(),
                out.len()
            )));
        }
        let nm = self.repacked(w, rows, cols)?;
        if k == 0 {
            out.fill(0.0);
            return Ok(());
        }
        for (coef, out) in x.chunks_exact(k).zip(out.chunks_exact_mut(rows.max(1))) {
            let r = match (self.act, self.isa) {
                (ActType::Q8_0, AxpyIsa::Scalar) => nm.axpy_fast_scalar(idx, coef, out),
                (ActType::Q8_0, _) => nm.axpy_fast(&self.pool, idx, coef, out),
                _ => nm.axpy_with(&self.pool, self.isa, idx, coef, out),
            };
            r.map_err(to_pack_error)?;
        }
        Ok(())
    }
}

impl Kernel for ColumnAxpyKernel {
    fn describe(&self) -> KernelDesc {
        KernelDesc {
            name: self.name.as_str().into(),
            op: Op::GATHERED_COLUMN_AXPY,
            wtype: self.wtype,
            act: self.act,
            // Columns are neurons in blocks of 32; the host's row ranges
            // start at multiples of 32.
            cols_multiple: 32,
            rows_multiple: 1,
        }
    }

    /// Repacks the slice (again, if the host prepares a new matrix where
    /// an old one was).
    fn prepare(&self, weights: RSlice<'_, u8>, rows: usize, cols: usize) -> RResult<(), PackError> {
        guarded(&self.name, "prepare", || self.repack(weights.as_slice(), rows, cols).map(drop))
    }

    fn run(
        &self,
        _weights: RSlice<'_, u8>,
        _x: RSlice<'_, f32>,
        _n_tokens: usize,
        _rows: usize,
        _cols: usize,
        _out: RSliceMut<'_, f32>,
    ) -> RResult<(), PackError> {
        RResult::RErr(PackError::unsupported(format!("{} serves gathered_column_axpy only", self.name)))
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
        guarded(&self.name, "run_sparse", || {
            let (w, x, idx) = (weights.as_slice(), x.as_slice(), indices.as_slice());
            self.axpy(w, x, n_tokens, rows, cols, idx, out.as_mut_slice())
        })
    }
}
