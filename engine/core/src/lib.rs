//! spinfer's inference engine.
pub mod gguf;
mod error;
pub use error::{Error, Result};
