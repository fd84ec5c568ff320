//! `spinfer calibrate`: fit a sparsity sidecar on real text.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::loader::Loader;
use spinfer_engine::safetensors::SafetensorsModel;
use spinfer_engine::sparse::calibrate::{CalibrateOptions, calibrate};
use spinfer_engine::sparse::{CalibrationInfo, PredictorKind};

use crate::commands::{CommonArgs, progress};

#[derive(Args)]
pub struct CalibrateArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Calibration text (UTF-8; CRLF is read as LF). Keep it disjoint from
    /// evaluation text (see --offset).
    #[arg(long)]
    pub text: PathBuf,
    /// Start reading the text at this byte (e.g. 800000 for WikiText-2's
    /// test split, whose start is used for evaluation).
    #[arg(long, default_value_t = 0)]
    pub offset: usize,
    /// Calibration tokens (from the offset on).
    #[arg(long, default_value_t = 8192)]
    pub tokens: usize,
    /// Tokens per window, each run from an empty cache.
    #[arg(long, default_value_t = 512)]
    pub window: usize,
    /// Fraction of FFN neurons to skip per token.
    #[arg(long, default_value_t = 0.5)]
    pub target_sparsity: f32,
    /// Predictor recorded as the sidecar's default: gate-threshold | top-k | input-magnitude | low-rank |
    /// sentence.
    #[arg(long = "predictor-kind", default_value = "gate-threshold")]
    pub predictor_kind: String,
    /// Also fit a low-rank predictor of this rank (a multiple of 32; 0:
    /// none), so that `--predictor low-rank` can skip the gate too.
    #[arg(long, default_value_t = 0)]
    pub rank: usize,
    /// Fraction of truly active neurons the low-rank predictor's threshold
    /// keeps on the calibration windows it was fitted on. Held-out recall
    /// (the last eighth, reported) comes out up to 0.008 lower on SmolLM2,
    /// so the default 0.96 keeps at least 0.95 held out on every layer.
    #[arg(long, default_value_t = 0.96)]
    pub recall_target: f32,
    /// Also skip this fraction of the attention output before the output
    /// projection (TEAL on W_o; 0: dense). Applies with every predictor.
    #[arg(long, default_value_t = 0.0)]
    pub attn_sparsity: f32,
    /// Output sidecar (never the model file).
    #[arg(short, long)]
    pub out: PathBuf,
}

pub fn run(a: CalibrateArgs) -> Result<()> {
    let predictor = PredictorKind::parse(&a.predictor_kind)
        .with_context(|| format!("--predictor-kind '{}' is not one of {}", a.predictor_kind, PredictorKind::names()))?;
    if !(0.0..1.0).contains(&a.target_sparsity) {
        bail!("--target-sparsity must be in [0, 1), got {}", a.target_sparsity);
    }
    if !(0.0..1.0).contains(&a.attn_sparsity) {
        bail!("--attn-sparsity must be in [0, 1), got {}", a.attn_sparsity);
    }
    if a.common.sparsity.is_some() {
        bail!("calibrate runs the model dense: drop --sparsity");
    }
    if a.window == 0 {
        bail!("--window must be at least 1 token");
    }
    let config = a.common.config(Some(a.window))?;
    if config.model.path == a.out {
        bail!("--out {} is the model file; write the sidecar beside it", a.out.display());
    }
    let bytes = std::fs::read(&a.text).with_context(|| format!("cannot read {}", a.text.display()))?;
    if a.offset >= bytes.len() {
        bail!("--offset {} is past the end of {} ({} bytes)", a.offset, a.text.display(), bytes.len());
    }
    // Start at a character boundary.
    let start = (a.offset..bytes.len()).find(|&i| (bytes[i] as i8) >= -0x40).unwrap_or(bytes.len());
    let text = std::str::from_utf8(&bytes[start..])
        .map_err(|e| anyhow::anyhow!("{} is not valid UTF-8 (byte {})", a.text.display(), start + e.valid_up_to()))?
        .replace("\r\n", "\n");

    let engine = crate::commands::load_config(&a.common, &config)?;
    let mut tokens = engine.tokenizer.encode(&text, false)?;
    tokens.truncate(a.tokens);
    if tokens.len() < a.tokens {
        tracing::warn!("{} holds only {} tokens after byte {}", a.text.display(), tokens.len(), a.offset);
    }
    // The sidecar records the model's identity, read from its file.
    let path = engine.path();
    let loader: Box<dyn Loader> = if spinfer_engine::engine::is_safetensors(path) {
        Box::new(SafetensorsModel::open(path)?)
    } else {
        Box::new(GgufFile::open(path)?)
    };
    if !a.rank.is_multiple_of(32) {
        bail!("--rank must be a multiple of 32, got {}", a.rank);
    }
    let c = &engine.model.config;
    if a.rank > c.dim.min(c.ffn_dim) {
        bail!("--rank {} is larger than the model's hidden size {} (or FFN size {})", a.rank, c.dim, c.ffn_dim);
    }
    let hidden = a.common.quiet || a.common.json;
    let bar = progress(hidden, tokens.len().div_ceil(a.window) as u64, "steps");
    let passes = if a.rank > 0 { 5 } else { 2 };
    let opts = CalibrateOptions {
        target_sparsity: a.target_sparsity,
        predictor,
        window: a.window,
        info: CalibrationInfo {
            text: a.text.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default(),
            byte_offset: start,
            tokens: 0,
        },
        rank: a.rank,
        recall_target: a.recall_target,
        attn_sparsity: a.attn_sparsity,
    };
    let what = [
        "",
        "activation histograms",
        "neuron frequencies",
        "input moments, low-rank factors",
        "predictor thresholds",
        "held-out recall",
    ];
    let sidecar = calibrate(&engine.model, loader.as_ref(), &tokens, &opts, &mut |pass, done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        bar.set_message(format!("pass {pass}/{passes}: {}", what.get(pass).copied().unwrap_or("")));
    })?;
    bar.finish_and_clear();
    sidecar.write(&a.out)?;
    let thresholds: Vec<f32> = sidecar.layers.iter().map(|l| l.threshold).collect();
    if a.common.json {
        println!(
            "{}",
            serde_json::json!({"out": a.out, "tokens": tokens.len(), "target_sparsity": a.target_sparsity,
                "predictor": predictor.name(), "thresholds": thresholds, "attn_sparsity": sidecar.attn_sparsity,
                "lowrank": sidecar.lowrank})
        );
    } else {
        if !a.common.quiet {
            eprintln!(
                "calibrated on {} tokens of {} (from byte {start}); thresholds {:.4}..{:.4}",
                tokens.len(),
                a.text.display(),
                thresholds.iter().copied().fold(f32::INFINITY, f32::min),
                thresholds.iter().copied().fold(0.0, f32::max)
            );
            if let Some(lr) = &sidecar.lowrank {
                eprintln!(
                    "low-rank predictor, rank {}: held-out recall (target {}) and kept fraction per layer over {} tokens:",
                    lr.rank, lr.recall_target, lr.heldout_tokens
                );
                for (l, (r, k)) in lr.heldout_recall.iter().zip(&lr.predicted_fraction).enumerate() {
                    eprintln!("  layer {l:>2}: recall {r:.3}, keeps {:.1}%", 100.0 * k);
                }
            }
        }
        println!("{}", a.out.display());
    }
    Ok(())
}
