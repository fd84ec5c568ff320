//! The sparse head at decode on the CPU: the [`HeadRule`] with the cluster
//! means and the exact rows computed by the kernel registry's kernels (the
//! rule is in the module docs of [`super`]).

use spinfer_kernels::GgmlType;
use spinfer_kernels::pool::ThreadPool;

use super::HeadIndex;
use super::rule::{HeadRule, HeadScratch, HeadShape};
use crate::Result;
use crate::model::llama::{Linear, Scratch};
use crate::model::{ModelConfig, Precision};
use spinfer_formats::tensor::TensorData;
use spinfer_kernel_select::registry::KernelRegistry;

/// A [`HeadIndex`] bound to kernels for one model: what
/// `Model::next_token_logits` runs.
pub struct SparseHead {
    pub rule: HeadRule,
    /// The cluster-ordered copy of the head, when the index has one.
    pub rows: Option<Linear>,
    /// The cluster means as a Q8_0 matrix (clusters × dim).
    pub centroids: Linear,
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
        let shape = HeadShape { vocab: config.vocab_size, dim, tensor: &out.name, tensor_type: out.desc.wtype.name() };
        let (mut rule, q8) = HeadRule::new(shape, index, probes)?;
        let centroids =
            Linear::from_tensor(registry, precision, "head.centroids", GgmlType::Q8_0, TensorData::owned(q8), k, dim)?;
        let rows = rule
            .take_rows()
            .map(|data| {
                Linear::from_tensor(registry, precision, "head.rows", out.desc.wtype, data, config.vocab_size, dim)
            })
            .transpose()?;
        Ok(Self { rule, rows, centroids })
    }

    /// Row `token` of the head in the cluster-ordered copy (`None` without
    /// one): the same bytes as the model's row.
    pub(crate) fn row_bytes(&self, token: u32) -> Option<&[u8]> {
        let copy = self.rows.as_ref()?;
        let p = self.rule.position_of(token)?;
        let n = copy.weight_bytes() / self.rule.index.model.vocab_size;
        Some(&copy.raw_weights()[p * n..(p + 1) * n])
    }

    /// Bytes this head holds in memory besides the rows it reads per token:
    /// the cluster means, the index's tables and the row maps.
    pub fn resident_bytes(&self) -> usize {
        self.centroids.weight_bytes() + self.rule.table_bytes()
    }

    /// Scores of every cluster mean for `n` hidden states `h` (`n × dim`)
    /// into `out` (`n × clusters`): what decode ranks the clusters by.
    pub fn cluster_scores(&self, pool: &ThreadPool, h: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        self.centroids.forward(pool, h, n, out, &mut Scratch::default())
    }

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
        let k = self.rule.index.clusters();
        self.centroids.forward(pool, x, 1, hs.scores_mut(k), scratch)?;
        // The rows to compute: positions in the copy, or vocabulary rows
        // of the head read in place.
        let in_copy = self.rows.is_some();
        self.rule.select(hs, in_copy);
        let source = self.rows.as_ref().unwrap_or(output);
        let (rows, exact) = hs.rows_and_exact();
        let n = rows.len();
        source.forward_rows(pool, x, 1, rows, exact, scratch)?;
        let row_bytes = output.weight_bytes() / self.rule.index.model.vocab_size;
        self.rule.fill(hs, in_copy, logits, n * row_bytes + self.centroids.weight_bytes());
        Ok(())
    }
}
