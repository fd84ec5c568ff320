//! Greedy generation through the library API, streamed to stdout and
//! cancelled after a number of pieces, then the engine's metrics.
//!
//! ```sh
//! cargo run --release -p spinfer-engine --example generate -- \
//!     [MODEL.gguf] [--prompt TEXT] [--pieces N] [--max-tokens N]
//! ```
//!
//! MODEL defaults to `models/SmolLM2-135M-Instruct.Q4_1.gguf` (fetched by
//! `scripts/fetch-models.sh`).

use std::io::Write;
use std::ops::ControlFlow;

use spinfer_engine::Engine;
use spinfer_engine::generate::GenerateParams;
use spinfer_engine::model::ModelOptions;
use spinfer_engine::sampling::SamplerParams;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut model = "models/SmolLM2-135M-Instruct.Q4_1.gguf".to_string();
    let mut prompt = "The three most useful things to know about Rust are".to_string();
    let mut pieces = 24usize;
    let mut max_tokens = 64usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--prompt" => prompt = value()?,
            "--pieces" => pieces = value()?.parse()?,
            "--max-tokens" => max_tokens = value()?.parse()?,
            "-h" | "--help" => {
                eprintln!("usage: generate [MODEL.gguf] [--prompt TEXT] [--pieces N] [--max-tokens N]");
                return Ok(());
            }
            _ => model = a,
        }
    }

    let engine = Engine::load(&model, ModelOptions::default())?;
    let params = GenerateParams { max_tokens, sampler: SamplerParams::greedy(), ..Default::default() };

    println!("prompt: {prompt}");
    let mut seen = 0;
    let mut stdout = std::io::stdout();
    let out = engine.generate_stream(&prompt, &params, |piece| {
        print!("{piece}");
        let _ = stdout.flush();
        seen += 1;
        if seen >= pieces { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
    })?;
    println!();
    let m = &out.metrics;
    println!(
        "stop: {:?} after {} pieces, {} tokens; prompt {} tokens; prefill {:.1} tok/s, decode {:.1} tok/s, total {:.3} s",
        out.stop_reason,
        seen,
        out.tokens.len(),
        m.prompt_tokens,
        m.prefill_tokens_per_second(),
        m.decode_tokens_per_second(),
        m.total.as_secs_f64()
    );

    // A second request and an embedding, so the cumulative counters show more than one call.
    let again = engine.generate("Paris is the capital of", &GenerateParams { max_tokens: 8, ..params })?;
    println!("second request: {:?} ({:?})", again.text, again.stop_reason);
    let v = engine.embed("an embedding from the decoder")?;
    println!("embedding: {} dimensions, first values {:?}", v.len(), &v[..4]);

    let m = engine.metrics();
    println!("\nengine metrics since load:");
    println!(
        "  requests {} (generate {}, embed {}, cancelled {}, errors {})",
        m.requests, m.generate_requests, m.embed_requests, m.cancelled, m.errors
    );
    println!("  tokens: prompt {}, generated {}", m.prompt_tokens, m.generated_tokens);
    println!(
        "  time: tokenize {:?}, prefill {:?}, decode {:?}, sample {:?}",
        m.timings.tokenize, m.timings.prefill, m.timings.decode, m.timings.sample
    );
    println!(
        "  speed: prefill {:.1} tok/s, decode {:.1} tok/s",
        m.prefill_tokens_per_second(),
        m.decode_tokens_per_second()
    );
    match m.sparse_kept_fraction {
        Some(f) => println!("  sparse FFN: {:.1}% of neurons kept", 100.0 * f),
        None => println!("  FFN: dense"),
    }
    println!("  kernels:");
    for k in &m.kernels {
        println!("    {:<32} {:<28} {} ({})", k.op, k.kernel, k.provider, k.choice);
    }
    Ok(())
}
