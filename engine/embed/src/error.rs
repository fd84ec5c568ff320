//! Errors loading or running a sentence embedder.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// A configuration file of the model directory is malformed.
    #[error("{path}: {detail}")]
    Format { path: PathBuf, detail: String },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A sparse-FFN sidecar that cannot be used; says why.
    #[error("sparsity file {path}: {detail}")]
    Sparsity { path: PathBuf, detail: String },
    #[error("kernel '{kernel}': {source}")]
    Kernel { kernel: String, source: spinfer_kernels::KernelError },
    #[error(transparent)]
    Kernels(#[from] spinfer_kernels::KernelError),
    /// The checkpoint (config, tensors).
    #[error(transparent)]
    File(#[from] spinfer_formats::Error),
    #[error(transparent)]
    Tokenizer(#[from] spinfer_tokenizer::Error),
    /// The kernel registry.
    #[error(transparent)]
    Select(#[from] spinfer_kernel_select::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn format(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        Error::Format { path: path.into(), detail: detail.into() }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}
