//! Experimental: BERT's sparse FFN (TEAL on `W2`'s input), with its JSON
//! sidecar and calibration. Measured not to pay on all-MiniLM-L6-v2 (the
//! FFN is a small part of a short sentence's time; docs/sparsity.md,
//! "Sparse FFN" under sentence embeddings); kept for its quality curve. The
//! dense embedder does not depend on it beyond the optional hook
//! `BertModel::sparse`.
pub mod bert_sparse;
mod embed_sparsity;
