//! The reference sparsity plugins: the simplest predictor and cache policy
//! that are correct, so a host's plugin path can be checked end to end
//! against its built-in ones, and a working example of each trait.
//!
//! * `keep-all` ([`KeepAll`]): predicts every neuron active. Through a
//!   host's pack-predictor path it must give the dense model's output (up
//!   to the sparse kernels' summation order): it checks the wiring, not a
//!   speed-up.
//! * `fifo` ([`Fifo`]): evicts the neuron admitted first, whatever its
//!   uses since. A host must give the same results with it as with any
//!   other policy; only its cache counters differ.

use std::collections::VecDeque;

use spinfer_plugin_api::abi_stable::sabi_extern_fn;
use spinfer_plugin_api::abi_stable::sabi_trait::TD_Opaque;
use spinfer_plugin_api::abi_stable::std_types::{RErr, ROk, ROption, RResult, RSlice, RSliceMut, RString, RVec};
use spinfer_plugin_api::{
    CachePolicy, CachePolicy_TO, CachePolicyBox, NeuronId, PackError, Predictor, Predictor_TO, PredictorBox,
    PredictorSpec,
};

/// Predicts every neuron of every layer active.
pub struct KeepAll {
    n_layers: u32,
    hidden_dim: usize,
    ffn_dim: usize,
}

impl KeepAll {
    pub fn new(spec: &PredictorSpec) -> Self {
        Self { n_layers: spec.n_layers, hidden_dim: spec.hidden_dim as usize, ffn_dim: spec.ffn_dim as usize }
    }
}

impl Predictor for KeepAll {
    fn name(&self) -> RString {
        "keep-all".into()
    }

    fn predict(
        &self,
        layer: u32,
        hidden: RSlice<'_, f32>,
        mut out_mask: RSliceMut<'_, u8>,
    ) -> RResult<usize, PackError> {
        if layer >= self.n_layers {
            return RErr(PackError::invalid_argument(format!("layer {layer} of a {}-layer model", self.n_layers)));
        }
        if hidden.len() != self.hidden_dim || out_mask.len() != self.ffn_dim {
            return RErr(PackError::invalid_argument(format!(
                "hidden state of {} values and mask of {} entries, expected {} and {}",
                hidden.len(),
                out_mask.len(),
                self.hidden_dim,
                self.ffn_dim
            )));
        }
        out_mask.iter_mut().for_each(|m| *m = 1);
        ROk(self.ffn_dim)
    }
}

/// First in, first out: evicts the resident neuron admitted longest ago.
#[derive(Default)]
pub struct Fifo {
    resident: VecDeque<NeuronId>,
}

impl CachePolicy for Fifo {
    fn name(&self) -> RString {
        "fifo".into()
    }

    fn on_access(&mut self, _neuron: NeuronId) {}

    fn admit(&mut self, neuron: NeuronId) -> bool {
        self.resident.push_back(neuron);
        true
    }

    fn evict(&mut self) -> ROption<NeuronId> {
        self.resident.pop_front().into()
    }
}

/// `predictors` entry point: [`KeepAll`] for any model.
#[sabi_extern_fn]
pub fn predictors(spec: &PredictorSpec) -> RVec<PredictorBox> {
    RVec::from(vec![Predictor_TO::from_value(KeepAll::new(spec), TD_Opaque)])
}

/// `cache_policies` entry point: a fresh [`Fifo`].
#[sabi_extern_fn]
pub fn cache_policies(_capacity: u64) -> RVec<CachePolicyBox> {
    RVec::from(vec![CachePolicy_TO::from_value(Fifo::default(), TD_Opaque)])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> PredictorSpec {
        PredictorSpec { arch: "llama".into(), model_dir: "".into(), n_layers: 2, hidden_dim: 4, ffn_dim: 6 }
    }

    #[test]
    fn keep_all_marks_every_neuron_and_checks_shapes() {
        let p = &predictors(&spec())[0];
        assert_eq!(p.name().as_str(), "keep-all");
        let mut mask = [0u8; 6];
        let n = p.predict(1, [0.5f32; 4].as_slice().into(), RSliceMut::from_mut_slice(&mut mask)).unwrap();
        assert_eq!((n, mask), (6, [1; 6]));
        assert!(
            p.predict(2, [0.5f32; 4].as_slice().into(), RSliceMut::from_mut_slice(&mut mask)).into_result().is_err()
        );
        assert!(
            p.predict(0, [0.5f32; 3].as_slice().into(), RSliceMut::from_mut_slice(&mut mask)).into_result().is_err()
        );
    }

    #[test]
    fn fifo_evicts_in_admission_order_whatever_the_uses() {
        let mut c = cache_policies(4).remove(0);
        let n = |i| NeuronId { layer: 0, index: i };
        assert!(c.admit(n(1)) && c.admit(n(2)) && c.admit(n(3)));
        c.on_access(n(1));
        assert_eq!(c.evict().into_option(), Some(n(1)));
        assert_eq!(c.evict().into_option(), Some(n(2)));
        assert_eq!(c.evict().into_option(), Some(n(3)));
        assert_eq!(c.evict().into_option(), None);
    }
}
