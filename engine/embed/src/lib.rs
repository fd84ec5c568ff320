//! spinfer's sentence embedders: a BERT encoder read from a
//! sentence-transformers directory, pooling and normalisation as
//! `SentenceTransformer.encode` computes them, and BERT's experimental
//! sparse FFN with its calibration.
pub mod bert;
mod bert_math;
pub mod bert_sparse;
pub mod embed;
mod embed_sparsity;
mod error;

pub use embed::{Embedder, Embedding};
pub use error::{Error, Result};
