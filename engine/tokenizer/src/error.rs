//! Errors building or running a tokenizer.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The vocabulary, merges or a text could not be used; says why.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The file the tokenizer comes from (GGUF metadata, `tokenizer.json`).
    #[error(transparent)]
    File(#[from] spinfer_formats::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
