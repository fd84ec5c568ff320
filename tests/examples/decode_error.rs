//! Decode-path logit error of each precision against precise mode: every
//! reference prompt fed one token per step (the decode kernels, not a
//! prompt's GEMM), the logits of every step compared with precise mode's;
//! fast mode also with the built-in kernels pinned to its two 8-bit planes
//! (where `fast_act` would give one 16-bit plane). Prints max and mean
//! |Δlogit| per setting (docs/benchmarks.md, "One 16-bit activation plane").
//!
//!     cargo run --release -p spinfer-tests --example decode_error

use spinfer_engine::Engine;
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_engine::registry::KernelRegistry;
use spinfer_tests::{reference, smollm2};

/// Logits of every position, each computed as a one-token decode step.
fn stepwise(e: &Engine, ids: &[u32]) -> anyhow::Result<Vec<Vec<f32>>> {
    let mut s = e.new_session();
    ids.iter().map(|&t| Ok(e.model.forward_last(&mut s, &[t])?.to_vec())).collect()
}

fn main() -> anyhow::Result<()> {
    let Some(path) = smollm2() else {
        eprintln!("SmolLM2 not found (scripts/fetch-models.sh)");
        return Ok(());
    };
    let refs = reference();
    let options = |precision| ModelOptions { precision, ctx: 256, threads: 2, ..ModelOptions::default() };
    let isa = if spinfer_kernels::cpu::CpuFeatures::detect().has_avx512() { "avx512" } else { "avx2" };
    let mut planes = KernelRegistry::builtin();
    planes.pin("q4_1*q8_1", format!("{isa}/q4_1*q8_1"));
    planes.pin("q8_0*q8_0", format!("{isa}/q8_0*q8_0"));
    let precise = Engine::load(&path, options(Precision::Precise))?;
    let settings = [
        ("fast (default)", Engine::load_with(&path, options(Precision::Fast), &KernelRegistry::builtin())?),
        ("fast, two 8-bit planes", Engine::load_with(&path, options(Precision::Fast), &planes)?),
        ("int8", Engine::load(&path, options(Precision::Int8))?),
    ];
    for (name, e) in &settings {
        let (mut max, mut sum, mut n) = (0.0f32, 0.0f64, 0usize);
        for p in &refs.prompts {
            let (want, got) = (stepwise(&precise, &p.input_ids)?, stepwise(e, &p.input_ids)?);
            for (a, b) in want.iter().flatten().zip(got.iter().flatten()) {
                max = max.max((a - b).abs());
                sum += f64::from((a - b).abs());
                n += 1;
            }
        }
        let act = e.model.linears().next().map(|l| l.desc.act.name()).unwrap_or("?");
        println!("{name:24} ({act}): max |Δlogit| {max:.4}, mean {:.5} over {n} logits", sum / n as f64);
    }
    Ok(())
}
