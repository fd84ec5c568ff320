//! A digest of the last-position logits on the 6 reference prompts, per
//! model and precision, for A/B checks that a refactor changed no number:
//! build this example before and after, run both, `diff` the output (see
//! docs/benchmarks.md, "Refactor A/B"). Each line: model, precision,
//! prompt index, FNV-1a of the logits' bits, the top token.
//!
//!     cargo run --release -p spinfer-tests --example logits_digest

use spinfer_engine::Engine;
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_tests::{Reference, gemma3, gemma3_reference, reference, smollm2};

fn fnv1a(bits: impl Iterator<Item = u32>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bits {
        for byte in b.to_le_bytes() {
            h = (h ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

fn main() -> anyhow::Result<()> {
    type Case = (&'static str, Option<std::path::PathBuf>, fn() -> Reference);
    let models: [Case; 2] = [("smollm2", smollm2(), reference), ("gemma3", gemma3(), gemma3_reference)];
    for (name, path, refs) in models {
        let Some(path) = path else {
            eprintln!("{name}: model not found (scripts/fetch-models.sh), skipped");
            continue;
        };
        let refs = refs();
        for precision in [Precision::Precise, Precision::Fast, Precision::Int8] {
            let e = Engine::load(&path, ModelOptions { precision, ctx: 256, threads: 2, ..ModelOptions::default() })?;
            for (i, p) in refs.prompts.iter().enumerate() {
                let logits = e.logits(&p.input_ids)?;
                let top = logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(t, _)| t);
                let digest = fnv1a(logits.iter().map(|x| x.to_bits()));
                println!("{name} {precision:?} prompt{i} {digest:016x} top={top}");
            }
        }
    }
    Ok(())
}
