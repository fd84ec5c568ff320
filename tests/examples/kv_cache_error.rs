//! What an f16 KV cache costs in accuracy, as a curve over context length:
//! WikiText-2 windows of 512, 1024 and 2048 tokens (the reference
//! perplexity protocol, each window from an empty cache), run with an f32
//! and an f16 cache at the same precision; every position's logits
//! compared (max and mean |Δlogit|, top-1 agreement) and the windows'
//! perplexity under each (docs/benchmarks.md, "An f16 KV cache"). With
//! `gemma`, Gemma 3 270M (its local layers' rings, head dim 256), each
//! window run as BOS + window as its perplexity protocol asks.
//!
//!     cargo run --release -p spinfer-tests --example kv_cache_error [-- WINDOWS [gemma]]

use anyhow::{Context, Result};
use spinfer_engine::Engine;
use spinfer_engine::model::{KvType, ModelOptions, Precision};
use spinfer_engine::perplexity::log_softmax_at;
use spinfer_engine::sampling::argmax_logits;
use spinfer_tests::{data, gemma3, smollm2};

/// Rows of logits compared at a time.
const ROWS: usize = 64;

/// Every position's logits of one window, `ROWS` at a time, to `f`.
fn window_logits(e: &Engine, ids: &[u32], mut f: impl FnMut(usize, &[f32])) -> Result<()> {
    let mut s = e.new_session();
    e.model.forward(&mut s, ids)?;
    for r in (0..ids.len()).step_by(ROWS) {
        let end = (r + ROWS).min(ids.len());
        let logits = e.model.logits(&mut s, r..end)?.to_vec();
        f(r, &logits);
    }
    Ok(())
}

fn main() -> Result<()> {
    let windows: usize = std::env::args().nth(1).map_or(Ok(2), |w| w.parse()).context("WINDOWS")?;
    let gemma = std::env::args().nth(2).is_some_and(|m| m == "gemma");
    let Some(path) = (if gemma { gemma3() } else { smollm2() }) else {
        eprintln!("model not found (scripts/fetch-models.sh)");
        return Ok(());
    };
    let text = String::from_utf8(std::fs::read(data("wikitext-2-raw/wiki.test.raw"))?)?.replace("\r\n", "\n");
    println!(
        "| precision | window | max \\|Δlogit\\| | mean \\|Δlogit\\| | top-1 agree | ppl f32 cache | ppl f16 cache |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for precision in [Precision::Fast, Precision::Precise] {
        let load = |kv| {
            let o = ModelOptions { precision, ctx: 2048, threads: 2, kv_type: Some(kv), ..ModelOptions::default() };
            Engine::load(&path, o)
        };
        let (f32_cache, f16_cache) = (load(KvType::F32)?, load(KvType::F16)?);
        let bos = if gemma { f32_cache.tokenizer.bos_id() } else { None };
        let ids = f32_cache.tokenizer.encode(&text, bos.is_none())?;
        for ctx in [512, 1024, 2048] {
            let (mut max, mut sum, mut n, mut agree) = (0.0f32, 0.0f64, 0usize, 0usize);
            let (mut nll32, mut nll16, mut scored) = (0.0f64, 0.0f64, 0usize);
            let vocab = f32_cache.model.config.vocab_size;
            for w in 0..windows.min(ids.len() / ctx) {
                let win = &[bos.as_slice(), &ids[w * ctx..(w + 1) * ctx - usize::from(bos.is_some())]].concat();
                let mut exact = Vec::new();
                window_logits(&f32_cache, win, |_, l| exact.push(l.to_vec()))?;
                let mut chunks = exact.iter();
                window_logits(&f16_cache, win, |r, got| {
                    let want = chunks.next().expect("the same rows as the f32 run");
                    for (i, (a, b)) in want.chunks_exact(vocab).zip(got.chunks_exact(vocab)).enumerate() {
                        for (x, y) in a.iter().zip(b) {
                            max = max.max((x - y).abs());
                            sum += f64::from((x - y).abs());
                        }
                        n += vocab;
                        agree += usize::from(argmax_logits(a) == argmax_logits(b));
                        // Position p's logits score token p + 1.
                        if let Some(&next) = win.get(r + i + 1) {
                            nll32 -= log_softmax_at(a, next as usize);
                            nll16 -= log_softmax_at(b, next as usize);
                            scored += 1;
                        }
                    }
                })?;
            }
            let positions = n / vocab;
            println!(
                "| {precision:?} | {ctx} | {max:.4} | {:.5} | {:.2}% | {:.4} | {:.4} |",
                sum / n.max(1) as f64,
                100.0 * agree as f64 / positions.max(1) as f64,
                (nll32 / scored.max(1) as f64).exp(),
                (nll16 / scored.max(1) as f64).exp(),
            );
        }
    }
    Ok(())
}
