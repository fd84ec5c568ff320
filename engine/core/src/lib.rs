//! spinfer's inference engine.
pub mod convert;
pub mod engine;
mod error;
pub mod generate;
pub mod gguf;
pub mod inspect;
pub mod loader;
pub mod model;
pub mod perplexity;
pub mod registry;
pub mod safetensors;
pub mod sampling;
pub mod tensor;
pub mod tokenizer;
pub use engine::Engine;
pub use error::{Error, Result};
