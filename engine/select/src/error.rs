//! Errors choosing or measuring a kernel.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The history store (or another file) could not be read or written.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// A pin, exclusion or option that names nothing offered.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// No loaded provider offers a kernel for the operation.
    #[error("no kernel serves {op}")]
    NoKernel { op: String },
    #[error(transparent)]
    Kernels(#[from] spinfer_kernels::KernelError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}
