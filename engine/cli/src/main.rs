//! `spinfer`: run, measure and inspect models from the command line.
//!
//! Conventions: results go to stdout, everything else (progress, timings,
//! logs) to stderr; `--quiet` leaves only the result; `--json` prints one
//! machine-readable object; errors exit non-zero with a message on stderr.

mod bench;
mod calibrate;
mod chat;
mod commands;
mod constrain;
mod embed;
mod gpu;
mod head;
mod kernels;
mod pack;
mod paired;
mod report;
mod sampling;
mod serve;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "spinfer", version, about = "Sparse inference engine for LLMs and embedding models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt.
    Generate(commands::GenerateArgs),
    /// Chat with the model: each line of input a turn, in its chat template.
    Chat(chat::ChatArgs),
    /// Perplexity of a text file (windows of --ctx tokens, each from an empty cache).
    Perplexity(commands::PerplexityArgs),
    /// Prefill (pp128, pp512) and decode (tg128) speed and peak memory.
    Bench(bench::BenchArgs),
    /// Architecture, hyper-parameters, tensors and tokenizer of a model file.
    Inspect(commands::InspectArgs),
    /// Convert a GGUF model to a safetensors checkpoint (dequantising).
    Convert(commands::ConvertArgs),
    /// Create keys, sign, verify and inspect kernel packs.
    Pack(pack::PackArgs),
    /// Which kernel serves each operation of a model, and why.
    Kernels(kernels::KernelsArgs),
    /// Benchmark every candidate kernel on the model's shapes and record it.
    Tune(kernels::KernelsArgs),
    /// Fit a sparsity sidecar (per-layer thresholds, neuron frequencies) on real text.
    Calibrate(calibrate::CalibrateArgs),
    /// Cluster the output head's rows into a head index (for --head sparse).
    CalibrateHead(head::CalibrateHeadArgs),
    /// Agreement of the sparse head with the dense one per probe count, on real text.
    HeadEval(head::HeadEvalArgs),
    /// Sentence embeddings of texts or of a file's lines (JSON lines or .npy).
    Embed(embed::EmbedArgs),
    /// Spearman correlation of embedding cosine similarity with STS-B gold scores.
    EvalSts(embed::EvalStsArgs),
    /// Fit sparse-FFN thresholds for a sentence-embedding model on real text (JSON sidecar).
    CalibrateEmbed(embed::CalibrateEmbedArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (continuous batching).
    Serve(serve::ServeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Serve(_)) {
        end_quietly_on_closed_stdout();
    }
    let quiet = match &cli.command {
        Command::Generate(a) => a.common.quiet,
        Command::Chat(a) => a.common.quiet,
        Command::Perplexity(a) => a.common.quiet,
        Command::Bench(a) => a.quiet,
        Command::Kernels(a) | Command::Tune(a) => a.common.quiet,
        Command::Calibrate(a) => a.common.quiet,
        Command::CalibrateHead(a) => a.common.quiet,
        Command::HeadEval(a) => a.common.quiet,
        Command::Embed(a) => a.common.quiet,
        Command::EvalSts(a) => a.common.quiet || a.json,
        Command::CalibrateEmbed(a) => a.common.quiet,
        Command::Serve(a) => a.quiet,
        Command::Inspect(_) | Command::Convert(_) | Command::Pack(_) => false,
    };
    init_logging(quiet);
    let result = match cli.command {
        Command::Generate(a) => commands::generate(a),
        Command::Chat(a) => chat::chat(a),
        Command::Perplexity(a) => commands::perplexity(a),
        Command::Bench(a) => bench::run(a),
        Command::Inspect(a) => commands::inspect(a),
        Command::Convert(a) => commands::convert(a),
        Command::Pack(a) => pack::run(a),
        Command::Kernels(a) => kernels::kernels(a),
        Command::Tune(a) => kernels::tune_cmd(a),
        Command::Calibrate(a) => calibrate::run(a),
        Command::CalibrateHead(a) => head::calibrate_head(a),
        Command::HeadEval(a) => head::head_eval(a),
        Command::Embed(a) => embed::embed(a),
        Command::EvalSts(a) => embed::eval_sts(a),
        Command::CalibrateEmbed(a) => embed::calibrate_embed(a),
        Command::Serve(a) => serve::serve(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Output piped into a reader that stops early (`spinfer kernels | head`)
/// ends the process as it ends `cat`, by SIGPIPE, instead of a panic in
/// `println!` (Rust ignores SIGPIPE by default). Not for `serve`, whose
/// writes to closed client sockets must stay errors.
fn end_quietly_on_closed_stdout() {
    // SAFETY: called from main before any thread is started; SIG_DFL is a
    // valid disposition for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Library logs go to stderr; `RUST_LOG` overrides the level.
fn init_logging(quiet: bool) {
    use tracing_subscriber::EnvFilter;
    let default = if quiet { "error" } else { "warn" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}
