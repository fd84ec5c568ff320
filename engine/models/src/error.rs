//! Errors loading or running a model.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// A file this crate writes or reads itself (a head index) is malformed.
    #[error("{path}: {detail}")]
    Format { path: PathBuf, detail: String },
    #[error("context overflow: {needed} tokens needed but the context holds {ctx} (raise --ctx or shorten the prompt)")]
    ContextOverflow { needed: usize, ctx: usize },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The output constraint (grammar, JSON schema) could not go on.
    #[error("output constraint: {0}")]
    Constraint(String),
    /// A device back end (the GPU) failed; `detail` is its error.
    #[error("{device}: {detail}")]
    Device { device: String, detail: String },
    /// A pack's predictor failed or broke its contract.
    #[error("pack {pack}: {detail}")]
    Pack { pack: String, detail: String },
    #[error("kernel '{kernel}': {source}")]
    Kernel { kernel: String, source: spinfer_kernels::KernelError },
    #[error(transparent)]
    Kernels(#[from] spinfer_kernels::KernelError),
    /// The model file.
    #[error(transparent)]
    File(#[from] spinfer_formats::Error),
    #[error(transparent)]
    Tokenizer(#[from] spinfer_tokenizer::Error),
    /// The kernel registry (no kernel for an operation, a bad pin).
    #[error(transparent)]
    Select(#[from] spinfer_kernel_select::Error),
    /// The sparse FFN (sidecar, bundle).
    #[error(transparent)]
    Sparsity(#[from] spinfer_sparsity::Error),
}

impl From<spinfer_sampling::Error> for Error {
    fn from(e: spinfer_sampling::Error) -> Self {
        match e {
            spinfer_sampling::Error::InvalidArgument(m) => Error::InvalidArgument(m),
            spinfer_sampling::Error::Constraint(m) => Error::Constraint(m),
        }
    }
}

impl From<spinfer_storage::Error> for Error {
    fn from(e: spinfer_storage::Error) -> Self {
        match e {
            spinfer_storage::Error::InvalidArgument(m) => Error::InvalidArgument(m),
        }
    }
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
