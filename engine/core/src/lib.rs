//! spinfer's inference engine.
pub mod config;
pub mod convert;
pub mod engine;
mod error;
pub mod inspect;
pub mod metrics;
pub mod perplexity;
pub mod provider;
mod server_config;
pub mod model {
    //! The models: the Llama family (`spinfer-models`) and BERT
    //! (`spinfer-embed`).
    pub use spinfer_embed::bert;
    pub use spinfer_embed::experimental::bert_sparse;
    pub use spinfer_models::model::*;
}
pub mod sparse {
    //! Activation sparsity: the `spinfer-sparsity` crate and calibration.
    pub use spinfer_models::calibrate;
    pub use spinfer_sparsity::*;
}
pub use engine::Engine;
pub use error::{Error, Result};
pub use spinfer_embed::embed;
pub use spinfer_formats::{gguf, loader, safetensors, tensor};
pub use spinfer_generate as generate;
pub use spinfer_kernel_select::{registry, tuning};
pub use spinfer_models::{calibrate, placement, sampling, stream};
/// The sparse output head ([`spinfer_models::head`]) and its measurement
/// against the dense head.
pub mod head {
    pub use spinfer_models::head::*;
    pub mod eval;
}
pub use spinfer_grammar as grammar;
pub use spinfer_packs as packs;
pub use spinfer_tokenizer as tokenizer;
