//! CUDA kernels for spinfer: quantised GEMV and small-batch GEMM straight on
//! GGUF blocks, the sparse (gathered-row and gathered-column) products, and
//! the ternary formats.
//!
//! Feature `cuda` (off by default) builds the real backend on `cudarc` with
//! `dynamic-loading`: nothing is linked at build time, so the crate builds
//! without a CUDA toolkit; `libcuda` and `libnvrtc` are opened at run time.
//! The kernels are CUDA C (`src/cu/`), compiled by NVRTC for the device's
//! compute capability on first use of a format and cached on disk
//! ([`kernel_cache_dir`]). Without the feature a candle-style shim answers
//! [`CudaUnavailable::NotCompiled`].
//!
//! * [`probe`] describes device 0 or says why there is none; [`score`]
//!   turns that into a kernel-provider score (0 plus the reason when
//!   unavailable). Neither creates a context.
//! * [`CudaBackend`] owns the context: upload weights once
//!   ([`DeviceMatrix`]), then [`CudaBackend::gemv`] (dense or on gathered
//!   rows) and [`CudaBackend::axpy_rows`] (the sparse down projection on a
//!   neuron-major copy), and the other steps of a transformer layer
//!   (`rms_norm`, `rope`, `attention`, `swiglu`, ..., `embed_rows`).
//! * [`compile_check`] compiles every format's kernels through NVRTC
//!   without a device: CI's guard against syntax and type errors.

mod backend;
mod buffers;
mod error;
mod format;
mod fused;
mod ops;
mod synthetic;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(not(feature = "cuda"))]
mod cuda_disabled;

#[cfg(feature = "cuda")]
use cuda as imp;
#[cfg(not(feature = "cuda"))]
use cuda_disabled as imp;

pub use backend::{CudaBackend, DeviceGraph};
pub use buffers::{DeviceActs, DeviceBuf, DeviceMatrix, DeviceRows, Elem, HostBuf, Slice, SliceMut};
pub use error::{CudaError, CudaUnavailable, Result};
pub use format::{
    AXPY_BATCHES, ActType, GEMV_BATCHES, WeightFormat, format_source, kernel_source, ops_source, products_source,
};
pub use fused::{GluAct, Prologue};
pub use ops::{
    ARGMAX_SCRATCH, AttentionScratch, AttentionShape, DECODE_TOKENS, KvCache, MAX_ATTENTION_POSITIONS, Position,
    QkNorm, QkvRows, RopePairs, RopeShape,
};
pub use synthetic::{synthetic_acts, synthetic_matrix};

/// Score of a usable CUDA device (above every CPU provider; ggml likewise
/// prefers a GPU backend over any CPU variant).
pub const SCORE_CUDA: u32 = 1 << 10;

/// The ABI of a CUDA pack's product kernels (its `pack.toml`'s
/// `abi_version`): a source shaped as [`products_source`] whose
/// `FORMAT(name, Struct)` macro instantiates, for every format, the kernels
/// this crate launches under their names and parameter lists
/// (`gemv_<fmt>_<Act>_b<B>`, `gemv_fused_<fmt>_b<B>`, `gemm_<fmt>_<Act>`,
/// `axpy_rows_<fmt>_b<B>`, `dequant_rows_<fmt>`, as in `src/cu/gemv.cu`).
pub const PACK_ABI_VERSION: u32 = 1;

/// What [`probe`] found: CUDA device 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal (always 0 today).
    pub ordinal: usize,
    /// Devices the driver reports.
    pub device_count: usize,
    /// Device name, e.g. `"NVIDIA H100 80GB HBM3"`.
    pub name: String,
    /// Total device memory in bytes.
    pub total_memory: usize,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Driver API version as reported by the driver (e.g. 12080).
    pub driver_version: i32,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (major, minor) = self.compute_capability;
        write!(
            f,
            "cuda:{} {} ({:.1} GiB, compute capability {major}.{minor}, driver api {}, {} device(s))",
            self.ordinal,
            self.name,
            self.total_memory as f64 / (1u64 << 30) as f64,
            self.driver_version,
            self.device_count
        )
    }
}

/// Describes CUDA device 0, or says why CUDA is unavailable. Never creates
/// a context and never panics.
///
/// # Errors
///
/// [`CudaUnavailable`] naming the reason.
pub fn probe() -> std::result::Result<DeviceInfo, CudaUnavailable> {
    imp::probe()
}

/// The provider score and a one-line explanation: `(0, reason)` when CUDA
/// is unavailable, `(SCORE_CUDA, device description)` otherwise.
pub fn score() -> (u32, String) {
    match probe() {
        Ok(dev) => (SCORE_CUDA, dev.to_string()),
        Err(why) => (0, why.to_string()),
    }
}

/// Where compiled kernels are cached: `$SPINFER_CUDA_CACHE`, else
/// `$XDG_CACHE_HOME/spinfer/cuda`, else `$HOME/.cache/spinfer/cuda`; `None`
/// when none is set (kernels are then compiled in every process).
pub fn kernel_cache_dir() -> Option<std::path::PathBuf> {
    let var = |k| std::env::var_os(k).filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
    var("SPINFER_CUDA_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("spinfer/cuda")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/spinfer/cuda")))
}

/// Compiles every module (one per weight format, then the format-independent
/// steps) through NVRTC for `arch` (e.g. `"compute_90"`) without a device,
/// returning each module's name and PTX size. Never reads the PTX cache.
///
/// # Errors
///
/// [`CudaError::NoNvrtc`] without `libnvrtc`, [`CudaError::Compile`] with
/// the compiler's log, `NotCompiled` without feature `cuda`.
pub fn compile_check(arch: &str) -> Result<Vec<(&'static str, usize)>> {
    let modules = WeightFormat::ALL.into_iter().map(backend::Module::Format).chain([backend::Module::Ops]);
    modules.map(|m| Ok((m.name(), imp::compile_ptx(m, &m.source(), arch, false)?.len()))).collect()
}

/// [`compile_check`] of a CUDA pack's product kernels (`products`, see
/// [`products_source`]) for `formats`, without a device.
///
/// # Errors
///
/// As [`compile_check`].
pub fn compile_check_products(
    products: &str,
    formats: &[WeightFormat],
    arch: &str,
) -> Result<Vec<(&'static str, usize)>> {
    let one = |f: WeightFormat| {
        let src = format::format_source(products, f);
        Ok((f.name(), imp::compile_ptx(backend::Module::Format(f), &src, arch, false)?.len()))
    };
    formats.iter().map(|&f| one(f)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unavailable_reasons_read_well() {
        assert_eq!(
            CudaUnavailable::NotCompiled { feature: "cuda" }.to_string(),
            "cuda support is not compiled in (build with feature `cuda`)"
        );
        let d = DeviceInfo {
            ordinal: 0,
            device_count: 1,
            name: "NVIDIA H100".into(),
            total_memory: 80 << 30,
            compute_capability: (9, 0),
            driver_version: 12080,
        };
        assert_eq!(
            d.to_string(),
            "cuda:0 NVIDIA H100 (80.0 GiB, compute capability 9.0, driver api 12080, 1 device(s))"
        );
    }
}
