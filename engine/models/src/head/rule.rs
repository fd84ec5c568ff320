//! The sparse head's rule on the host, apart from any kernel: rank the
//! clusters from their mean rows' scores, list the rows to compute exactly,
//! and fill the logit vector (exact rows over stand-ins). The CPU head
//! (`sparse.rs`) and the GPU's (`spinfer-gpu`) compute the scores and the
//! exact rows with their own kernels and share this.

use bytemuck::Zeroable;
use spinfer_kernels::blocks::BlockQ8_0;
use spinfer_kernels::quantize::quantize_row_q8_0_ref;

use super::HeadIndex;
use crate::{Error, Result};

/// Standard deviations of its spread added to a cluster's score to rank
/// it: the likely best row of the cluster rather than its mean. Chosen by
/// measurement (docs/sparsity.md: 0.5 … 4 tried, 3 and 4 equal).
const RANK_SIGMAS: f32 = 3.0;

/// The head a [`HeadRule`] is bound to: its shape, tensor name and GGML
/// type name (as the index names them).
#[derive(Clone, Copy, Debug)]
pub struct HeadShape<'a> {
    pub vocab: usize,
    pub dim: usize,
    pub tensor: &'a str,
    pub tensor_type: &'a str,
}

/// A [`HeadIndex`] checked against one head, with the tables the rule
/// reads per token.
pub struct HeadRule {
    pub index: HeadIndex,
    /// The cluster of each row, `clusters` for the hot rows (vocab).
    cluster_of: Vec<u32>,
    /// With the cluster-ordered copy: each row's position in it (vocab).
    position_of: Vec<u32>,
    /// Per cluster: added to its score to rank it, and to stand in for
    /// its rows (`RANK_SIGMAS · σ` and `σ² / 2`).
    rank_bonus: Vec<f32>,
    mass_bonus: Vec<f32>,
    /// Clusters whose rows get exact logits, per token.
    pub probes: usize,
}

impl HeadRule {
    /// Binds `index` (checked against `head`) with `probes` clusters per
    /// token; also returns the cluster means as a Q8_0 matrix
    /// (`clusters × dim`), what the scores are computed from (the f32
    /// means are dropped: 10 MB for Gemma 3).
    pub fn new(head: HeadShape<'_>, mut index: HeadIndex, probes: usize) -> Result<(Self, Vec<u8>)> {
        let (k, dim) = (index.clusters(), head.dim);
        if probes == 0 || probes > k {
            return Err(Error::InvalidArgument(format!("head probes must be in 1..={k} (its clusters), got {probes}")));
        }
        // The sha256 was checked when the index was read (HeadIndex::load)
        // or built from this model; the shape is checked again here.
        let m = &index.model;
        if (m.vocab_size, m.dim, m.tensor.as_str(), m.tensor_type.as_str())
            != (head.vocab, dim, head.tensor, head.tensor_type)
        {
            return Err(Error::InvalidArgument(format!(
                "the head index was built for a {} x {} {} head ({}), not this model's {} x {} {} ({})",
                m.vocab_size, m.dim, m.tensor_type, m.tensor, head.vocab, dim, head.tensor_type, head.tensor
            )));
        }
        if !dim.is_multiple_of(32) {
            return Err(Error::InvalidArgument(format!(
                "the sparse head needs a hidden size divisible by 32, not {dim}"
            )));
        }
        let mut blocks = vec![BlockQ8_0::zeroed(); k * dim / 32];
        quantize_row_q8_0_ref(&index.means, &mut blocks)?;
        let centroids = bytemuck::cast_slice::<BlockQ8_0, u8>(&blocks).to_vec();
        index.means = Vec::new();
        let mut cluster_of = vec![k as u32; index.model.vocab_size];
        for c in 0..k {
            index.members(c).iter().for_each(|&r| cluster_of[r as usize] = c as u32);
        }
        let rank_bonus = index.spread.iter().map(|s| RANK_SIGMAS * s.sqrt()).collect();
        let mass_bonus = index.spread.iter().map(|s| s / 2.0).collect();
        let mut position_of = Vec::new();
        if index.rows.is_some() {
            position_of = vec![0u32; index.model.vocab_size];
            index.members.iter().enumerate().for_each(|(p, &r)| position_of[r as usize] = p as u32);
        }
        Ok((Self { index, cluster_of, position_of, rank_bonus, mass_bonus, probes }, centroids))
    }

    /// Takes the cluster-ordered copy of the head out of the index, when
    /// it has one (a head that reads rows in place drops it).
    pub fn take_rows(&mut self) -> Option<spinfer_formats::tensor::TensorData> {
        self.index.rows.take()
    }

    /// Row `token`'s position in the cluster-ordered copy (`None` without
    /// one).
    pub fn position_of(&self, token: u32) -> Option<usize> {
        self.position_of.get(token as usize).map(|&p| p as usize)
    }

    /// Bytes of the rule's tables: the index's and the row maps.
    pub fn table_bytes(&self) -> usize {
        let i = &self.index;
        4 * (i.members.len() + i.offsets.len() + i.spread.len())
            + 4 * (self.cluster_of.len() + self.position_of.len() + self.rank_bonus.len() + self.mass_bonus.len())
    }

    /// The key cluster `c` with mean-row logit `score` is ranked by.
    pub fn rank_key(&self, c: usize, score: f32) -> f32 {
        score + self.rank_bonus[c]
    }

    /// The logit an unprobed row of cluster `c` with mean-row logit
    /// `score` stands in with, before it is held below the best exact one.
    pub fn stand_in(&self, c: usize, score: f32) -> f32 {
        score + self.mass_bonus[c]
    }

    /// From the cluster scores in `hs` ([`HeadScratch::scores_mut`]): the
    /// best `probes` clusters by rank key, and the rows to compute exactly
    /// into [`HeadScratch::rows`], ascending: with `in_copy`, positions in
    /// the cluster-ordered copy (the hot rows first, then one range per
    /// probed cluster); otherwise vocabulary rows, read in place.
    pub fn select(&self, hs: &mut HeadScratch, in_copy: bool) {
        let k = self.index.clusters();
        hs.keys.clear();
        hs.keys.extend(hs.scores[..k].iter().enumerate().map(|(c, &s)| self.rank_key(c, s)));
        let keys = &hs.keys;
        hs.order.clear();
        hs.order.extend(0..k as u32);
        let by_key = |a: &u32, b: &u32| keys[*b as usize].total_cmp(&keys[*a as usize]).then(a.cmp(b));
        if self.probes < k {
            hs.order.select_nth_unstable_by(self.probes - 1, by_key);
        }
        let probed = &mut hs.order[..self.probes];
        probed.sort_unstable();
        hs.rows.clear();
        if in_copy {
            hs.rows.extend(0..self.index.offsets[0]);
            for &c in probed.iter() {
                hs.rows.extend(self.index.offsets[c as usize]..self.index.offsets[c as usize + 1]);
            }
            return;
        }
        let vocab = self.cluster_of.len();
        hs.bits.clear();
        hs.bits.resize(vocab.div_ceil(64), 0);
        let mut set = |r: u32| hs.bits[r as usize / 64] |= 1 << (r % 64);
        self.index.hot().iter().for_each(|&r| set(r));
        for &c in probed.iter() {
            self.index.members(c as usize).iter().for_each(|&r| set(r));
        }
        for (w, &word) in hs.bits.iter().enumerate() {
            let mut b = word;
            while b != 0 {
                hs.rows.push((w * 64) as u32 + b.trailing_zeros());
                b &= b - 1;
            }
        }
    }

    /// With the exact logits of [`HeadScratch::rows`] in
    /// [`HeadScratch::exact_mut`]: every row of `logits` (vocab), a
    /// stand-in held below the best exact logit (one per cluster, plus one
    /// slot the hot rows point at, since they are all written exactly
    /// below), then the exact logits over them. Counts the token in the
    /// stats, with `bytes` read for it.
    pub fn fill(&self, hs: &mut HeadScratch, in_copy: bool, logits: &mut [f32], bytes: usize) {
        let (k, n) = (self.index.clusters(), hs.rows.len());
        let best = hs.exact[..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let ceiling = best.next_down();
        let stand = &mut hs.keys;
        stand.clear();
        stand.extend(hs.scores[..k].iter().enumerate().map(|(c, &s)| self.stand_in(c, s).min(ceiling)));
        stand.push(ceiling);
        for (l, &c) in logits.iter_mut().zip(&self.cluster_of) {
            *l = stand[c as usize];
        }
        let vocab_row = |p: u32| if in_copy { self.index.members[p as usize] } else { p };
        for (&p, &v) in hs.rows.iter().zip(&hs.exact[..n]) {
            logits[vocab_row(p) as usize] = v;
        }
        hs.stats.tokens += 1;
        hs.stats.rows += n as u64;
        hs.stats.bytes += bytes as u64;
    }
}

impl HeadRule {
    /// The greedy pick from the exact logits of [`HeadScratch::rows`] in
    /// [`HeadScratch::exact_mut`], without filling a logit vector: the
    /// token [`HeadRule::fill`]'s vector has its first largest logit at
    /// (no stand-in reaches the best exact logit; 0 when no exact logit
    /// is above -inf, as the sampler's rule gives). Counts the token in the
    /// stats, with `bytes` read for it.
    pub fn pick(&self, hs: &mut HeadScratch, in_copy: bool, bytes: usize) -> u32 {
        let n = hs.rows.len();
        let vocab_row = |p: u32| if in_copy { self.index.members[p as usize] } else { p };
        let mut best: Option<(u32, f32)> = None;
        for (&p, &v) in hs.rows.iter().zip(&hs.exact[..n]) {
            let r = vocab_row(p);
            if v > f32::NEG_INFINITY && best.is_none_or(|(br, bv)| v > bv || (v == bv && r < br)) {
                best = Some((r, v));
            }
        }
        hs.stats.tokens += 1;
        hs.stats.rows += n as u64;
        hs.stats.bytes += bytes as u64;
        best.map_or(0, |(r, _)| r)
    }
}

/// A session's buffers and counters for the sparse head.
#[derive(Default)]
pub struct HeadScratch {
    scores: Vec<f32>,
    /// Per cluster: its rank key, then its stand-in.
    keys: Vec<f32>,
    order: Vec<u32>,
    /// Without the copy, one bit per vocabulary row: computed exactly for
    /// this token.
    bits: Vec<u64>,
    rows: Vec<u32>,
    exact: Vec<f32>,
    pub stats: HeadStats,
}

impl HeadScratch {
    /// Room for the scores of `clusters` cluster means, one token's.
    pub fn scores_mut(&mut self, clusters: usize) -> &mut [f32] {
        self.scores.resize(clusters, 0.0);
        &mut self.scores
    }

    /// The rows [`HeadRule::select`] chose.
    pub fn rows(&self) -> &[u32] {
        &self.rows
    }

    /// Room for the exact logits of [`HeadScratch::rows`].
    pub fn exact_mut(&mut self) -> &mut [f32] {
        self.exact.resize(self.rows.len(), 0.0);
        &mut self.exact
    }

    /// The rows and room for their logits, together.
    pub fn rows_and_exact(&mut self) -> (&[u32], &mut [f32]) {
        self.exact.resize(self.rows.len(), 0.0);
        (&self.rows, &mut self.exact)
    }
}

/// What the sparse head did in a session.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HeadStats {
    /// Tokens whose logits came from the sparse head.
    pub tokens: u64,
    /// Head rows computed exactly, summed over those tokens.
    pub rows: u64,
    /// Head bytes read (rows plus cluster means), summed.
    pub bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::head::HeadModel;
    use crate::sampling::argmax_logits;

    /// An index of `vocab` rows: `hot` hot rows, the rest dealt into
    /// `k` clusters by a shuffle; random means and spreads.
    fn index(vocab: usize, dim: usize, k: usize, hot: usize, seed: u64) -> HeadIndex {
        let mut s = seed;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut perm: Vec<u32> = (0..vocab as u32).collect();
        for i in (1..vocab).rev() {
            perm.swap(i, (next() % (i as u64 + 1)) as usize);
        }
        let mut members: Vec<u32> = perm[..hot].to_vec();
        members.sort_unstable();
        let mut offsets = vec![hot as u32];
        let rest = &perm[hot..];
        for c in 0..k {
            let mut m: Vec<u32> = rest.iter().skip(c).step_by(k).copied().collect();
            m.sort_unstable();
            members.extend(m);
            offsets.push(members.len() as u32);
        }
        let model = HeadModel {
            arch: "llama".into(),
            vocab_size: vocab,
            dim,
            tensor: "output.weight".into(),
            tensor_type: "q8_0".into(),
            sha256: String::new(),
        };
        HeadIndex {
            model,
            offsets,
            members,
            means: (0..k * dim).map(|_| (next() % 1000) as f32 / 500.0 - 1.0).collect(),
            spread: (0..k).map(|_| (next() % 100) as f32 / 50.0).collect(),
            metric_positions: 0,
            default_probes: 1,
            rows: None,
            rows_sha256: None,
            iters: 0,
            seed: 0,
        }
    }

    /// The greedy pick from the exact rows equals the sampler's arg-max of
    /// the filled vector, in both row modes, with ties, -inf and NaN among
    /// the exact logits.
    #[test]
    fn pick_equals_the_argmax_of_the_filled_logits() {
        let (vocab, dim, k) = (300, 32, 10);
        let shape = HeadShape { vocab, dim, tensor: "output.weight", tensor_type: "q8_0" };
        let (rule, q8) = HeadRule::new(shape, index(vocab, dim, k, 20, 7), 3).unwrap();
        assert_eq!(q8.len(), k * dim / 32 * 34);
        let mut hs = HeadScratch::default();
        let mut logits = vec![0f32; vocab];
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for trial in 0..200 {
            for v in hs.scores_mut(k).iter_mut() {
                s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                *v = (s >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0;
            }
            for in_copy in [false, true] {
                rule.select(&mut hs, in_copy);
                let exact = hs.exact_mut();
                for (i, e) in exact.iter_mut().enumerate() {
                    s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    // Few distinct values: ties are common.
                    *e = ((s >> 60) as f32) - 4.0;
                    if trial % 7 == 0 && i % 5 == 0 {
                        *e = f32::NAN;
                    }
                    if trial % 11 == 0 {
                        *e = f32::NEG_INFINITY;
                    }
                }
                let picked = rule.pick(&mut hs, in_copy, 0);
                rule.fill(&mut hs, in_copy, &mut logits, 0);
                assert_eq!(picked, argmax_logits(&logits), "trial {trial}, in_copy {in_copy}");
            }
        }
        assert_eq!(hs.stats.tokens, 800);
    }
}
