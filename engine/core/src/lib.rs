//! spinfer's inference engine.
pub mod calibrate;
pub mod config;
pub mod convert;
pub mod embed;
mod embed_sparsity;
pub mod engine;
mod error;
pub mod generate;
pub mod head;
pub mod inspect;
pub mod model;
pub mod perplexity;
pub mod provider;
pub mod sampling;
pub mod sparse {
    //! Activation sparsity: the `spinfer-sparsity` crate and calibration.
    pub use crate::calibrate;
    pub use spinfer_sparsity::*;
}
pub use engine::Engine;
pub use error::{Error, Result};
pub use spinfer_formats::{gguf, loader, safetensors, tensor};
pub use spinfer_kernel_select::{registry, tuning};
pub use spinfer_packs as packs;
pub use spinfer_tokenizer as tokenizer;
