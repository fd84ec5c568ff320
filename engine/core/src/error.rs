//! The engine's one error type. Messages are lowercase and name the file,
//! tensor, key or field at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    // === I/O ===
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },

    // === Model files ===
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

    // === Tokenizer ===
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    // === Runtime ===
    #[error("context overflow: {needed} tokens needed but the context holds {ctx} (raise --ctx or shorten the prompt)")]
    ContextOverflow { needed: usize, ctx: usize },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The output constraint (grammar, JSON schema) could not go on.
    #[error("output constraint: {0}")]
    Constraint(String),
    /// An output constraint's spec does not compile (the message is
    /// the whole story: not a `source`, so it is not printed twice).
    #[error("output constraint: {0}")]
    Grammar(spinfer_grammar::Error),
    #[error("no kernel serves {op}")]
    NoKernel { op: String },
    /// A device back end (the GPU) failed; `detail` is its error.
    #[error("{device}: {detail}")]
    Device { device: String, detail: String },
    #[error("kernel '{kernel}': {source}")]
    Kernel { kernel: String, source: spinfer_kernels::KernelError },
    #[error(transparent)]
    Kernels(#[from] spinfer_kernels::KernelError),

    // === Sparsity ===
    #[error("sparsity file {path}: {detail}")]
    Sparsity { path: PathBuf, detail: String },

    // === Packs ===
    #[error("pack {pack}: {detail}")]
    Pack { pack: String, detail: String },
    #[error(transparent)]
    Registry(#[from] spinfer_registry::RegistryError),
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

/// A model file's error keeps its variant (and message) here.
impl From<spinfer_formats::Error> for Error {
    fn from(e: spinfer_formats::Error) -> Self {
        use spinfer_formats::Error as F;
        match e {
            F::Io { path, source } => Error::Io { path, source },
            F::Format { path, detail } => Error::Format { path, detail },
            F::MissingTensor { path, tensor } => Error::MissingTensor { path, tensor },
            F::TensorShape { path, tensor, got, want } => Error::TensorShape { path, tensor, got, want },
            F::TensorType { path, tensor, ty, what } => Error::TensorType { path, tensor, ty, what },
            F::Metadata { path, key, detail } => Error::Metadata { path, key, detail },
            F::UnsupportedArch { path, arch, supported } => Error::UnsupportedArch { path, arch, supported },
        }
    }
}

impl From<spinfer_tokenizer::Error> for Error {
    fn from(e: spinfer_tokenizer::Error) -> Self {
        match e {
            spinfer_tokenizer::Error::Tokenizer(detail) => Error::Tokenizer(detail),
            spinfer_tokenizer::Error::File(e) => e.into(),
        }
    }
}

impl From<spinfer_kernel_select::Error> for Error {
    fn from(e: spinfer_kernel_select::Error) -> Self {
        use spinfer_kernel_select::Error as S;
        match e {
            S::Io { path, source } => Error::Io { path, source },
            S::InvalidArgument(detail) => Error::InvalidArgument(detail),
            S::NoKernel { op } => Error::NoKernel { op },
            S::Kernels(e) => Error::Kernels(e),
        }
    }
}

impl From<spinfer_packs::Error> for Error {
    fn from(e: spinfer_packs::Error) -> Self {
        use spinfer_packs::Error as P;
        match e {
            P::Pack { pack, detail } => Error::Pack { pack, detail },
            P::InvalidArgument(detail) => Error::InvalidArgument(detail),
            P::Registry(e) => Error::Registry(e),
            P::Select(e) => e.into(),
        }
    }
}

impl From<spinfer_sparsity::Error> for Error {
    fn from(e: spinfer_sparsity::Error) -> Self {
        use spinfer_sparsity::Error as S;
        match e {
            S::Io { path, source } => Error::Io { path, source },
            S::Sparsity { path, detail } => Error::Sparsity { path, detail },
            S::InvalidArgument(detail) => Error::InvalidArgument(detail),
            S::Kernel { kernel, source } => Error::Kernel { kernel, source },
            S::Kernels(e) => Error::Kernels(e),
            S::Select(e) => e.into(),
            S::File(e) => e.into(),
        }
    }
}

impl From<spinfer_models::Error> for Error {
    fn from(e: spinfer_models::Error) -> Self {
        use spinfer_models::Error as M;
        match e {
            M::Io { path, source } => Error::Io { path, source },
            M::Format { path, detail } => Error::Format { path, detail },
            M::ContextOverflow { needed, ctx } => Error::ContextOverflow { needed, ctx },
            M::InvalidArgument(detail) => Error::InvalidArgument(detail),
            M::Constraint(detail) => Error::Constraint(detail),
            M::Device { device, detail } => Error::Device { device, detail },
            M::Pack { pack, detail } => Error::Pack { pack, detail },
            M::Kernel { kernel, source } => Error::Kernel { kernel, source },
            M::Kernels(e) => Error::Kernels(e),
            M::File(e) => e.into(),
            M::Tokenizer(e) => e.into(),
            M::Select(e) => e.into(),
            M::Sparsity(e) => e.into(),
        }
    }
}

impl From<spinfer_embed::Error> for Error {
    fn from(e: spinfer_embed::Error) -> Self {
        use spinfer_embed::Error as B;
        match e {
            B::Io { path, source } => Error::Io { path, source },
            B::Format { path, detail } => Error::Format { path, detail },
            B::InvalidArgument(detail) => Error::InvalidArgument(detail),
            B::Sparsity { path, detail } => Error::Sparsity { path, detail },
            B::Kernel { kernel, source } => Error::Kernel { kernel, source },
            B::Kernels(e) => Error::Kernels(e),
            B::File(e) => e.into(),
            B::Tokenizer(e) => e.into(),
            B::Select(e) => e.into(),
        }
    }
}

impl From<spinfer_grammar::Error> for Error {
    fn from(e: spinfer_grammar::Error) -> Self {
        Error::Grammar(e)
    }
}
