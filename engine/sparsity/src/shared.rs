//! What the sparse FFN's parts share (the bundle, the sparse FFN itself): a
//! leaf, so that `bundle.rs` and `mod.rs` do not import each other.

use std::path::Path;

use crate::Error;

/// How the sparse AXPYs (the down projection, the attention output) do
/// their arithmetic; follows the model's precision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AxpyMode {
    /// f32 coefficients times the exact weights (precise mode).
    #[default]
    Exact,
    /// Coefficients quantised to two int8 planes per run of active neurons
    /// in one 32-neuron block, integer sums (`NeuronMajor::axpy_fast`):
    /// the sparse counterpart of the 8-bit activations the dense kernels
    /// use in the fast and int8 modes.
    Int8,
}

impl AxpyMode {
    /// The activation type a kernel of this arithmetic declares (the
    /// ABI's `GATHERED_COLUMN_AXPY`): `F32`, or `Q8_0` for int8
    /// coefficients.
    pub fn act(self) -> spinfer_kernels::kernel::ActType {
        match self {
            AxpyMode::Exact => spinfer_kernels::kernel::ActType::F32,
            AxpyMode::Int8 => spinfer_kernels::kernel::ActType::Q8_0,
        }
    }
}

/// What the FFN bundle served under a memory budget (neuron records).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheCounters {
    /// Records served from the hot set in RAM.
    pub hot: u64,
    /// Cold records found in the cache.
    pub hits: u64,
    /// Cold records read from the bundle file.
    pub misses: u64,
    /// Bytes read from the bundle file (runs of records, gaps included).
    pub bytes_read: u64,
    /// Read calls.
    pub reads: u64,
}

impl CacheCounters {
    /// Cache hits over cold accesses (1 when there were none).
    pub fn hit_rate(&self) -> f64 {
        let cold = self.hits + self.misses;
        if cold == 0 { 1.0 } else { self.hits as f64 / cold as f64 }
    }
}

pub(crate) fn sparsity_err(path: &Path, detail: impl Into<String>) -> Error {
    Error::Sparsity { path: path.to_path_buf(), detail: detail.into() }
}
