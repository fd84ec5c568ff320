//! Errors reading a model file. Messages are lowercase and name the file,
//! tensor or key at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {detail}")]
    Format { path: PathBuf, detail: String },
    #[error("{path}: tensor '{tensor}' not found")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: tensor '{tensor}' has shape {got:?}, expected {want:?}")]
    TensorShape { path: PathBuf, tensor: String, got: Vec<usize>, want: Vec<usize> },
    #[error("{path}: tensor '{tensor}' has type {ty}, which {what}")]
    TensorType { path: PathBuf, tensor: String, ty: String, what: String },
    #[error("{path}: metadata key '{key}' {detail}")]
    Metadata { path: PathBuf, key: String, detail: String },
    #[error("{path}: unsupported architecture '{arch}' (supported: {supported})")]
    UnsupportedArch { path: PathBuf, arch: String, supported: &'static str },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A malformed file: `detail` says what is wrong.
    pub fn format(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        Error::Format { path: path.into(), detail: detail.into() }
    }

    /// A read of `path` failed.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}
