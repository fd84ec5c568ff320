//! spinfer's sentence embedders: a BERT encoder read from a
//! sentence-transformers directory, pooling and normalisation as
//! `SentenceTransformer.encode` computes them, and (in [`experimental`])
//! BERT's sparse FFN with its calibration.
pub mod bert;
mod bert_math;
pub mod embed;
mod error;
pub mod experimental;

pub use embed::{Embedder, Embedding};
pub use error::{Error, Result};
