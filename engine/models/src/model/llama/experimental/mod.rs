//! Experimental sparse FFN paths: measured not to pay on the models here
//! (docs/sparsity.md), kept for their quality curves. The sentence-level
//! mask (`Predictor::Sentence`) lives here; the gate-threshold and top-k
//! predictors' per-token selection is `spinfer_sparsity::experimental`.
pub(super) mod sentence_ffn;
