//! The whole forward pass on a CUDA GPU ("full offload"): every weight
//! uploaded once in its GGUF block format, the KV cache and activations on
//! the device, one kernel per step (see `spinfer-kernels-cuda`). Logits
//! come back to the host for sampling.
//!
//! [`GpuModel::load`] reads any [`spinfer_formats::Loader`] (GGUF or
//! safetensors) with the CPU engine's [`spinfer_formats::ModelConfig`];
//! [`GpuModel::forward`] runs tokens at a [`GpuSession`]'s next positions
//! and [`GpuModel::logits`] returns rows of logits, as the CPU `Model`
//! does, so the two can be compared token for token.
//!
//! Built without feature `cuda`, loading answers that CUDA is not compiled
//! in (`spinfer_kernels_cuda::CudaUnavailable::NotCompiled`).

mod decode;
mod ffn;
mod fused;
mod head;
mod hybrid;
mod logits;
mod model;
pub mod placement;
mod proj;
mod slices;

pub use decode::GpuDecode;
pub use hybrid::{ffn_bytes, ffn_costs};
pub use model::{GpuModel, GpuSession, UBATCH};

/// What can go wrong running a model on the GPU.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The device, the compiler or a kernel failed (or CUDA is unavailable).
    #[error(transparent)]
    Cuda(#[from] spinfer_kernels_cuda::CudaError),
    /// Reading the model (file, metadata, tensors).
    #[error(transparent)]
    File(#[from] spinfer_formats::Error),
    /// What the CPU model code reports (context overflow, bad arguments).
    #[error(transparent)]
    Model(#[from] spinfer_models::Error),
    /// A tensor in a format the CUDA kernels do not read.
    #[error("{tensor}: type {ty} has no CUDA kernel yet (supported: {supported})")]
    UnsupportedType { tensor: String, ty: String, supported: String },
    /// Bad arguments (tokens, positions).
    #[error("{0}")]
    InvalidArgument(String),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, GpuError>;

impl From<GpuError> for spinfer_models::Error {
    fn from(e: GpuError) -> Self {
        match e {
            GpuError::Model(e) => e,
            GpuError::File(e) => e.into(),
            other => spinfer_models::Error::Device { device: "cuda".into(), detail: other.to_string() },
        }
    }
}
