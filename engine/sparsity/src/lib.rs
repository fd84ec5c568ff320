//! Activation sparsity in the FFN (CATS / Deja Vu / PowerInfer style): per
//! token, predict which FFN neurons matter and compute only those.
//!
//! * [`sidecar`]: the calibration file `spinfer calibrate` writes beside a
//!   model (thresholds, top-K budgets, neuron frequencies).
//! * Calibration (`spinfer_models::calibrate`, above the model since it
//!   runs it) collects `|silu(gate)|` statistics on real text ([`stats`])
//!   and fits per-layer thresholds to a target sparsity.
//! * [`SparseFfn`]: what a model runs with a sidecar. Per token and layer,
//!   the full gate projection is computed, the predictor keeps a set of
//!   neurons, the up projection runs on those rows only (gathered-row
//!   matvec on the quantised weights) and the down projection accumulates
//!   only those neurons' columns (AXPY over a neuron-major copy of `W_down`
//!   made at load: exact for Q4_0/Q4_1/Q8_0, requantised to Q8_0 for the
//!   other types). A layer whose kept fraction exceeds
//!   `dense_above` runs dense for that token.
//! * Attention output (TEAL on `W_o`): when the sidecar was calibrated
//!   with an attention sparsity, each token's attention output entries
//!   below the layer's threshold are skipped, and the output projection
//!   accumulates only the kept inputs' columns ([`SparseInput`]).
//! * [`bundle`] and [`cache`]: under a memory budget
//!   ([`SparsityOptions::ffn_budget_bytes`]) the FFN weights come from a
//!   neuron-major repack of the model's FFN beside the sidecar: the hottest
//!   neurons in RAM, the others read from the file on demand into a bounded
//!   cache whose policy (LRU, frequency-weighted LRU) decides what stays.
//!   The budget requires the low-rank predictor: every other predictor
//!   reads the full gate matrix (or more) densely for every token, so no
//!   FFN matrix could stay out of memory.

pub mod bundle;
pub mod cache;
mod error;
pub mod experimental;
pub mod lowrank;
mod predictor;
mod shared;
pub mod sidecar;
pub mod stats;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

pub use error::{Error, Result};
pub use predictor::Predictor;
pub use sidecar::{CalibrationInfo, LayerStats, LowRankFactors, LowRankInfo, ModelId, PredictorKind, Sidecar};

use spinfer_kernels::GgmlType;
use spinfer_kernels::kernel::{MatmulCall, MatmulKernel, Select};
use spinfer_kernels::pool::ThreadPool;
use spinfer_sparse_kernels::{NeuronMajorSplit, axpy_rows_q8_0, transpose_to_q8_0};

use self::bundle::{FfnBundle, FfnSource};
use self::cache::CachePolicyKind;
use self::lowrank::LowRank;
pub(crate) use self::shared::sparsity_err;
pub use self::shared::{AxpyMode, CacheCounters};
use spinfer_kernel_select::registry::{Found, KernelRegistry};
use spinfer_plugin_api::PredictorBox;

/// How a model runs sparse (the CLI's `--sparsity`, the config's
/// `[sparsity]`).
#[derive(Clone, Debug, PartialEq)]
pub struct SparsityOptions {
    /// The sidecar written by `spinfer calibrate`.
    pub sidecar: PathBuf,
    /// Use this predictor instead of the sidecar's.
    pub predictor: Option<PredictorKind>,
    /// A layer keeping more than this fraction of its neurons for a token
    /// runs dense for that token (the sparse path's bookkeeping would cost
    /// more than it saves).
    pub dense_above: f32,
    /// Hold at most this many bytes of FFN weights (and predictor) in
    /// memory: hot neurons in RAM, cold ones read from the FFN bundle
    /// beside the sidecar (see [`bundle`]). Needs the low-rank predictor.
    pub ffn_budget_bytes: Option<usize>,
    /// Which cold neurons stay cached under a budget.
    pub cache_policy: CachePolicyKind,
    /// A pack's predictor instead of the sidecar's (`"<pack>/<name>"`, or
    /// the bare name if one pack offers it); the packs are those of the
    /// kernel registry the model is loaded with.
    pub pack_predictor: Option<String>,
    /// A pack's cache policy instead of `cache_policy` (named as
    /// `pack_predictor`).
    pub pack_cache_policy: Option<String>,
    /// Under a budget: read the next layer's predicted cold records ahead
    /// of need ([`bundle::FfnBundle::prefetch`]). Off by default: on
    /// 2-core machines it did not pay (docs/sparsity.md).
    pub lookahead: bool,
}

impl SparsityOptions {
    pub fn new(sidecar: impl Into<PathBuf>) -> Self {
        Self {
            sidecar: sidecar.into(),
            predictor: None,
            dense_above: 0.85,
            ffn_budget_bytes: None,
            cache_policy: CachePolicyKind::default(),
            pack_predictor: None,
            pack_cache_policy: None,
            lookahead: false,
        }
    }
}

/// One layer's sparse FFN data.
pub struct SparseLayer {
    /// Keep neurons with `|silu(gate)|` above this (gate-threshold).
    pub threshold: f32,
    /// Neurons kept per token (top-K).
    pub keep: usize,
    /// Keep neurons with `|silu(gate) · up|` above this (input-magnitude).
    pub input_threshold: f32,
    /// `W_down` neuron-major: one neuron's output column is one
    /// contiguous row.
    pub down: ColumnAxpy,
    /// The attention output projection, input-sparse; `None` when the
    /// sidecar has no attention thresholds (or `W_o`'s type has no exact
    /// neuron-major form).
    pub attn_o: Option<SparseInput>,
}

/// `out = Σ_k coef[k] · nm[:, idx[k]]` in `mode`.
fn nm_axpy(
    nm: &NeuronMajorSplit,
    pool: &ThreadPool,
    idx: &[u32],
    coef: &[f32],
    out: &mut [f32],
    mode: AxpyMode,
) -> Result<()> {
    match mode {
        AxpyMode::Exact => nm.axpy(pool, idx, coef, out)?,
        AxpyMode::Int8 => nm.axpy_fast(pool, idx, coef, out)?,
    }
    Ok(())
}

/// A projection whose inputs below a threshold are skipped per token
/// (TEAL): `out = Σ_{i : |x_i| > threshold} x_i · W[:, i]`.
pub struct SparseInput {
    pub threshold: f32,
    /// `W` input-major: the engine's exact copy or a pack.
    pub w: ColumnAxpy,
}

/// What serves a matrix accumulated over a subset of its columns (inputs)
/// per token, `out = Σ_k coef[k] · W[:, idx[k]]`: the sparse down
/// projection (`W_down`, inputs = FFN neurons) and the attention output
/// (`W_o`): the engine's own input-major copy, or a pack's
/// `GATHERED_COLUMN_AXPY` over the model's matrix.
pub enum ColumnAxpy {
    /// The same weights, transposed exactly (Q4_0, Q4_1, Q8_0), a copy per
    /// thread of the session pools.
    Exact(NeuronMajorSplit),
    /// Other types: requantised to Q8_0 rows (cols, rows); `W_down` only.
    Q8_0(Vec<u8>),
    /// A pack's gathered-column AXPY over the model's own matrix (the
    /// pack keeps whatever copy it made); no copy here.
    Pack(PackColumns),
    /// Under a memory budget: served by [`SparseFfn::bundle`].
    Bundled,
}

impl ColumnAxpy {
    /// The engine's own copy of `W` (`ty`, `dim × ffn_dim` bytes `w`, `dim`
    /// outputs of `ffn_dim` inputs): exact for Q4_0 / Q4_1 / Q8_0 (a copy per
    /// thread of `threads`), requantised to Q8_0 otherwise.
    pub fn repack(ty: GgmlType, w: &[u8], dim: usize, ffn_dim: usize, threads: usize) -> spinfer_kernels::Result<Self> {
        Ok(match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => {
                ColumnAxpy::Exact(NeuronMajorSplit::from_weights(ty, w, dim, ffn_dim, threads)?)
            }
            _ => ColumnAxpy::Q8_0(transpose_to_q8_0(ty, w, dim, ffn_dim)?),
        })
    }

    /// A pack's kernel when the registry found one (`pack`, see
    /// [`PackColumns`]; `what` names the tensor in its log), else the
    /// engine's own copy ([`ColumnAxpy::repack`]).
    pub fn new(
        pack: Option<(String, Arc<dyn MatmulKernel>)>,
        what: &'static str,
        ty: GgmlType,
        w: &[u8],
        dim: usize,
        cols: usize,
        threads: usize,
    ) -> spinfer_kernels::Result<Self> {
        match pack {
            Some((provider, kernel)) => {
                Ok(ColumnAxpy::Pack(PackColumns::new(provider, kernel, what, ty, cols, threads)))
            }
            None => Self::repack(ty, w, dim, cols, threads),
        }
    }

    /// `out = Σ_k coef[k] · W[:, idx[k]]` (`idx` ascending); `w` is the
    /// model's matrix (`dim` rows, as stored), which a pack reads. The
    /// requantised Q8_0 copy always computes in f32.
    #[allow(clippy::too_many_arguments, reason = "the sparse FFN's shapes and weights, each a plain value")]
    pub fn axpy(
        &self,
        pool: &ThreadPool,
        dim: usize,
        w: &[u8],
        idx: &[u32],
        coef: &[f32],
        out: &mut [f32],
        mode: AxpyMode,
    ) -> Result<()> {
        match self {
            ColumnAxpy::Exact(nm) => nm_axpy(nm, pool, idx, coef, out, mode)?,
            ColumnAxpy::Q8_0(t) => axpy_rows_q8_0(pool, t, dim, idx, coef, out)?,
            ColumnAxpy::Pack(p) => p.axpy(pool, dim, w, idx, coef, out, mode)?,
            ColumnAxpy::Bundled => {
                return Err(Error::InvalidArgument("the down projection is served by the FFN bundle".into()));
            }
        }
        Ok(())
    }

    /// Resident bytes held by the engine (a pack's copy is the pack's).
    pub fn bytes(&self) -> usize {
        match self {
            ColumnAxpy::Exact(nm) => nm.bytes(),
            ColumnAxpy::Q8_0(t) => t.len(),
            ColumnAxpy::Pack(p) => p.fallback.get().map_or(0, |f| f.bytes()),
            ColumnAxpy::Bundled => 0,
        }
    }

    /// Who computes it: `"cpu-builtin"`, or the pack's provider name.
    pub fn provider(&self) -> &str {
        match self {
            ColumnAxpy::Pack(p) => &p.provider,
            _ => spinfer_kernel_select::registry::BUILTIN,
        }
    }
}

/// A layer's `W_down` or `W_o` column AXPY from a pack
/// ([`KernelRegistry::resolve_gathered`]): the pack's kernel is called with
/// the model's matrix. If it fails, the engine makes its own copy then and
/// uses it for the rest of the process.
pub struct PackColumns {
    /// The provider (`name@version#hash`).
    pub provider: String,
    kernel: Arc<dyn MatmulKernel>,
    /// The tensor's role (`ffn_down`, `attn_output`), for the log.
    what: &'static str,
    /// The matrix's type and input count and the model's threads, to
    /// build the fallback.
    ty: GgmlType,
    cols: usize,
    threads: usize,
    /// The built-in copy, made at the pack's first failure.
    fallback: OnceLock<Box<ColumnAxpy>>,
}

impl PackColumns {
    pub fn new(
        provider: String,
        kernel: Arc<dyn MatmulKernel>,
        what: &'static str,
        ty: GgmlType,
        cols: usize,
        threads: usize,
    ) -> Self {
        Self { provider, kernel, what, ty, cols, threads, fallback: OnceLock::new() }
    }

    /// The kernel's name.
    pub fn kernel_name(&self) -> &str {
        self.kernel.name()
    }

    #[allow(clippy::too_many_arguments, reason = "the sparse FFN's shapes and weights, each a plain value")]
    fn axpy(
        &self,
        pool: &ThreadPool,
        dim: usize,
        w: &[u8],
        idx: &[u32],
        coef: &[f32],
        out: &mut [f32],
        mode: AxpyMode,
    ) -> Result<()> {
        if let Some(fb) = self.fallback.get() {
            return fb.axpy(pool, dim, w, idx, coef, out, mode);
        }
        // Pack column kernels keep their own buffers: the empty scratch
        // never allocates.
        let call = MatmulCall {
            w,
            select: Select::Columns(idx),
            x: coef,
            n_tokens: 1,
            out,
            scratch: &mut Vec::new(),
            prefill: false,
        };
        match self.kernel.run(pool, call) {
            Ok(()) => Ok(()),
            // The pack kernel logged why; the built-in copy from now on.
            Err(e @ spinfer_kernels::KernelError::Pack { .. }) => {
                tracing::error!(
                    kernel = self.kernel.name(),
                    tensor = self.what,
                    "{e}; the sparse column AXPY falls back to cpu-builtin"
                );
                let fb = ColumnAxpy::repack(self.ty, w, dim, self.cols, self.threads)?;
                let fb = self.fallback.get_or_init(|| Box::new(fb));
                fb.axpy(pool, dim, w, idx, coef, out, mode)
            }
            Err(source) => Err(Error::Kernel { kernel: self.kernel.name().to_string(), source }),
        }
    }
}

/// The sparse FFN of a loaded model.
pub struct SparseFfn {
    pub predictor: Predictor,
    pub dense_above: f32,
    /// The sidecar it was built from.
    pub path: PathBuf,
    pub sidecar: Sidecar,
    pub layers: Vec<SparseLayer>,
    /// Under a memory budget: the repacked FFN the weights come from.
    pub bundle: Option<FfnBundle>,
    /// Arithmetic of the AXPYs (set from the model's precision).
    pub axpy: AxpyMode,
}

impl SparseFfn {
    /// Bytes of the neuron-major down (and attention output) copies held
    /// in memory (under a budget: everything the budget pays for).
    pub fn resident_bytes(&self) -> usize {
        match &self.bundle {
            Some(b) => b.resident_bytes(),
            None => self.layers.iter().map(|l| l.down.bytes() + l.attn_o.as_ref().map_or(0, |a| a.w.bytes())).sum(),
        }
    }
}

/// Selects the neurons to keep for one token of one layer, ascending, into
/// `idx`. `act` is `silu(gate)`, or for [`PredictorKind::InputMagnitude`]
/// the down projection's input `silu(gate) · up`. `mags` is scratch (the
/// experimental top-k's). Pack and sentence-level masks are chosen
/// elsewhere: `idx` is left empty for them.
pub fn select_neurons(
    predictor: PredictorKind,
    layer: &SparseLayer,
    act: &[f32],
    idx: &mut Vec<u32>,
    mags: &mut Vec<f32>,
) {
    match predictor {
        PredictorKind::InputMagnitude => select_above(layer.input_threshold, act, idx),
        // The low-rank prediction is filtered by the gate threshold once
        // the predicted gate rows ran.
        PredictorKind::LowRank => select_above(layer.threshold, act, idx),
        PredictorKind::GateThreshold => experimental::gate_threshold(layer, act, idx),
        PredictorKind::TopK => experimental::top_k(layer, act, idx, mags),
        // Per request, not per token (see the models crate's
        // `model::llama::experimental`); a pack predictor's mask comes
        // from the pack.
        PredictorKind::Sentence | PredictorKind::Pack => idx.clear(),
    }
}

/// The indices `j` with `|act[j]| > threshold`, ascending, into `idx`.
pub fn select_above(threshold: f32, act: &[f32], idx: &mut Vec<u32>) {
    // Branch-free (about a third of the neurons fail the test, at
    // random): every index is written, and the count moves past the kept
    // ones only.
    idx.clear();
    idx.resize(act.len(), 0);
    let mut k = 0;
    for (j, a) in act.iter().enumerate() {
        idx[k] = j as u32;
        k += usize::from(a.abs() > threshold);
    }
    idx.truncate(k);
}

/// Per-layer counters of a session's sparse FFN.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerCounters {
    /// Tokens through this layer.
    pub tokens: u64,
    /// Neurons kept, summed over tokens.
    pub active: u64,
    /// Tokens that ran dense (kept fraction above `dense_above`).
    pub dense: u64,
    /// Neurons the low-rank predictor selected (their gate rows were
    /// computed), summed over tokens.
    pub predicted: u64,
    /// Tokens through this layer's input-sparse attention output.
    pub attn_tokens: u64,
    /// Attention-output inputs kept, summed over those tokens.
    pub attn_active: u64,
    /// Tokens whose full gate was computed to judge the predictor (see
    /// `Session::set_measure_recall`).
    pub truth_tokens: u64,
    /// Truly active neurons (`|silu(gate)|` above the sidecar's gate
    /// threshold) over those tokens.
    pub truly_active: u64,
    /// Neurons the predictor selected over those tokens.
    pub truth_predicted: u64,
    /// Selected neurons that were truly active.
    pub truth_hits: u64,
}

/// What a session's sparse FFN did (a model session reports it).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SparsityStats {
    pub ffn_dim: usize,
    /// Inputs of the attention output projection (`n_heads · head_dim`).
    pub attn_dim: usize,
    pub layers: Vec<LayerCounters>,
    /// Under a memory budget: where the FFN records came from.
    pub cache: CacheCounters,
}

impl SparsityStats {
    /// Mean fraction of FFN neurons kept per token in layer `l`.
    pub fn active_fraction(&self, l: usize) -> f64 {
        let c = &self.layers[l];
        if c.tokens == 0 { 1.0 } else { c.active as f64 / (c.tokens as f64 * self.ffn_dim as f64) }
    }

    /// Mean kept fraction over all layers.
    pub fn mean_active_fraction(&self) -> f64 {
        let (a, t): (u64, u64) = self.layers.iter().fold((0, 0), |(a, t), c| (a + c.active, t + c.tokens));
        if t == 0 { 1.0 } else { a as f64 / (t as f64 * self.ffn_dim as f64) }
    }

    /// The predictor's recall in layer `l`: the fraction of truly active
    /// neurons (`|silu(gate)|` above the sidecar's gate threshold) it
    /// selected, over the tokens where the full gate was computed (`None`
    /// if none was: see `Session::set_measure_recall`).
    pub fn recall(&self, l: usize) -> Option<f64> {
        let c = &self.layers[l];
        (c.truth_tokens > 0)
            .then(|| if c.truly_active == 0 { 1.0 } else { c.truth_hits as f64 / c.truly_active as f64 })
    }

    /// The predictor's precision in layer `l`: the fraction of its
    /// selection that was truly active (as [`SparsityStats::recall`]).
    pub fn precision(&self, l: usize) -> Option<f64> {
        let c = &self.layers[l];
        (c.truth_tokens > 0)
            .then(|| if c.truth_predicted == 0 { 1.0 } else { c.truth_hits as f64 / c.truth_predicted as f64 })
    }

    /// Recall and precision over all layers, `None` unless measured.
    pub fn mean_recall_precision(&self) -> Option<(f64, f64)> {
        let (mut hits, mut truth, mut pred, mut tokens) = (0u64, 0u64, 0u64, 0u64);
        for c in &self.layers {
            (hits, truth, pred, tokens) =
                (hits + c.truth_hits, truth + c.truly_active, pred + c.truth_predicted, tokens + c.truth_tokens);
        }
        let ratio = |a: u64, b: u64| if b == 0 { 1.0 } else { a as f64 / b as f64 };
        (tokens > 0).then(|| (ratio(hits, truth), ratio(hits, pred)))
    }

    /// Mean fraction of attention-output inputs kept over all layers (1
    /// when the attention output runs dense).
    pub fn mean_attn_active_fraction(&self) -> f64 {
        let (a, t) = self.layers.iter().fold((0, 0), |(a, t), c| (a + c.attn_active, t + c.attn_tokens));
        if t == 0 { 1.0 } else { a as f64 / (t as f64 * self.attn_dim as f64) }
    }
}

/// The quantised bytes of one layer's matrices that sparse execution
/// repacks.
pub struct LayerWeights<'a> {
    /// `W_down`, `dim × ffn_dim`.
    pub down: (GgmlType, &'a [u8]),
    /// A pack's gathered-column AXPY for `W_down` (provider, kernel),
    /// from [`KernelRegistry::resolve_gathered`]: no copy is made then.
    pub down_pack: Option<(String, Arc<dyn MatmulKernel>)>,
    /// `W_o`, `dim × q_dim`.
    pub wo: (GgmlType, &'a [u8]),
    /// The same for `W_o`.
    pub wo_pack: Option<(String, Arc<dyn MatmulKernel>)>,
}

/// Reads `opts.sidecar`, checks it belongs to `model` and builds the
/// neuron-major down copies (unless a pack serves the down projection) and
/// input-major `W_o` copies when the sidecar has attention thresholds,
/// each as a copy per thread of `threads`; the AXPYs compute in `axpy`
/// mode, and the low-rank predictor's products run `registry`'s kernels.
#[allow(clippy::too_many_arguments, reason = "the sparse FFN's shapes and weights, each a plain value")]
pub fn build(
    opts: &SparsityOptions,
    pack_predictor: Option<Found<PredictorBox>>,
    registry: &KernelRegistry,
    id: &ModelId,
    weights: Vec<LayerWeights<'_>>,
    dim: usize,
    q_dim: usize,
    ffn_dim: usize,
    axpy: AxpyMode,
    threads: usize,
) -> Result<SparseFfn> {
    let path = &opts.sidecar;
    let sidecar = Sidecar::read(path)?;
    sidecar.check_model(id, path)?;
    if !(0.0..=1.0).contains(&opts.dense_above) {
        return Err(Error::InvalidArgument(format!("dense_above must be in 0..=1, got {}", opts.dense_above)));
    }
    if opts.ffn_budget_bytes.is_some() {
        return Err(Error::InvalidArgument("an FFN memory budget is built by build_budgeted".into()));
    }
    let mut layers = Vec::with_capacity(sidecar.layers.len());
    for (l, (s, lw)) in sidecar.layers.iter().zip(weights).enumerate() {
        let (ty, bytes) = lw.down;
        let down = ColumnAxpy::new(lw.down_pack, "ffn_down", ty, bytes, dim, ffn_dim, threads)
            .map_err(|e| sparsity_err(path, format!("layer {l}: repacking ffn_down: {e}")))?;
        let attn_o = match (s.attn_input_threshold, lw.wo.0) {
            (None, _) => None,
            (Some(threshold), ty @ (GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)) => {
                // (Exact types only: the same copy as `W_down`'s.)
                let w = ColumnAxpy::new(lw.wo_pack, "attn_output", ty, lw.wo.1, dim, q_dim, threads)
                    .map_err(|e| sparsity_err(path, format!("layer {l}: repacking attn_output: {e}")))?;
                Some(SparseInput { threshold, w })
            }
            (Some(_), ty) => {
                tracing::warn!(layer = l, %ty, "attention output sparsity needs Q4_0, Q4_1 or Q8_0 weights; dense");
                None
            }
        };
        layers.push(SparseLayer {
            threshold: s.threshold,
            keep: s.keep,
            input_threshold: s.input_threshold,
            down,
            attn_o,
        });
    }
    if let Some(ColumnAxpy::Pack(p)) = layers.first().map(|l| &l.down) {
        tracing::info!(kernel = p.kernel_name(), provider = %p.provider, "sparse down projection from a pack");
    }
    if let Some(ColumnAxpy::Pack(p)) = layers.first().and_then(|l| Some(&l.attn_o.as_ref()?.w)) {
        tracing::info!(kernel = p.kernel_name(), provider = %p.provider, "sparse attention output from a pack");
    }
    let predictor = match (pack_predictor, opts.predictor.unwrap_or(sidecar.predictor)) {
        (Some(found), _) => {
            tracing::info!(predictor = %found.name, provider = %found.provider, "pack predictor");
            Predictor::Pack(found)
        }
        (None, PredictorKind::Pack) => {
            return Err(Error::InvalidArgument(
                "the pack predictor needs a name: --predictor pack:<pack>/<name>".into(),
            ));
        }
        (None, PredictorKind::LowRank) => Predictor::LowRank(low_rank(&sidecar, path, (dim, ffn_dim), registry)?),
        (None, PredictorKind::GateThreshold) => Predictor::GateThreshold,
        (None, PredictorKind::TopK) => Predictor::TopK,
        (None, PredictorKind::InputMagnitude) => Predictor::InputMagnitude,
        (None, PredictorKind::Sentence) => Predictor::Sentence,
    };
    tracing::info!(path = %path.display(), predictor = predictor.kind().name(), "sparse FFN enabled");
    Ok(SparseFfn { predictor, dense_above: opts.dense_above, path: path.clone(), sidecar, layers, bundle: None, axpy })
}

/// Every layer's low-rank predictor from the sidecar's factors.
fn low_rank(
    sidecar: &Sidecar,
    path: &std::path::Path,
    (dim, ffn_dim): (usize, usize),
    registry: &KernelRegistry,
) -> Result<Vec<LowRank>> {
    sidecar
        .layers
        .iter()
        .enumerate()
        .map(|(l, s)| {
            let f = s
                .lowrank
                .as_ref()
                .ok_or_else(|| sparsity_err(path, "has no low-rank predictor (calibrate with --rank)"))?;
            LowRank::new(&f.p, &f.q, (f.rank, dim, ffn_dim), f.threshold, registry)
                .map_err(|e| sparsity_err(path, format!("layer {l}: {e}")))
        })
        .collect()
}

/// Reads `opts.sidecar`, checks it belongs to `model`, and serves the FFN
/// under `opts.ffn_budget_bytes` from the bundle beside the sidecar
/// (written from `src` when missing or stale). Needs the low-rank
/// predictor; no neuron-major copy of the model's matrices is made, and the
/// pages of the mapped FFN matrices are released.
pub fn build_budgeted(
    opts: &SparsityOptions,
    registry: &KernelRegistry,
    id: &ModelId,
    src: &[FfnSource],
    dim: usize,
    ffn_dim: usize,
) -> Result<SparseFfn> {
    let path = &opts.sidecar;
    let budget = opts.ffn_budget_bytes.ok_or_else(|| Error::InvalidArgument("no FFN budget given".into()))?;
    let mut sidecar = Sidecar::read(path)?;
    sidecar.check_model(id, path)?;
    let kind = opts.predictor.unwrap_or(sidecar.predictor);
    let other = match &opts.pack_predictor {
        Some(name) => Some(format!("the pack predictor '{name}'")),
        None => (kind != PredictorKind::LowRank).then(|| kind.name().to_string()),
    };
    if let Some(other) = other {
        return Err(sparsity_err(
            path,
            format!(
                "an FFN memory budget needs the low-rank predictor (--predictor low-rank, with a sidecar calibrated \
                 with --rank), not {other}: the others read the whole gate matrix (or, from a pack, need the \
                 model's own) every token"
            ),
        ));
    }
    let predictor = Predictor::LowRank(low_rank(&sidecar, path, (dim, ffn_dim), registry)?);
    let mut layers = Vec::with_capacity(sidecar.layers.len());
    for s in &mut sidecar.layers {
        // The f32 factors are not needed any more: keep the memory budget.
        if let Some(f) = s.lowrank.as_mut() {
            f.p = Vec::new();
            f.q = Vec::new();
        }
        layers.push(SparseLayer {
            threshold: s.threshold,
            keep: s.keep,
            input_threshold: s.input_threshold,
            down: ColumnAxpy::Bundled,
            // The budget covers the FFN; the attention output stays dense.
            attn_o: None,
        });
    }
    let predictor_bytes = predictor.bytes();
    let freqs: Vec<Vec<f32>> = sidecar.layers.iter().map(|l| l.active_freq.clone()).collect();
    if freqs.len() != src.len() || freqs.iter().any(|f| f.len() != ffn_dim) {
        return Err(sparsity_err(path, "active_freq does not match the model's layers"));
    }
    let kind = opts.cache_policy;
    let pack_policy = opts.pack_cache_policy.as_deref();
    let priors = freqs.clone();
    let mut bundle = FfnBundle::open_or_build(
        &bundle::path_for(path),
        &id.fingerprint,
        &freqs,
        src,
        dim,
        ffn_dim,
        budget,
        predictor_bytes,
        move |slots| match pack_policy {
            Some(name) => {
                let found = registry.cache_policy(name, slots as u64)?;
                tracing::info!(policy = %found.name, provider = %found.provider, slots, "pack cache policy");
                Ok(Box::new(found.object) as cache::BoxedPolicy)
            }
            None => Ok(cache::policy(kind, slots, priors)),
        },
    )?;
    bundle.lookahead = opts.lookahead;
    tracing::info!(path = %path.display(), budget, "sparse FFN under a memory budget");
    Ok(SparseFfn {
        predictor,
        dense_above: opts.dense_above,
        path: path.clone(),
        sidecar,
        layers,
        bundle: Some(bundle),
        axpy: AxpyMode::Exact,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(threshold: f32, keep: usize) -> SparseLayer {
        SparseLayer { threshold, keep, input_threshold: threshold, down: ColumnAxpy::Q8_0(Vec::new()), attn_o: None }
    }

    /// A pack's column AXPY that always fails.
    struct Failing;
    impl MatmulKernel for Failing {
        fn name(&self) -> &str {
            "failing"
        }
        fn run(&self, _: &ThreadPool, call: MatmulCall<'_>) -> KResult {
            assert!(matches!(call.select, Select::Columns(_)), "only the column form is called");
            Err(KernelError::Pack { pack: "p".into(), kernel: "failing".into(), detail: "run_sparse: boom".into() })
        }
    }
    type KResult = spinfer_kernels::Result<()>;
    use spinfer_kernels::KernelError;

    #[test]
    fn a_failing_pack_down_projection_falls_back_to_the_builtin_copy() {
        let (dim, ffn) = (64, 96);
        // Q8_0 rows: an f16 scale, then 32 codes, per block.
        let w: Vec<u8> = (0..dim * ffn / 32)
            .flat_map(|b| {
                let mut blk = half::f16::from_f32(0.01 + b as f32 * 1e-4).to_le_bytes().to_vec();
                blk.extend((0..32).map(|i| ((b * 7 + i * 13) % 255) as u8));
                blk
            })
            .collect();
        let pool = ThreadPool::new(1);
        let (idx, coef) = ([1u32, 5, 40, 95], [0.5f32, -1.0, 2.0, 0.25]);
        let builtin = ColumnAxpy::repack(GgmlType::Q8_0, &w, dim, ffn, 2).unwrap();
        let mut want = vec![0.0; dim];
        builtin.axpy(&pool, dim, &w, &idx, &coef, &mut want, AxpyMode::Exact).unwrap();
        assert!(want.iter().any(|&v| v != 0.0));

        let down =
            ColumnAxpy::Pack(PackColumns::new("p@1".into(), Arc::new(Failing), "ffn_down", GgmlType::Q8_0, ffn, 2));
        assert_eq!((down.provider(), down.bytes()), ("p@1", 0));
        for _ in 0..2 {
            let mut got = vec![f32::NAN; dim];
            down.axpy(&pool, dim, &w, &idx, &coef, &mut got, AxpyMode::Exact).unwrap();
            assert_eq!(got, want);
        }
        // The copy is made once, at the failure.
        assert_eq!(down.bytes(), builtin.bytes());
    }

    #[test]
    fn threshold_keeps_neurons_above_it_in_order() {
        let act = [0.5, -0.05, -0.7, 0.1, 0.0, 0.2];
        let (mut idx, mut mags) = (Vec::new(), Vec::new());
        select_neurons(PredictorKind::GateThreshold, &layer(0.1, 0), &act, &mut idx, &mut mags);
        assert_eq!(idx, [0, 2, 5]);
        select_neurons(PredictorKind::GateThreshold, &layer(-1.0, 0), &act, &mut idx, &mut mags);
        assert_eq!(idx, [0, 1, 2, 3, 4, 5]);
        select_neurons(PredictorKind::InputMagnitude, &layer(0.3, 0), &act, &mut idx, &mut mags);
        assert_eq!(idx, [0, 2]);
    }

    #[test]
    fn top_k_keeps_the_k_largest_magnitudes_in_order() {
        let act = [0.5, -0.05, -0.7, 0.1, 0.0, 0.2];
        let (mut idx, mut mags) = (Vec::new(), Vec::new());
        let mut top = |k| {
            select_neurons(PredictorKind::TopK, &layer(0.0, k), &act, &mut idx, &mut mags);
            idx.clone()
        };
        assert_eq!(top(3), [0, 2, 5]);
        assert_eq!(top(1), [2]);
        assert_eq!(top(0), Vec::<u32>::new());
        assert_eq!(top(6), [0, 1, 2, 3, 4, 5]);
        assert_eq!(top(60), [0, 1, 2, 3, 4, 5]);
        // Ties never exceed k.
        let tied = [1.0f32; 8];
        select_neurons(PredictorKind::TopK, &layer(0.0, 3), &tied, &mut idx, &mut mags);
        assert_eq!(idx, [0, 1, 2]);
    }

    #[test]
    fn stats_fractions() {
        let st = SparsityStats {
            ffn_dim: 10,
            attn_dim: 4,
            layers: vec![
                LayerCounters { tokens: 2, active: 6, attn_tokens: 2, attn_active: 6, ..Default::default() },
                LayerCounters::default(),
            ],
            cache: CacheCounters::default(),
        };
        assert!((st.mean_attn_active_fraction() - 0.75).abs() < 1e-12);
        assert!((st.active_fraction(0) - 0.3).abs() < 1e-12);
        assert_eq!(st.active_fraction(1), 1.0);
        assert!((st.mean_active_fraction() - 0.3).abs() < 1e-12);
    }
}
