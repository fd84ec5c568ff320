//! Errors loading a kernel pack.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The pack was refused or failed (ABI, score, a fault); says which.
    #[error("pack {pack}: {detail}")]
    Pack { pack: String, detail: String },
    /// A setting that cannot be used (a malformed key, a refused pack).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Verification: manifest, signature, hash, install record.
    #[error(transparent)]
    Registry(#[from] spinfer_registry::RegistryError),
    /// The kernel registry or its history store.
    #[error(transparent)]
    Select(#[from] spinfer_kernel_select::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
