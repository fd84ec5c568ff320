#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A budget, a buffer or a thread that cannot be had, with the figures.
    #[error("{0}")]
    InvalidArgument(String),
}

pub type Result<T> = std::result::Result<T, Error>;
