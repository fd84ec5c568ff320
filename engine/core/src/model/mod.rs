//! Model definitions.
pub mod bert;
pub mod bert_sparse;
pub mod config;
pub mod llama;
pub mod math;

pub use config::{Arch, ModelConfig, RopeStyle};
pub use llama::{Model, ModelOptions, Precision, Session};
