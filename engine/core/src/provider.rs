//! [`EmbeddingProvider`]: the one interface applications (a vector memory,
//! a retrieval layer) need from an embedding model, implemented by both of
//! spinfer's embedders:
//!
//! - [`crate::embed::Embedder`]: a sentence-transformers encoder (e.g.
//!   all-MiniLM-L6-v2, 384 dimensions), the embedding the model was trained
//!   to give; the empty string is embedded as `[CLS] [SEP]`;
//! - [`crate::Engine`]: a decoder LLM (e.g. SmolLM2-135M, 576 dimensions),
//!   the mean of its final-normed hidden states over the text's tokens;
//!   the empty string is an error (see [`crate::Engine::embed`]).
//!
//! Both return unit-length vectors (the `Embedder` when its module list
//! normalises, as all-MiniLM-L6-v2's does), so cosine similarity is a dot
//! product. Both are `Send + Sync` and may be called from many threads at
//! once; results do not depend on concurrency or batching: `embed(t)`
//! equals the row of `t` in `embed_batch`.
//!
//! ```no_run
//! use spinfer_engine::embed::{Embedder, EmbedderOptions};
//! use spinfer_engine::provider::EmbeddingProvider;
//!
//! let e = Embedder::load("models/all-MiniLM-L6-v2".as_ref(), EmbedderOptions::default())?;
//! let p: &dyn EmbeddingProvider = &e;
//! let v = p.embed_batch(&["a cat", "a dog"])?;
//! assert_eq!(v[0].len(), p.dimensions());
//! # Ok::<(), spinfer_engine::Error>(())
//! ```

use std::sync::Arc;

use crate::embed::Embedder;
use crate::{Engine, Result};

/// Text in, fixed-width vector out.
pub trait EmbeddingProvider: Send + Sync {
    /// The embedding of one text: [`EmbeddingProvider::dimensions`] values.
    fn embed(&self, text: &str) -> Result<Vec<f32>>;

    /// Embeddings of several texts, in order; fails as a whole if any text
    /// fails.
    fn embed_batch(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        texts.iter().map(|t| self.embed(t)).collect()
    }

    /// Width of the vectors.
    fn dimensions(&self) -> usize;
}

impl EmbeddingProvider for Engine {
    fn embed(&self, text: &str) -> Result<Vec<f32>> {
        Engine::embed(self, text)
    }

    fn embed_batch(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        Engine::embed_batch(self, texts)
    }

    fn dimensions(&self) -> usize {
        Engine::dimensions(self)
    }
}

impl EmbeddingProvider for Embedder {
    fn embed(&self, text: &str) -> Result<Vec<f32>> {
        Ok(Embedder::embed(self, text)?)
    }

    fn embed_batch(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        Ok(Embedder::embed_batch(self, texts)?)
    }

    fn dimensions(&self) -> usize {
        Embedder::dimensions(self)
    }
}

impl<T: EmbeddingProvider + ?Sized> EmbeddingProvider for Arc<T> {
    fn embed(&self, text: &str) -> Result<Vec<f32>> {
        (**self).embed(text)
    }

    fn embed_batch(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        (**self).embed_batch(texts)
    }

    fn dimensions(&self) -> usize {
        (**self).dimensions()
    }
}

impl<T: EmbeddingProvider + ?Sized> EmbeddingProvider for Box<T> {
    fn embed(&self, text: &str) -> Result<Vec<f32>> {
        (**self).embed(text)
    }

    fn embed_batch(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        (**self).embed_batch(texts)
    }

    fn dimensions(&self) -> usize {
        (**self).dimensions()
    }
}
