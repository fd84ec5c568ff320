//! `embed` (sentence embeddings as JSON lines or a NumPy file) and
//! `eval-sts` (STS-B Spearman correlation).

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use spinfer_engine::embed::{Embedder, EmbedderOptions, Embedding, cosine, sts};
use spinfer_engine::model::llama::MAX_THREADS;

use crate::commands::progress;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// One JSON object per input, in order: {"index", "tokens", "truncated", "embedding"}.
    Jsonl,
    /// A float32 (inputs, dimensions) NumPy .npy file (needs -o).
    Npy,
}

/// Options both commands share.
#[derive(Args)]
pub struct EmbedModelArgs {
    /// A sentence-transformers model directory (config.json, model.safetensors,
    /// tokenizer.json, modules.json, 1_Pooling/).
    #[arg(short, long)]
    pub model: PathBuf,
    /// Worker threads (default: all cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
    /// Inputs per forward pass.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Print only the result on stdout (no progress, no summary).
    #[arg(short, long)]
    pub quiet: bool,
    /// Run the FFN sparse with this sidecar (written by `calibrate-embed`).
    #[arg(long)]
    pub sparsity: Option<PathBuf>,
}

impl EmbedModelArgs {
    fn load(&self) -> Result<Embedder> {
        if self.batch_size == 0 {
            bail!("--batch-size must be at least 1");
        }
        let mut o = EmbedderOptions { batch_size: self.batch_size, ..EmbedderOptions::default() };
        match self.threads {
            Some(0) => bail!("--threads must be at least 1"),
            Some(t) if t > MAX_THREADS => bail!("--threads {t} is more than the {MAX_THREADS} allowed"),
            Some(t) => o.threads = t,
            None => {}
        }
        o.sparsity.clone_from(&self.sparsity);
        Embedder::load(&self.model, o).with_context(|| format!("cannot load embedding model {}", self.model.display()))
    }
}

#[derive(Args)]
pub struct EmbedArgs {
    #[command(flatten)]
    pub common: EmbedModelArgs,
    /// Read the inputs from a UTF-8 file, one per line (an empty line is an
    /// empty input; `-` reads stdin).
    #[arg(short, long, conflicts_with = "text")]
    pub file: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Jsonl)]
    pub format: Format,
    /// Write the result here instead of stdout (required for npy).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Texts to embed, one input each.
    pub text: Vec<String>,
}

pub fn embed(a: EmbedArgs) -> Result<()> {
    let inputs = match &a.file {
        Some(f) => read_lines(f)?,
        None if a.text.is_empty() => bail!("give texts to embed, or --file"),
        None => a.text.clone(),
    };
    if a.format == Format::Npy && a.output.is_none() {
        bail!("--format npy writes a binary file: give it with -o");
    }
    let quiet = a.common.quiet;
    let embedder = a.common.load()?;

    // Embed in chunks of one forward pass each, so progress can be shown.
    let texts: Vec<&str> = inputs.iter().map(String::as_str).collect();
    let bar = progress(quiet, texts.len() as u64, "inputs");
    let t0 = Instant::now();
    let mut results: Vec<Embedding> = Vec::with_capacity(texts.len());
    for chunk in texts.chunks(a.common.batch_size) {
        results.extend(embedder.embed_batch_detailed(chunk)?);
        bar.set_position(results.len() as u64);
    }
    let secs = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();

    match a.format {
        Format::Jsonl => {
            let mut out: Box<dyn Write> = match &a.output {
                Some(p) => Box::new(BufWriter::new(
                    std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
                )),
                None => Box::new(BufWriter::new(std::io::stdout().lock())),
            };
            for (i, e) in results.iter().enumerate() {
                let v = serde_json::json!({
                    "index": i, "tokens": e.tokens, "truncated": e.truncated, "embedding": e.vector,
                });
                writeln!(out, "{v}")?;
            }
            out.flush()?;
        }
        Format::Npy => {
            let p = a.output.as_deref().unwrap_or(Path::new(""));
            write_npy(p, &results, embedder.dimensions()).with_context(|| format!("cannot write {}", p.display()))?;
        }
    }
    if !quiet {
        let tokens: usize = results.iter().map(|e| e.tokens).sum();
        let truncated = results.iter().filter(|e| e.truncated).count();
        // The matmuls' kernels, each named once (the precision they ran
        // in: f32, bf16 or i16).
        let mut kernels: Vec<&str> = Vec::new();
        for k in embedder.model().dense_layers().map(|d| d.kernel_name()) {
            if !kernels.contains(&k) {
                kernels.push(k);
            }
        }
        eprintln!(
            "[{} inputs, {tokens} tokens, {truncated} truncated, dim {} | {secs:.3} s: {:.1} inputs/s, {:.0} tokens/s | matmuls: {}]",
            results.len(),
            embedder.dimensions(),
            results.len() as f64 / secs,
            tokens as f64 / secs,
            kernels.join(", ")
        );
        report_sparsity(&embedder);
    }
    Ok(())
}

/// The measured kept fraction of the sparse FFN, on stderr.
fn report_sparsity(embedder: &Embedder) {
    if let Some(sp) = embedder.sparse_ffn() {
        let per_layer: Vec<String> = sp.kept_fractions().iter().map(|f| format!("{f:.3}")).collect();
        eprintln!(
            "[sparse FFN {}: kept {:.3} of the neurons (layers: {})]",
            sp.path.display(),
            sp.kept_fraction(),
            per_layer.join(" ")
        );
    }
}

/// The lines of a UTF-8 file (`-`: stdin). A trailing newline does not
/// start another input; `\r\n` counts as `\n`.
fn read_lines(path: &Path) -> Result<Vec<String>> {
    let bytes = if path.as_os_str() == "-" {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut b).context("cannot read stdin")?;
        b
    } else {
        std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?
    };
    let body = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
    if body.is_empty() && bytes.is_empty() {
        bail!("{} is empty: nothing to embed", path.display());
    }
    body.split(|&b| b == b'\n')
        .enumerate()
        .map(|(i, line)| {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            String::from_utf8(line.to_vec()).map_err(|e| {
                anyhow::anyhow!(
                    "{}: line {} is not valid UTF-8 (byte {} of the line)",
                    path.display(),
                    i + 1,
                    e.utf8_error().valid_up_to()
                )
            })
        })
        .collect()
}

/// A NumPy v1.0 `.npy` file holding a little-endian float32 (rows, dim) array.
fn write_npy(path: &Path, rows: &[Embedding], dim: usize) -> Result<()> {
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {dim}), }}", rows.len());
    // Magic (6) + version (2) + header length (2) + header, padded with
    // spaces and ending in '\n', is a multiple of 64 bytes.
    let total = (10 + header.len() + 1).next_multiple_of(64);
    header.push_str(&" ".repeat(total - 10 - header.len() - 1));
    header.push('\n');
    let mut f = BufWriter::new(std::fs::File::create(path)?);
    f.write_all(b"\x93NUMPY\x01\x00")?;
    f.write_all(&u16::try_from(header.len())?.to_le_bytes())?;
    f.write_all(header.as_bytes())?;
    for e in rows {
        for x in &e.vector {
            f.write_all(&x.to_le_bytes())?;
        }
    }
    f.flush()?;
    Ok(())
}

#[derive(Args)]
pub struct EvalStsArgs {
    #[command(flatten)]
    pub common: EmbedModelArgs,
    /// STS-B file (e.g. sts-test.csv): tab-separated genre, file, year, id,
    /// score, sentence1, sentence2.
    #[arg(short, long)]
    pub file: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn eval_sts(a: EvalStsArgs) -> Result<()> {
    let pairs = sts::read(&a.file)?;
    let embedder = a.common.load()?;
    let texts: Vec<&str> = pairs.iter().flat_map(|p| [p.sentence1.as_str(), p.sentence2.as_str()]).collect();
    let bar = progress(a.common.quiet || a.json, texts.len() as u64, "sentences");
    let t0 = Instant::now();
    let mut vectors: Vec<Vec<f32>> = Vec::with_capacity(texts.len());
    for chunk in texts.chunks(a.common.batch_size) {
        vectors.extend(embedder.embed_batch(chunk)?);
        bar.set_position(vectors.len() as u64);
    }
    let secs = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let sims: Vec<f64> = vectors.chunks_exact(2).map(|v| f64::from(cosine(&v[0], &v[1]))).collect();
    let gold: Vec<f64> = pairs.iter().map(|p| p.score).collect();
    let rho = sts::spearman(&sims, &gold);
    if a.json {
        let kept = embedder.sparse_ffn().map(|s| s.kept_fraction());
        println!(
            "{}",
            serde_json::json!({"spearman": rho, "pairs": pairs.len(), "seconds": secs, "kept_fraction": kept})
        );
    } else if a.common.quiet {
        println!("{rho:.6}");
    } else {
        eprintln!(
            "{} pairs ({} sentences) in {secs:.2} s: {:.1} sentences/s",
            pairs.len(),
            texts.len(),
            texts.len() as f64 / secs
        );
        report_sparsity(&embedder);
        println!("spearman {rho:.6}");
    }
    Ok(())
}

#[derive(Args)]
pub struct CalibrateEmbedArgs {
    #[command(flatten)]
    pub common: EmbedModelArgs,
    /// Raw text to calibrate on, one text per line (e.g. WikiText-2's
    /// wiki.test.raw; empty lines and ` = Heading = ` lines are skipped, as
    /// are lines longer than the model's max length).
    #[arg(long)]
    pub text: PathBuf,
    /// Start at the first line after this byte (keep calibration text apart
    /// from evaluation text).
    #[arg(long, default_value_t = 800_000)]
    pub offset: usize,
    /// Lines to embed.
    #[arg(long, default_value_t = 2000)]
    pub lines: usize,
    /// Fraction of FFN neurons to skip per token, in [0, 1).
    #[arg(long)]
    pub target_sparsity: f32,
    /// Where to write the sidecar (JSON).
    #[arg(short, long)]
    pub output: PathBuf,
}

pub fn calibrate_embed(a: CalibrateEmbedArgs) -> Result<()> {
    if a.common.sparsity.is_some() {
        bail!("calibrate-embed measures the dense model: drop --sparsity");
    }
    let mut embedder = a.common.load()?;
    let raw = std::fs::read(&a.text).with_context(|| format!("cannot read {}", a.text.display()))?;
    let texts = embedder.calibration_texts(&raw, a.offset, a.lines)?;
    if texts.is_empty() {
        bail!("{} has no usable lines after byte {}", a.text.display(), a.offset);
    }
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let t0 = Instant::now();
    let source = format!("{} (lines after byte {})", a.text.display(), a.offset);
    let sidecar = embedder.calibrate_sparsity(&refs, a.target_sparsity, &source)?;
    sidecar.write(&a.output)?;
    if !a.common.quiet {
        let th: Vec<String> = sidecar.thresholds.iter().map(|t| format!("{t:.4}")).collect();
        eprintln!(
            "[{} texts, {} tokens in {:.1} s; target sparsity {}; thresholds {}]",
            sidecar.calibration.texts,
            sidecar.calibration.tokens,
            t0.elapsed().as_secs_f64(),
            a.target_sparsity,
            th.join(" ")
        );
    }
    println!("{}", a.output.display());
    Ok(())
}
