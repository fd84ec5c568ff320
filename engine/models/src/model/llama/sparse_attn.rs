//! The attention output projection, input-sparse (TEAL): per token, the
//! entries of the attention output whose magnitude is at most the layer's
//! calibrated threshold are skipped, and `W_o` accumulates only the kept
//! inputs' columns from its input-major copy.

use super::{Model, Session, grow};
use crate::Result;

impl Model {
    /// `s.tmp = W_o · s.att` for the `n` tokens of this step (layer `l`).
    ///
    /// With an attention threshold in the sidecar, a single token (decode)
    /// runs the AXPY over the kept inputs; several tokens (prefill) zero the
    /// skipped inputs and run the dense kernel, which reads `W_o` once for
    /// all of them. Both compute the same masked product.
    pub(super) fn attn_output(&self, s: &mut Session, l: usize, n: usize) -> Result<()> {
        let c = &self.config;
        let (dim, q_dim) = (c.dim, c.n_heads * c.head_dim);
        let wo = &self.weights.layers[l].wo;
        if let Some(probe) = s.attn_probe.as_mut() {
            probe(l, &s.att[..n * q_dim]);
        }
        let Some((so, mode)) = self.sparse.as_ref().and_then(|sp| Some((sp.layers[l].attn_o.as_ref()?, sp.axpy)))
        else {
            return wo.forward(&s.pool, &s.att, n, &mut s.tmp, &mut s.scratch);
        };
        let sc = &mut s.sparse;
        let counters = &mut sc.stats.layers[l];
        counters.attn_tokens += n as u64;
        if n > 1 {
            for a in s.att[..n * q_dim].iter_mut() {
                if a.abs() > so.threshold {
                    counters.attn_active += 1;
                } else {
                    *a = 0.0;
                }
            }
            return wo.forward(&s.pool, &s.att, n, &mut s.tmp, &mut s.scratch);
        }
        grow(&mut sc.h, q_dim);
        sc.idx.clear();
        let mut k = 0;
        for (i, &a) in s.att[..q_dim].iter().enumerate() {
            if a.abs() > so.threshold {
                sc.idx.push(i as u32);
                sc.h[k] = a;
                k += 1;
            }
        }
        counters.attn_active += k as u64;
        so.w.axpy(&s.pool, dim, wo.raw_weights(), &sc.idx, &sc.h[..k], &mut s.tmp[..dim], mode)?;
        Ok(())
    }
}
