//! Which predictor a sparse FFN runs, carrying what it needs.

use spinfer_kernel_select::registry::Found;
use spinfer_plugin_api::PredictorBox;

use crate::PredictorKind;
use crate::lowrank::LowRank;

/// The predictor a sparse FFN runs, with what it needs: the calibrated
/// kinds read their per-layer numbers from [`crate::SparseLayer`]; the low-rank
/// predictor carries every layer's factors, a pack's its object.
///
/// Experimental (measured not to pay on the models here, docs/sparsity.md):
/// `GateThreshold`, `TopK` and `Sentence` compute the full gate (or the
/// whole prompt densely) before choosing, so they save only the up and down
/// rows; they stay for the quality curves.
pub enum Predictor {
    /// Experimental ([`crate::experimental::gate_threshold`]): CATS's
    /// per-layer gate threshold.
    GateThreshold,
    /// Experimental ([`crate::experimental::top_k`]): a fixed number of
    /// neurons per layer.
    TopK,
    /// TEAL on the down projection's input.
    InputMagnitude,
    /// Experimental (the models crate's `model::llama::experimental`): one
    /// mask per request.
    Sentence,
    /// One rank-r predictor per layer.
    LowRank(Vec<LowRank>),
    /// A pack's predictor (`--predictor pack:<pack>/<name>`).
    Pack(Found<PredictorBox>),
}

impl Predictor {
    /// Which kind it is (for reports and the per-token paths).
    pub fn kind(&self) -> PredictorKind {
        match self {
            Predictor::GateThreshold => PredictorKind::GateThreshold,
            Predictor::TopK => PredictorKind::TopK,
            Predictor::InputMagnitude => PredictorKind::InputMagnitude,
            Predictor::Sentence => PredictorKind::Sentence,
            Predictor::LowRank(_) => PredictorKind::LowRank,
            Predictor::Pack(_) => PredictorKind::Pack,
        }
    }

    /// Bytes of the low-rank factors (0 for the others).
    pub fn bytes(&self) -> usize {
        match self {
            Predictor::LowRank(l) => l.iter().map(LowRank::bytes).sum(),
            _ => 0,
        }
    }
}
