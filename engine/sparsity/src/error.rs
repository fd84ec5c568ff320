//! Errors loading or running a sparse FFN.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// A sidecar or bundle that cannot be used; says why.
    #[error("sparsity file {path}: {detail}")]
    Sparsity { path: PathBuf, detail: String },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A kernel failed while serving a sparse product.
    #[error("kernel '{kernel}': {source}")]
    Kernel { kernel: String, source: spinfer_kernels::KernelError },
    #[error(transparent)]
    Kernels(#[from] spinfer_kernels::KernelError),
    /// The kernel registry (resolving a sparse product's kernel).
    #[error(transparent)]
    Select(#[from] spinfer_kernel_select::Error),
    /// The model file the sidecar belongs to.
    #[error(transparent)]
    File(#[from] spinfer_formats::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}
