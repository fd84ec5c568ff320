//! The crate's error type.

/// Why CUDA cannot be used (the reason a zero score carries).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CudaUnavailable {
    /// This build has no CUDA support.
    #[error("cuda support is not compiled in (build with feature `{feature}`)")]
    NotCompiled { feature: &'static str },
    /// The CUDA driver library (`libcuda`) cannot be opened.
    #[error("the cuda driver library (libcuda) was not found: no nvidia driver installed")]
    NoDriver,
    /// The driver loaded but reports no device.
    #[error("the cuda driver reports no device")]
    NoDevice,
    /// A driver call failed.
    #[error("cuda driver error in {call}: {detail}")]
    Driver { call: &'static str, detail: String },
}

/// Everything that can go wrong using the CUDA kernels.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable device (or no CUDA in this build).
    #[error(transparent)]
    Unavailable(#[from] CudaUnavailable),
    /// The run-time compiler library (`libnvrtc`) cannot be opened.
    #[error(
        "the cuda run-time compiler (libnvrtc) was not found: install the CUDA toolkit or the \
         nvidia-cuda-nvrtc wheel and put its lib folder on LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    /// NVRTC rejected a kernel source: the log names the line.
    #[error("nvrtc could not compile the {module} kernels for {arch}: {log}")]
    Compile { module: &'static str, arch: String, log: String },
    /// A driver call failed (allocation, copy, module load, launch).
    #[error("cuda driver error in {call}: {detail}")]
    Driver { call: &'static str, detail: String },
    /// Shapes, lengths or indices that do not fit the operation.
    #[error("{op}: {detail}")]
    Shape { op: &'static str, detail: String },
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, CudaError>;
