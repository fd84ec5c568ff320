//! The sparse output head and the device's greedy pick on the GPU, against
//! the CPU engine (precise mode, the same index): SmolLM2-135M-Instruct and
//! Gemma 3 270M on their 6 reference prompts.
//!
//! Without a device (CI) every test says why it is skipped; with
//! `SPINFER_EXPECT_GPU=1` a missing device fails instead.

mod common;

use std::ops::ControlFlow;
use std::path::Path;

use common::{cpu_engine, gpu_model, max_abs_diff};
use spinfer_engine::Engine;
use spinfer_engine::generate::{GenerateParams, Generation, generate, generate_with};
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::head::{HeadBuildOptions, HeadCalibration, HeadIndex};
use spinfer_engine::registry::KernelRegistry;
use spinfer_engine::sampling::{SamplerParams, argmax_logits};
use spinfer_gpu::{GpuDecode, GpuModel};
use spinfer_tests::{RefPrompt, Reference, data, gemma3, gemma3_reference, reference, smollm2};

/// A quickly built index of `e`'s head (64 rows per cluster, `hot` hot
/// rows, the metric of 1,024 positions of WikiText-2 past the evaluation
/// windows, 2 rounds), saved to `path`.
fn build_index(e: &Engine, hot: usize, path: &Path) {
    let bytes = std::fs::read(data("wikitext-2-raw/wiki.test.raw")).unwrap();
    let calib = String::from_utf8_lossy(&bytes[300_000..]).replace("\r\n", "\n");
    let tokens = e.tokenizer.encode(&calib, false).unwrap();
    let mut s = e.new_session();
    let calib = HeadCalibration::from_tokens(&e.model, &mut s, &tokens, hot, 1024).unwrap();
    let o = HeadBuildOptions { cluster_rows: 64, iters: 2, ..HeadBuildOptions::default() };
    HeadIndex::build(&e.model, s.pool(), &o, &calib, &mut |_, _| {}).unwrap().save(path).unwrap();
}

/// `p`'s greedy continuation (as long as the reference's) through the
/// generation loop on the GPU model `m` and on the CPU engine `cpu`.
fn greedy_on_both(m: &GpuModel, cpu: &Engine, p: &RefPrompt, add_bos: bool) -> (Generation, Generation) {
    let params = GenerateParams {
        max_tokens: p.greedy_ids.len(),
        sampler: SamplerParams::greedy(),
        stop: vec![],
        add_bos: Some(add_bos),
        ..Default::default()
    };
    let mut s = m.new_session().unwrap();
    let go_on = &mut |_: &str| ControlFlow::Continue(());
    let g = generate_with(&mut GpuDecode::new(m, &mut s), &cpu.tokenizer, &p.text, &params, go_on).unwrap();
    let mut cs = cpu.new_session();
    let c = generate(&cpu.model, &cpu.tokenizer, &mut cs, &p.text, &params, go_on).unwrap();
    (g, c)
}

/// The GPU's sparse head hands the sampler the CPU engine's sparse logits
/// (the same clusters probed but for rounding at the edge, its computed
/// rows equal to the dense head's, every stand-in below the best of them)
/// and greedy decoding through it gives the CPU's tokens.
fn sparse_head_matches_the_cpu_engines(path: &Path, r: &Reference, add_bos: bool, hot: usize) {
    let Some(mut m) = gpu_model(path, 512) else { return };
    let mut cpu = cpu_engine(path, 512);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.head");
    build_index(&cpu, hot, &file);
    let want = GpuModel::head_model(&GgufFile::open(path).unwrap()).unwrap();
    assert_eq!(want, HeadIndex::model_of(&cpu.model), "the GPU names the head as the CPU does");
    let (gpu_index, cpu_index) = (HeadIndex::load(&file, &want).unwrap(), HeadIndex::load(&file, &want).unwrap());
    let probes = gpu_index.default_probes();
    m.set_sparse_head(Some(gpu_index), probes).unwrap();
    cpu.model.set_sparse_head(Some(cpu_index), probes, &KernelRegistry::builtin()).unwrap();
    for (i, p) in r.prompts.iter().enumerate() {
        let mut s = m.new_session().unwrap();
        m.forward(&mut s, &p.input_ids).unwrap();
        let last = p.input_ids.len() - 1;
        let dense = m.logits(&mut s, last..last + 1).unwrap();
        let sparse = m.row_logits(&mut s, last).unwrap().to_vec();
        let mut cs = cpu.new_session();
        cpu.model.forward(&mut cs, &p.input_ids).unwrap();
        let cpu_sparse = cpu.model.next_token_logits(&mut cs).unwrap().to_vec();
        // The GPU's hidden state differs from the CPU's by rounding, so a
        // cluster at the edge of the probed set may swap (at most one
        // cluster's rows, 64 here, in and out).
        let near = (0..dense.len()).filter(|&r| (sparse[r] - cpu_sparse[r]).abs() <= 1e-3).count();
        let exact = (0..dense.len()).filter(|&r| (sparse[r] - dense[r]).abs() <= 1e-4).count();
        let (gs, cstats) = (s.head_stats(), cs.head_stats());
        let best_exact = (0..dense.len())
            .filter(|&r| (sparse[r] - dense[r]).abs() <= 1e-4)
            .map(|r| sparse[r])
            .fold(f32::NEG_INFINITY, f32::max);
        eprintln!(
            "prompt {i}: {} rows computed (cpu {}), {near} of {} within 1e-3 of the cpu's sparse logits, max |diff| {:.2e}",
            gs.rows,
            cstats.rows,
            dense.len(),
            max_abs_diff(&sparse, &cpu_sparse)
        );
        assert!(sparse.iter().all(|l| l.is_finite()), "prompt {i}");
        assert_eq!(gs.tokens, 1, "prompt {i}");
        assert!(gs.rows.abs_diff(cstats.rows) <= 128, "prompt {i}: {} rows against the cpu's {}", gs.rows, cstats.rows);
        assert!(near + 256 >= dense.len(), "prompt {i}: only {near} rows agree with the cpu's sparse head");
        assert!(exact as u64 >= gs.rows, "prompt {i}: {exact} rows equal the dense head's, {} computed", gs.rows);
        assert!(sparse.iter().all(|&l| l <= best_exact), "prompt {i}: a stand-in above the best exact logit");
        let best = m.greedy_token(&mut s, last).unwrap();
        assert_eq!(best, argmax_logits(&sparse), "prompt {i}");
    }
    // Greedy continuations through the generation loop.
    for (i, p) in r.prompts.iter().enumerate() {
        let (g, c) = greedy_on_both(&m, &cpu, p, add_bos);
        eprintln!("prompt {i}: {:?}", g.text);
        assert_eq!(g.tokens, c.tokens, "prompt {i}: gpu {:?} vs cpu {:?}", g.text, c.text);
    }
}

#[test]
fn smollm2_sparse_head_matches_the_cpu_engines() {
    let Some(path) = smollm2() else { return };
    sparse_head_matches_the_cpu_engines(&path, &reference(), false, 2048);
}

#[test]
fn gemma3_sparse_head_matches_the_cpu_engines() {
    let Some(path) = gemma3() else { return };
    sparse_head_matches_the_cpu_engines(&path, &gemma3_reference(), true, 4096);
}

/// `generate --temp 0` on the GPU (the token picked on the device each
/// step) gives the CPU engine's greedy continuations, and the device's pick
/// equals the sampler's over the logits at every step.
fn device_greedy_pick_equals_the_samplers(path: &Path, r: &Reference, add_bos: bool) {
    let Some(m) = gpu_model(path, 512) else { return };
    let cpu = cpu_engine(path, 512);
    for (i, p) in r.prompts.iter().enumerate() {
        let (g, c) = greedy_on_both(&m, &cpu, p, add_bos);
        eprintln!("prompt {i}: {:?} (pytorch identical: {})", g.text, g.tokens == p.greedy_ids);
        assert_eq!(g.tokens, c.tokens, "prompt {i}");
        // Step by step: the device's pick against the sampler's.
        let mut s = m.new_session().unwrap();
        m.forward(&mut s, &p.input_ids).unwrap();
        let mut row = p.input_ids.len() - 1;
        for (step, &t) in g.tokens.iter().enumerate() {
            let want = argmax_logits(m.row_logits(&mut s, row).unwrap());
            assert_eq!(m.greedy_token(&mut s, row).unwrap(), want, "prompt {i}, step {step}");
            assert_eq!(want, t, "prompt {i}, step {step}");
            m.forward(&mut s, &[t]).unwrap();
            row = 0;
        }
    }
}

#[test]
fn smollm2_device_greedy_pick_equals_the_samplers() {
    let Some(path) = smollm2() else { return };
    device_greedy_pick_equals_the_samplers(&path, &reference(), false);
}

#[test]
fn gemma3_device_greedy_pick_equals_the_samplers() {
    let Some(path) = gemma3() else { return };
    device_greedy_pick_equals_the_samplers(&path, &gemma3_reference(), true);
}
