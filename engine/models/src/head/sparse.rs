//! The sparse head at decode: rank the clusters, compute the hot rows and
//! the best clusters' rows exactly, stand-ins for the rest (the rule is in
//! the module docs of [`super`]).

use bytemuck::Zeroable;
use spinfer_kernels::GgmlType;
use spinfer_kernels::blocks::BlockQ8_0;
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels::quantize::quantize_row_q8_0_ref;

use super::HeadIndex;
use crate::model::llama::{Linear, Scratch, grow};
use crate::model::{ModelConfig, Precision};
use crate::{Error, Result};
use spinfer_formats::tensor::TensorData;
use spinfer_kernel_select::registry::KernelRegistry;

/// Standard deviations of its spread added to a cluster's score to rank
/// it: the likely best row of the cluster rather than its mean. Chosen by
/// measurement (docs/sparsity.md: 0.5 … 4 tried, 3 and 4 equal).
const RANK_SIGMAS: f32 = 3.0;

/// A [`HeadIndex`] bound to kernels for one model: what
/// `Model::next_token_logits` runs.
pub struct SparseHead {
    pub index: HeadIndex,
    /// The cluster-ordered copy of the head, when the index has one.
    pub rows: Option<Linear>,
    /// The cluster of each row, `clusters` for the hot rows (vocab).
    cluster_of: Vec<u32>,
    /// With the copy: each row's position in it (vocab).
    position_of: Vec<u32>,
    /// Per cluster: added to its score to rank it, and to stand in for
    /// its rows (`RANK_SIGMAS · σ` and `σ² / 2`).
    rank_bonus: Vec<f32>,
    mass_bonus: Vec<f32>,
    /// The cluster means as a Q8_0 matrix (clusters × dim).
    pub centroids: Linear,
    /// Clusters whose rows get exact logits, per token.
    pub probes: usize,
}

impl SparseHead {
    /// Binds `index` (checked against the model's head `out`, of a model
    /// with hyper-parameters `config`) with `probes` clusters per token.
    pub fn new(
        config: &ModelConfig,
        out: &Linear,
        index: HeadIndex,
        probes: usize,
        registry: &KernelRegistry,
        precision: Precision,
    ) -> Result<Self> {
        let (k, dim) = (index.clusters(), config.dim);
        if probes == 0 || probes > k {
            return Err(Error::InvalidArgument(format!("head probes must be in 1..={k} (its clusters), got {probes}")));
        }
        // The sha256 was checked when the index was read (HeadIndex::load)
        // or built from this model; the shape is checked again here.
        let m = &index.model;
        if (m.vocab_size, m.dim, m.tensor.as_str(), m.tensor_type.as_str())
            != (config.vocab_size, dim, out.name.as_str(), out.desc.wtype.name())
        {
            return Err(Error::InvalidArgument(format!(
                "the head index was built for a {} x {} {} head ({}), not this model's {} x {} {} ({})",
                m.vocab_size,
                m.dim,
                m.tensor_type,
                m.tensor,
                config.vocab_size,
                dim,
                out.desc.wtype.name(),
                out.name
            )));
        }
        if !dim.is_multiple_of(32) {
            return Err(Error::InvalidArgument(format!(
                "the sparse head needs a hidden size divisible by 32, not {dim}"
            )));
        }
        let mut blocks = vec![BlockQ8_0::zeroed(); k * dim / 32];
        quantize_row_q8_0_ref(&index.means, &mut blocks)?;
        let q = bytemuck::cast_slice::<BlockQ8_0, u8>(&blocks).to_vec();
        let centroids =
            Linear::from_tensor(registry, precision, "head.centroids", GgmlType::Q8_0, TensorData::owned(q), k, dim)?;
        // The f32 means are not needed once quantised (10 MB for Gemma 3).
        let mut index = index;
        index.means = Vec::new();
        let mut cluster_of = vec![k as u32; index.model.vocab_size];
        for c in 0..k {
            index.members(c).iter().for_each(|&r| cluster_of[r as usize] = c as u32);
        }
        let rank_bonus = index.spread.iter().map(|s| RANK_SIGMAS * s.sqrt()).collect();
        let mass_bonus = index.spread.iter().map(|s| s / 2.0).collect();
        let rows = match index.rows.take() {
            Some(data) => Some(Linear::from_tensor(
                registry,
                precision,
                "head.rows",
                out.desc.wtype,
                data,
                config.vocab_size,
                dim,
            )?),
            None => None,
        };
        let mut position_of = Vec::new();
        if rows.is_some() {
            position_of = vec![0u32; index.model.vocab_size];
            index.members.iter().enumerate().for_each(|(p, &r)| position_of[r as usize] = p as u32);
        }
        Ok(Self { index, rows, cluster_of, position_of, rank_bonus, mass_bonus, centroids, probes })
    }

    /// Row `token` of the head in the cluster-ordered copy (`None` without
    /// one): the same bytes as the model's row.
    pub(crate) fn row_bytes(&self, token: u32) -> Option<&[u8]> {
        let copy = self.rows.as_ref()?;
        let p = *self.position_of.get(token as usize)? as usize;
        let n = copy.weight_bytes() / self.position_of.len();
        Some(&copy.raw_weights()[p * n..(p + 1) * n])
    }

    /// Bytes this head holds in memory besides the rows it reads per token:
    /// the cluster means, the index's tables and the row maps.
    pub fn resident_bytes(&self) -> usize {
        let i = &self.index;
        self.centroids.weight_bytes()
            + 4 * (i.members.len() + i.offsets.len() + i.spread.len())
            + 4 * (self.cluster_of.len() + self.position_of.len() + self.rank_bonus.len() + self.mass_bonus.len())
    }

    /// Scores of every cluster mean for `n` hidden states `h` (`n × dim`)
    /// into `out` (`n × clusters`): what decode ranks the clusters by.
    pub fn cluster_scores(&self, pool: &ThreadPool, h: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        self.centroids.forward(pool, h, n, out, &mut Scratch::default())
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

impl SparseHead {
    /// The next-token logits of hidden state `x` (`dim`) into `logits`
    /// (`vocab`): exact for the hot rows and the rows of the best `probes`
    /// clusters, a stand-in for every other row (see the module docs).
    pub(crate) fn logits(
        &self,
        output: &Linear,
        pool: &ThreadPool,
        x: &[f32],
        logits: &mut [f32],
        hs: &mut HeadScratch,
        scratch: &mut Scratch,
    ) -> Result<()> {
        let k = self.index.clusters();
        grow(&mut hs.scores, k);
        self.centroids.forward(pool, x, 1, &mut hs.scores, scratch)?;
        // The best `probes` clusters by rank key, ascending.
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
        // The rows to compute, ascending: with the copy, its positions
        // (the hot rows first, then one range per probed cluster); without
        // it, vocabulary rows read in place.
        hs.rows.clear();
        let source = match &self.rows {
            Some(copy) => {
                hs.rows.extend(0..self.index.offsets[0]);
                for &c in probed.iter() {
                    hs.rows.extend(self.index.offsets[c as usize]..self.index.offsets[c as usize + 1]);
                }
                copy
            }
            None => {
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
                output
            }
        };
        let n = hs.rows.len();
        grow(&mut hs.exact, n);
        source.forward_rows(pool, x, 1, &hs.rows, &mut hs.exact[..n], scratch)?;
        // Stand-ins for every row, held below the best exact logit (one
        // per cluster, plus one slot the hot rows point at, since they are
        // all written exactly below), then the exact logits over them.
        let best = hs.exact[..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let ceiling = best.next_down();
        let stand = &mut hs.keys;
        stand.clear();
        stand.extend(hs.scores[..k].iter().enumerate().map(|(c, &s)| self.stand_in(c, s).min(ceiling)));
        stand.push(ceiling);
        for (l, &c) in logits.iter_mut().zip(&self.cluster_of) {
            *l = stand[c as usize];
        }
        let vocab_row = |p: u32| if self.rows.is_some() { self.index.members[p as usize] } else { p };
        for (&p, &v) in hs.rows.iter().zip(&hs.exact[..n]) {
            logits[vocab_row(p) as usize] = v;
        }
        let row_bytes = output.weight_bytes() / self.index.model.vocab_size;
        hs.stats.tokens += 1;
        hs.stats.rows += n as u64;
        hs.stats.bytes += (n * row_bytes + self.centroids.weight_bytes()) as u64;
        Ok(())
    }
}
