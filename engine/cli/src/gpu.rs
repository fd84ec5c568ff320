//! `generate --device cuda`: the whole model on GPU 0 (`spinfer-gpu`), or
//! with `--gpu-budget-mb` the FFN split between GPU and CPU by calibrated
//! activation frequency, driven by the engine's generation loop.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use spinfer_engine::generate::{GenerateParams, Generation, generate_with};
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::grammar::{Grammars, Spec};
use spinfer_engine::head::HeadIndex;
use spinfer_engine::loader::Loader;
use spinfer_engine::sparse::{ModelId, Sidecar};
use spinfer_engine::tokenizer::Tokenizer;
use spinfer_gpu::placement::{plan, total_bytes};
use spinfer_gpu::{GpuDecode, GpuModel, ffn_costs};

/// The GPU's weight budget (`--gpu-budget-mb` or `[cuda] budget_mb`, named
/// by `setting` in errors), the sidecar whose frequencies split the FFN
/// when the model does not fit, and the CPU side's threads.
pub struct Split {
    pub budget_mb: f64,
    pub setting: &'static str,
    pub sidecar: Option<PathBuf>,
    pub threads: usize,
}

/// The model on the GPU: whole, or split under `split`'s budget (whole
/// when the budget holds every weight).
fn load(file: &GgufFile, ctx: usize, split: Option<Split>) -> Result<GpuModel> {
    let Some(split) = split else { return Ok(GpuModel::load(file, ctx)?) };
    let setting = split.setting;
    if !(split.budget_mb.is_finite() && split.budget_mb > 0.0) {
        bail!("{setting} must be a positive number of MB, got {}", split.budget_mb);
    }
    let c = file.config()?;
    let total: usize = file.tensors.iter().map(|t| t.size).sum();
    let budget = (split.budget_mb * 1e6) as usize;
    if budget >= total {
        return Ok(GpuModel::load(file, ctx)?);
    }
    let Some(sidecar) = &split.sidecar else {
        bail!(
            "{setting} {}: the model's {:.1} MB of weights do not fit, and splitting its FFN needs a sidecar's \
             activation frequencies (--sparsity SIDECAR or [sparsity] file)",
            split.budget_mb,
            total as f64 / 1e6
        );
    };
    let side = Sidecar::read(sidecar)?;
    side.check_model(&ModelId::of(&c, file)?, sidecar)?;
    let costs = ffn_costs(file, &c)?;
    let ffn = total_bytes(&costs, c.ffn_dim);
    let rest = total - ffn;
    if budget < rest {
        bail!(
            "{setting} {}: the weights besides the FFN (attention, embeddings, head) need {:.1} MB on the GPU",
            split.budget_mb,
            rest as f64 / 1e6
        );
    }
    let freq: Vec<Vec<f32>> = side.layers.iter().map(|l| l.active_freq.clone()).collect();
    let placement = plan(&freq, &costs, c.ffn_dim, budget - rest)?;
    tracing::info!(
        hot_neurons = placement.hot_fraction(&costs, c.ffn_dim),
        gpu_ffn_mb = placement.bytes as f64 / 1e6,
        "ffn split between gpu and cpu"
    );
    Ok(GpuModel::load_hybrid(file, ctx, &placement, split.threads)?)
}

/// Generates with the GGUF model at `path` on GPU 0 in a session of `ctx`
/// positions, streaming text to stdout when `stream`; with `head` = (index
/// file, probes) through the sparse output head.
#[allow(clippy::too_many_arguments, reason = "the flags of `generate --device cuda`, each used once")]
pub fn generate(
    path: &Path,
    ctx: usize,
    prompt: &str,
    params: &GenerateParams,
    spec: Option<&Spec>,
    stream: bool,
    split: Option<Split>,
    head: Option<(PathBuf, Option<usize>)>,
) -> Result<Generation> {
    // No device, no point reading the model.
    spinfer_kernels_cuda::probe()?;
    let file = GgufFile::open(path).with_context(|| format!("--device cuda reads GGUF models: {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let mut model = load(&file, ctx, split)?;
    if let Some((index, probes)) = head {
        let index = HeadIndex::load(&index, &GpuModel::head_model(&file)?)?;
        let probes = probes.unwrap_or(index.default_probes());
        model.set_sparse_head(Some(index), probes)?;
    }
    tracing::info!(device = %model.backend().device(), "model on the gpu");
    let mut params = params.clone();
    if let Some(spec) = spec {
        let grammars = Grammars::new(&tokenizer, file.config()?.vocab_size)?;
        params.constraint = Some(grammars.compile(spec)?.source());
    }
    let mut session = model.new_session()?;
    let mut stdout = std::io::stdout().lock();
    let g = generate_with(&mut GpuDecode::new(&model, &mut session), &tokenizer, prompt, &params, &mut |piece| {
        if stream {
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
        ControlFlow::Continue(())
    })?;
    Ok(g)
}
