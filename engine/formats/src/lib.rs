//! spinfer's model files: the GGUF and safetensors readers, the [`Loader`]
//! trait the model code reads weights through, tensor views and the models'
//! hyper-parameters.
//!
//! Architecture invariant: every count, size and offset read from a file is
//! checked against the file before anything is allocated or sliced; a bad
//! file is an [`Error`] naming it, never a panic.
pub mod bert_config;
pub mod bounded;
pub mod config;
mod error;
#[cfg(feature = "fixtures")]
pub mod fixtures;
pub mod gguf;
mod hf_config;
pub mod loader;
pub mod requant;
pub mod safetensors;
pub mod tensor;

pub use config::{Arch, FfnAct, ModelConfig, RopeStyle, SlidingWindow};
pub use error::{Error, Result};
pub use loader::Loader;
