//! `generate`, `perplexity`, `inspect` and `convert`.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use spinfer_engine::config::{
    Config, HeadMode, HeadSection, KvCacheSetting, PrecisionSetting, QuantizeSetting, SparsitySection,
    check_cache_policy, check_predictor,
};
use spinfer_engine::generate::{DraftParams, GenerateParams};
use spinfer_engine::model::llama::MAX_THREADS;
use spinfer_engine::model::{ModelOptions, Precision};

use spinfer_engine::{Engine, perplexity};

use crate::report::{Output, print_generation, print_sparsity_stats, print_storage_stats, sparsity_json, storage_json};

/// Options every model-running command shares.
#[derive(Args, Clone)]
pub struct CommonArgs {
    /// Model: a GGUF file, a safetensors file, or a directory with config.json.
    #[arg(short, long, required_unless_present = "config")]
    pub model: Option<PathBuf>,
    /// Operator config (spinfer.toml): model, packs, trust, pins, history.
    /// Flags given on the command line override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Worker threads (default: all cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
    /// f32 activations: PyTorch's function on the dequantised weights
    /// (slowest). The default runs integer kernels on 16-bit activations
    /// (two 8-bit planes, or one 16-bit plane on CPUs without AVX-512
    /// VNNI), which is nearly as accurate.
    #[arg(long, conflicts_with = "int8")]
    pub precise: bool,
    /// One 8-bit activation plane, as llama.cpp: its numerics, max logit
    /// error ~1; the fastest decode.
    #[arg(long)]
    pub int8: bool,
    /// Run the FFN sparse with this calibration sidecar (written by
    /// `spinfer calibrate`); without it the model runs dense.
    #[arg(long)]
    pub sparsity: Option<PathBuf>,
    /// Use this predictor instead of the sidecar's: gate-threshold | top-k | input-magnitude | low-rank |
    /// sentence | `pack:<pack>/<name>` (a loaded pack's predictor).
    #[arg(long, requires = "sparsity")]
    pub predictor: Option<String>,
    /// Hold at most this many MB (10^6 bytes) of FFN weights and predictor
    /// in memory: the most active neurons in RAM, the others read on demand
    /// from a repack written beside the sidecar (`<sidecar>.ffn`). Needs
    /// `--predictor low-rank`.
    #[arg(long, requires = "sparsity")]
    pub ffn_budget_mb: Option<f64>,
    /// Which cold neurons stay cached under --ffn-budget-mb (or the FFN's share of --mem-budget-mb): sweep
    /// (default: by layer, then recency) | lru | freq-lru | window (the neurons of the last 5 tokens; `window:K` for K) | `pack:<pack>/<name>` (a loaded pack's policy).
    #[arg(long, requires = "sparsity")]
    pub cache_policy: Option<String>,
    /// Under an FFN budget, read the next layer's predicted cold neurons ahead of need on a
    /// dedicated thread (`[sparsity] lookahead = true`).
    #[arg(long, requires = "sparsity")]
    pub lookahead: bool,
    /// Output head for next-token logits: dense (every vocabulary row) or
    /// sparse (only the rows of the best clusters of --head-index; default
    /// when --head-index is given). Perplexity and logits stay dense.
    #[arg(long, value_enum)]
    pub head: Option<HeadArg>,
    /// Head index written by `spinfer calibrate-head` (for --head sparse).
    #[arg(long)]
    pub head_index: Option<PathBuf>,
    /// Clusters whose rows get exact logits per token with the sparse head
    /// (default: an eighth of the index's clusters).
    #[arg(long)]
    pub head_probes: Option<usize>,
    /// Hold weights, KV cache and work buffers within this many MB (10^6
    /// bytes): what does not fit is read from storage per step, ahead of
    /// need, and kept out of the page cache (`[memory] budget_mb`).
    #[arg(long)]
    pub mem_budget_mb: Option<f64>,
    /// KV cache element type: f16 (half the memory and half the bytes
    /// attention reads per token; the default, except with --precise) or
    /// f32 (`[model] kv_cache`).
    #[arg(long, value_enum)]
    pub kv_cache: Option<KvCacheArg>,
    /// Quantise float weight matrices (an f32, f16 or bf16 checkpoint) to
    /// this type as they load, on the GGUF kernels (`[model] quantize`):
    /// q8_0 (8.5 bits per weight), q4_1 (5) or q4_0 (4.5; with either
    /// 4-bit type the embedding and the head stay q8_0).
    #[arg(long, value_enum)]
    pub quantize: Option<QuantizeArg>,
    /// Print only the result on stdout.
    #[arg(short, long)]
    pub quiet: bool,
    /// Print one JSON object with the result and statistics.
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HeadArg {
    Dense,
    Sparse,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KvCacheArg {
    F32,
    F16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum QuantizeArg {
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_1")]
    Q4_1,
    #[value(name = "q4_0")]
    Q4_0,
}

impl From<QuantizeArg> for QuantizeSetting {
    fn from(q: QuantizeArg) -> Self {
        match q {
            QuantizeArg::Q8_0 => Self::Q8_0,
            QuantizeArg::Q4_1 => Self::Q4_1,
            QuantizeArg::Q4_0 => Self::Q4_0,
        }
    }
}

impl From<KvCacheArg> for KvCacheSetting {
    fn from(k: KvCacheArg) -> Self {
        match k {
            KvCacheArg::F32 => Self::F32,
            KvCacheArg::F16 => Self::F16,
        }
    }
}

impl CommonArgs {
    /// Model options from the config (if any) overridden by flags.
    pub fn options(&self, base: ModelOptions, ctx: Option<usize>) -> ModelOptions {
        let mut o = base;
        if let Some(c) = ctx {
            o.ctx = c;
        }
        if let Some(t) = self.threads {
            o.threads = t.max(1);
        }
        if self.precise {
            o.precision = Precision::Precise;
        } else if self.int8 {
            o.precision = Precision::Int8;
        }
        if let Some(k) = self.kv_cache {
            o.kv_type = Some(KvCacheSetting::from(k).into());
        }
        if let Some(q) = self.quantize {
            o.quantize = Some(QuantizeSetting::from(q).into());
        }
        o
    }

    /// The operator config (from `--config`, or a default one around
    /// `--model`) with `--model` and flags applied.
    pub fn config(&self, ctx: Option<usize>) -> Result<Config> {
        let mut c = match &self.config {
            Some(path) => Config::load(path)?,
            None => Config::default(),
        };
        match (&self.model, c.model.path.as_os_str().is_empty()) {
            (Some(m), _) => c.model.path = m.clone(),
            (None, true) => bail!("give --model or --config"),
            (None, false) => {}
        }
        if ctx == Some(0) {
            bail!("--ctx must be at least 1 (tokens the KV cache holds)");
        }
        match self.threads {
            Some(0) => bail!("--threads must be at least 1"),
            Some(t) if t > MAX_THREADS => bail!("--threads {t} is more than the {MAX_THREADS} allowed"),
            _ => {}
        }
        let o = self.options(c.model_options(), ctx);
        c.model.ctx = Some(o.ctx);
        c.model.threads = Some(o.threads);
        c.model.precision = match o.precision {
            Precision::Fast => PrecisionSetting::Fast,
            Precision::Int8 => PrecisionSetting::Int8,
            Precision::Precise => PrecisionSetting::Precise,
        };
        c.model.kv_cache = self.kv_cache.map(KvCacheSetting::from).or(c.model.kv_cache);
        c.model.quantize = self.quantize.map(QuantizeSetting::from).or(c.model.quantize);
        if let Some(p) = &self.predictor {
            check_predictor(p).map_err(|e| anyhow::anyhow!("--{e}"))?;
        }
        if let Some(b) = self.ffn_budget_mb
            && !(b.is_finite() && b > 0.0)
        {
            bail!("--ffn-budget-mb must be a positive number, got {b}");
        }
        if let Some(b) = self.mem_budget_mb {
            if !(b.is_finite() && b > 0.0 && b <= spinfer_engine::config::MAX_BUDGET_MB) {
                bail!(
                    "--mem-budget-mb must be a positive number of MB up to {}, got {b}",
                    spinfer_engine::config::MAX_BUDGET_MB
                );
            }
            c.memory = Some(spinfer_engine::config::MemorySection { budget_mb: b });
        }
        if let Some(p) = &self.cache_policy {
            if self.ffn_budget_mb.is_none() && self.mem_budget_mb.is_none() {
                anyhow::bail!(
                    "--cache-policy needs --ffn-budget-mb or --mem-budget-mb: without a budget no cache is kept"
                );
            }
            check_cache_policy(p)
                .map_err(|e| anyhow::anyhow!("--{}", e.replacen("cache policy", "cache-policy", 1)))?;
        }
        if self.head.is_some() || self.head_index.is_some() || self.head_probes.is_some() {
            let old = c.head.take().unwrap_or_default();
            let mode = match self.head {
                Some(HeadArg::Dense) => HeadMode::Dense,
                Some(HeadArg::Sparse) => HeadMode::Sparse,
                None => old.mode,
            };
            let index = self.head_index.clone().or(old.index);
            if mode == HeadMode::Sparse && index.is_none() {
                bail!("--head sparse needs --head-index FILE (written by `spinfer calibrate-head`)");
            }
            if self.head_probes == Some(0) {
                bail!("--head-probes must be at least 1");
            }
            c.head = Some(HeadSection { mode, index, probes: self.head_probes.or(old.probes) });
        }
        if let Some(file) = &self.sparsity {
            let old = c.sparsity.take().unwrap_or_default();
            c.sparsity = Some(SparsitySection {
                file: file.clone(),
                predictor: self.predictor.clone(),
                dense_above: old.dense_above,
                ffn_budget_mb: self.ffn_budget_mb,
                cache_policy: self.cache_policy.clone(),
                lookahead: if self.lookahead { Some(true) } else { old.lookahead },
            });
        }
        Ok(c)
    }
}

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// The prompt text.
    #[arg(short, long, conflicts_with = "prompt_file", required_unless_present = "prompt_file")]
    pub prompt: Option<String>,
    /// Read the prompt from a UTF-8 file.
    #[arg(short = 'f', long)]
    pub prompt_file: Option<PathBuf>,
    /// Tokens to generate.
    #[arg(short = 'n', long, default_value_t = 128)]
    pub n_predict: usize,
    #[command(flatten)]
    pub sampling: crate::sampling::SamplingArgs,
    #[command(flatten)]
    pub draft: crate::sampling::DraftArgs,
    /// Never end at an end-of-generation token: generate -n tokens (or
    /// until a stop string or the context ends it).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Stop when this string appears (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Context size (default: the config's, else 2048).
    #[arg(short = 'c', long)]
    pub ctx: Option<usize>,
    /// Print the sparse FFN's per-layer statistics (kept fraction, dense
    /// fallbacks; for the low-rank, pack and sentence predictors also their
    /// recall and precision against the full gate, which is then computed
    /// too and slows decoding) to stderr, or under "sparsity" with --json.
    #[arg(long)]
    pub stats: bool,
    /// Where the model runs: cpu, or cuda (the whole model on GPU 0, f32
    /// activations; a GGUF model, dense; needs a build with feature
    /// `cuda`).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// With --device cuda: hold at most this many MB (10^6 bytes) of
    /// weights on the GPU. Everything but the FFN goes there; the FFN
    /// neuron groups with the highest calibrated activation frequency
    /// (from --sparsity SIDECAR) fill the rest, and the others run on the
    /// CPU (--threads), PowerInfer's hybrid split. A budget that holds the
    /// whole model is a full offload.
    #[arg(long)]
    pub gpu_budget_mb: Option<f64>,
    #[command(flatten)]
    pub constraint: crate::constrain::ConstraintArgs,
}

/// Where `generate` runs the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    Cpu,
    Cuda,
}

pub fn generate(a: GenerateArgs) -> Result<()> {
    let prompt = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => {
            let bytes = std::fs::read(f).with_context(|| format!("cannot read prompt file {}", f.display()))?;
            String::from_utf8(bytes).map_err(|e| {
                anyhow::anyhow!(
                    "prompt file {} is not valid UTF-8 (byte {})",
                    f.display(),
                    e.utf8_error().valid_up_to()
                )
            })?
        }
        (None, None) => bail!("give a prompt with --prompt or --prompt-file"),
    };
    // Argument errors before the (slower) model load.
    let spec = a.constraint.spec()?;
    let mut params = GenerateParams {
        max_tokens: a.n_predict,
        sampler: a.sampling.params()?,
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
        draft: a.draft.params(configured_drafts(&a.common, a.ctx)?)?,
        ..GenerateParams::default()
    };
    let output = Output { json: a.common.json, quiet: a.common.quiet };
    if a.gpu_budget_mb.is_some() && a.device != Device::Cuda {
        bail!("--gpu-budget-mb needs --device cuda");
    }
    if a.device == Device::Cuda {
        refuse_cpu_only_flags(&a)?;
        // An operator config gives the model, context, `[cuda] budget_mb`
        // and the `[sparsity] file` whose frequencies split the FFN.
        let config = a.common.config.is_some().then(|| a.common.config(a.ctx)).transpose()?;
        if let Some(c) = &config {
            refuse_cpu_only_settings(c)?;
        }
        let path = match (&a.common.model, &config) {
            (Some(m), _) => m.clone(),
            (None, Some(c)) => c.model.path.clone(),
            (None, None) => bail!("--device cuda needs --model FILE.gguf or --config"),
        };
        let sidecar = a.common.sparsity.clone().or_else(|| config.as_ref()?.sparsity.as_ref().map(|s| s.file.clone()));
        let threads = a.common.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(4, |n| n.get()));
        let split = match (a.gpu_budget_mb, &config) {
            (Some(mb), _) => {
                if sidecar.is_none() {
                    bail!(
                        "--gpu-budget-mb needs --sparsity SIDECAR (its calibrated activation frequencies choose the hot neurons)"
                    );
                }
                Some(crate::gpu::Split { budget_mb: mb, setting: "--gpu-budget-mb", sidecar, threads })
            }
            (None, Some(c)) => {
                Some(crate::gpu::Split { budget_mb: c.cuda.budget_mb, setting: "[cuda] budget_mb", sidecar, threads })
            }
            (None, None) => None,
        };
        let ctx = a.ctx.or(config.as_ref().and_then(|c| c.model.ctx)).unwrap_or(2048);
        let head = gpu_head(&a.common, config.as_ref())?;
        let g = crate::gpu::generate(&path, ctx, &prompt, &params, spec.as_ref(), !a.common.json, split, head)?;
        return print_generation(output, &g, serde_json::Value::Null, serde_json::Value::Null);
    }
    let engine = load(&a.common, a.ctx)?;
    if let Some(spec) = &spec {
        params.constraint = Some(engine.constraint(spec)?);
    }
    let mut session = engine.model.new_session();
    // Judge predictors that choose before the gate against the full gate
    // (a dense gate projection more per token and layer).
    session.set_measure_recall(a.stats);
    let stream = !a.common.json;
    let mut stdout = std::io::stdout().lock();
    let g = spinfer_engine::generate::generate(
        &engine.model,
        &engine.tokenizer,
        &mut session,
        &prompt,
        &params,
        &mut |piece| {
            if stream {
                let _ = stdout.write_all(piece.as_bytes());
                let _ = stdout.flush();
            }
            ControlFlow::Continue(())
        },
    )?;
    print_generation(output, &g, sparsity_json(&engine, &session), storage_json(&session, g.tokens.len()))?;
    if a.stats && !a.common.json {
        print_sparsity_stats(&engine, &session);
        print_storage_stats(&session, g.tokens.len());
    }
    Ok(())
}

/// The drafts of `--config`'s `[speculative]` (none without).
fn configured_drafts(c: &CommonArgs, ctx: Option<usize>) -> Result<DraftParams> {
    let speculative = if c.config.is_some() { c.config(ctx)?.speculative } else { None };
    Ok(speculative.map(|s| s.draft_params()).unwrap_or_default())
}

/// The sparse head `--device cuda` runs, as (index, probes): from the
/// config's `[head]` (merged with the flags) or, without one, from
/// `--head`, `--head-index` and `--head-probes`.
fn gpu_head(c: &CommonArgs, config: Option<&Config>) -> Result<Option<(PathBuf, Option<usize>)>> {
    let section = match config {
        Some(config) => config.head.clone(),
        None if c.head.is_none() && c.head_index.is_none() && c.head_probes.is_none() => None,
        None => Some(HeadSection {
            mode: if c.head == Some(HeadArg::Dense) { HeadMode::Dense } else { HeadMode::Sparse },
            index: c.head_index.clone(),
            probes: c.head_probes,
        }),
    };
    match section.filter(|h| h.mode == HeadMode::Sparse) {
        None => Ok(None),
        Some(HeadSection { index: Some(index), probes, .. }) => Ok(Some((index, probes))),
        Some(_) => bail!("--head sparse needs --head-index FILE (written by `spinfer calibrate-head`)"),
    }
}

/// Operator-config settings that `--device cuda` does not honour, each
/// refused by name (it reads the model, its context, `[cuda] budget_mb`
/// and `[sparsity] file`).
fn refuse_cpu_only_settings(c: &spinfer_engine::config::Config) -> Result<()> {
    let s = c.sparsity.as_ref();
    let unsupported = [
        ("[model] precision (the GPU runs f32 activations)", c.model.precision != PrecisionSetting::Fast),
        ("[memory]", c.memory.is_some()),
        ("[model] kv_cache (the GPU keeps its cache in f32)", c.model.kv_cache.is_some()),
        ("[model] quantize", c.model.quantize.is_some()),
        ("[sparsity] predictor", s.is_some_and(|s| s.predictor.is_some())),
        ("[sparsity] dense_above", s.is_some_and(|s| s.dense_above.is_some())),
        ("[sparsity] ffn_budget_mb", s.is_some_and(|s| s.ffn_budget_mb.is_some())),
        ("[sparsity] cache_policy", s.is_some_and(|s| s.cache_policy.is_some())),
        ("[sparsity] lookahead", s.is_some_and(|s| s.lookahead.is_some())),
        ("[speculative]", c.speculative.is_some()),
    ];
    if let Some((setting, _)) = unsupported.iter().find(|(_, set)| *set) {
        bail!("{setting} is not supported with --device cuda yet (remove it, or run on the CPU)");
    }
    Ok(())
}

/// Flags that `--device cuda` does not support yet, each refused by name.
fn refuse_cpu_only_flags(a: &GenerateArgs) -> Result<()> {
    let c = &a.common;
    let cpu_only = [
        ("--sparsity", c.sparsity.is_some() && a.gpu_budget_mb.is_none() && c.config.is_none()),
        ("--precise", c.precise),
        ("--int8", c.int8),
        ("--threads", c.threads.is_some() && a.gpu_budget_mb.is_none() && c.config.is_none()),
        ("--stats", a.stats),
        ("--kv-cache", c.kv_cache.is_some()),
        ("--quantize", c.quantize.is_some()),
        ("--draft-max", a.draft.draft_max.is_some_and(|n| n > 0)),
    ];
    if let Some((flag, _)) = cpu_only.iter().find(|(_, set)| *set) {
        bail!(
            "{flag} is not supported with --device cuda yet (the GPU runs the whole model dense, with f32 activations)"
        );
    }
    Ok(())
}

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Text file (UTF-8; CRLF is read as LF).
    #[arg(short, long)]
    pub file: PathBuf,
    /// Window size in tokens.
    #[arg(short = 'c', long, default_value_t = 512)]
    pub ctx: usize,
    /// Score at most this many windows (default: all).
    #[arg(long)]
    pub windows: Option<usize>,
    /// Run each window's first N tokens as a prompt, unscored, and score
    /// the rest as a second forward (how the sentence-level predictor is
    /// measured: it picks its neurons from the prompt). 0: the reference
    /// protocol, one forward per window.
    #[arg(long, default_value_t = 0)]
    pub prompt_tokens: usize,
    /// Where BOS goes: `default`, the tokenizer's rule (one BOS at the start
    /// of the file if the model adds one); `none`; `each-window`, every
    /// window run as BOS + window with the same tokens scored (how a model
    /// that needs its BOS, such as Gemma, is measured).
    #[arg(long, value_enum, default_value_t = BosRule::Default)]
    pub bos: BosRule,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BosRule {
    Default,
    None,
    EachWindow,
}

/// A UTF-8 text file with CRLF read as LF (an error naming the file and
/// the first bad byte otherwise).
pub fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!("{} is not valid UTF-8 (byte {})", path.display(), e.utf8_error().valid_up_to())
    })?;
    Ok(text.replace("\r\n", "\n"))
}

pub fn perplexity(a: PerplexityArgs) -> Result<()> {
    let text = read_text(&a.file)?;
    let prefix = match a.bos {
        BosRule::EachWindow => {
            if a.prompt_tokens > 0 {
                bail!("--bos each-window and --prompt-tokens cannot be combined");
            }
            1
        }
        _ => 0,
    };
    let engine = load(&a.common, Some(a.ctx + prefix))?;
    let tokens = engine.tokenizer.encode(&text, a.bos == BosRule::Default && engine.tokenizer.add_bos_default())?;
    let total = a.windows.map_or(tokens.len() / a.ctx, |w| w.min(tokens.len() / a.ctx));
    let bar = progress(a.common.quiet || a.common.json, total as u64, "windows");
    let mut session = engine.model.new_session();
    let mut on_window = |done, _, ppl: f64| {
        bar.set_position(done as u64);
        bar.set_message(format!("ppl {ppl:.4}"));
    };
    let r = if a.bos == BosRule::EachWindow {
        let Some(bos) = engine.tokenizer.bos_id() else {
            bail!("--bos each-window: the model's tokenizer has no BOS token");
        };
        perplexity::perplexity_with_prefix(
            &engine.model,
            &mut session,
            &tokens,
            a.ctx,
            &[bos],
            a.windows,
            &mut on_window,
        )?
    } else {
        perplexity::perplexity_after_prompt(
            &engine.model,
            &mut session,
            &tokens,
            a.ctx,
            a.prompt_tokens,
            a.windows,
            &mut on_window,
        )?
    };
    bar.finish_and_clear();
    if a.common.json {
        println!(
            "{}",
            serde_json::json!({"ppl": r.ppl, "nll": r.nll, "scored_tokens": r.scored_tokens, "windows": r.windows, "ctx": a.ctx, "prompt_tokens": a.prompt_tokens, "bos": format!("{:?}", a.bos).to_lowercase(),
                "sparsity": sparsity_json(&engine, &session)})
        );
    } else {
        if !a.common.quiet {
            eprintln!("{} windows of {} tokens, {} tokens scored", r.windows, a.ctx, r.scored_tokens);
            if engine.model.sparse.is_some() {
                let kept = session.sparsity_stats().mean_active_fraction();
                eprintln!("sparse FFN: kept {:.1}% of neurons on average", 100.0 * kept);
            }
        }
        println!("ppl {:.4}", r.ppl);
    }
    Ok(())
}

#[derive(Args)]
pub struct InspectArgs {
    /// Model file or directory.
    pub model: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn inspect(a: InspectArgs) -> Result<()> {
    let info = spinfer_engine::inspect::inspect(&a.model)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&info)?);
    } else {
        print!("{}", info.to_text());
    }
    Ok(())
}

#[derive(Args)]
pub struct ConvertArgs {
    /// Source GGUF model.
    #[arg(short, long)]
    pub model: PathBuf,
    /// Output directory (created; model.safetensors, config.json, tokenizer.json).
    #[arg(short, long)]
    pub out: PathBuf,
    /// Element type of the output tensors.
    #[arg(long, value_parser = ["f32", "bf16"], default_value = "f32")]
    pub dtype: String,
}

pub fn convert(a: ConvertArgs) -> Result<()> {
    use spinfer_engine::convert::{OutDType, gguf_to_safetensors};
    let src = spinfer_engine::gguf::GgufFile::open(&a.model)?;
    let dtype = if a.dtype == "bf16" { OutDType::BF16 } else { OutDType::F32 };
    let bar = progress(false, src.tensors.len() as u64, "tensors");
    gguf_to_safetensors(&src, &a.out, dtype, &mut |done, _| bar.set_position(done as u64))?;
    bar.finish_and_clear();
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

/// Loads the engine that `--config`/`--model` and the flags describe.
pub fn load(c: &CommonArgs, ctx: Option<usize>) -> Result<Engine> {
    load_config(c, &c.config(ctx)?)
}

/// Loads `config`, reporting each pack found on stderr (unless quiet).
pub fn load_config(c: &CommonArgs, config: &Config) -> Result<Engine> {
    let (engine, packs) = Engine::from_config(config)?;
    if !c.quiet && !c.json {
        for p in packs {
            match p.outcome {
                Ok(name) => eprintln!("pack {name}: registered"),
                Err(why) => eprintln!("pack {}: skipped: {why}", p.dir.display()),
            }
        }
    }
    Ok(engine)
}

/// A progress bar on stderr, hidden when `hidden`.
pub fn progress(hidden: bool, len: u64, unit: &str) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    let style =
        ProgressStyle::with_template(&format!("{{elapsed_precise}} [{{bar:40}}] {{pos}}/{{len}} {unit} {{msg}}"))
            .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}
