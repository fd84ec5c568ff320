//! What the GPU model tests share: loading (skipped, saying why, without a
//! device), and the three checks against PyTorch's reference and the CPU
//! engine.

#![allow(dead_code, reason = "each test binary uses part of it")]

use std::path::Path;

use spinfer_engine::Engine;
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_gpu::{GpuError, GpuModel};
use spinfer_kernels_cuda::CudaError;
use spinfer_tests::Reference;

/// The model on the GPU, or `None` (with a message) without a device;
/// with `SPINFER_EXPECT_GPU=1` a missing device fails instead.
pub fn gpu_model(path: &Path, ctx: usize) -> Option<GpuModel> {
    let g = GgufFile::open(path).expect("model opens");
    match GpuModel::load(&g, ctx) {
        Ok(m) => Some(m),
        Err(GpuError::Cuda(CudaError::Unavailable(why))) => {
            assert!(std::env::var("SPINFER_EXPECT_GPU").as_deref() != Ok("1"), "SPINFER_EXPECT_GPU=1 but: {why}");
            eprintln!("skipped: {why}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// The CPU engine in precise mode (f32 activations, as the GPU runs).
pub fn cpu_engine(path: &Path, ctx: usize) -> Engine {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(16));
    let options = ModelOptions { precision: Precision::Precise, ctx, threads, ..ModelOptions::default() };
    Engine::load(path, options).expect("cpu engine")
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

pub fn argmax(x: &[f32]) -> u32 {
    x.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as u32)
}

/// Last-position logits within `tol` of PyTorch's and of the CPU engine's,
/// the same top token as PyTorch's.
pub fn check_logits(m: &GpuModel, cpu: &Engine, reference: &Reference, tol: f32) {
    for (i, p) in reference.prompts.iter().enumerate() {
        let mut s = m.new_session().unwrap();
        let got = m.forward_last(&mut s, &p.input_ids).unwrap();
        let want = p.last_logits();
        let mut cs = cpu.new_session();
        let cpu_logits = cpu.model.forward_last(&mut cs, &p.input_ids).unwrap().to_vec();
        let (d_ref, d_cpu) = (max_abs_diff(&got, &want), max_abs_diff(&got, &cpu_logits));
        eprintln!("prompt {i}: max |gpu - pytorch| {d_ref:.4}, max |gpu - cpu precise| {d_cpu:.4}");
        assert_eq!(got.len(), want.len());
        assert!(d_ref <= tol && d_cpu <= tol, "prompt {i}: {d_ref} / {d_cpu}");
        assert_eq!(argmax(&got), argmax(&want), "prompt {i}");
    }
}

/// Greedy continuations one token per forward call (the decode graph):
/// identical to the CPU engine's on every prompt, each step's logits equal
/// to those with every kernel launched (no graph); reported against
/// PyTorch's.
pub fn check_greedy(m: &GpuModel, cpu: &Engine, reference: &Reference) {
    let mut same_as_ref = 0;
    for (i, p) in reference.prompts.iter().enumerate() {
        let steps = p.greedy_ids.len();
        let (mut s, mut cs) = (m.new_session().unwrap(), cpu.new_session());
        let mut plain = m.new_session().unwrap();
        plain.set_graphs(false);
        let mut next = argmax(&m.forward_last(&mut s, &p.input_ids).unwrap());
        m.forward(&mut plain, &p.input_ids).unwrap();
        let mut cnext = argmax(cpu.model.forward_last(&mut cs, &p.input_ids).unwrap());
        let (mut gpu_ids, mut cpu_ids) = (vec![next], vec![cnext]);
        for _ in 1..steps {
            let logits = m.forward_last(&mut s, &[next]).unwrap();
            let unfused = m.forward_last(&mut plain, &[next]).unwrap();
            assert!(max_abs_diff(&logits, &unfused) <= 1e-3, "prompt {i}: graph and plain launches differ");
            next = argmax(&logits);
            cnext = argmax(cpu.model.forward_last(&mut cs, &[cnext]).unwrap());
            gpu_ids.push(next);
            cpu_ids.push(cnext);
        }
        let text = cpu.tokenizer.decode(&gpu_ids).unwrap();
        eprintln!("prompt {i}: {text:?} (pytorch identical: {})", gpu_ids == p.greedy_ids);
        same_as_ref += usize::from(gpu_ids == p.greedy_ids);
        assert_eq!(gpu_ids, cpu_ids, "prompt {i}: gpu {text:?}");
    }
    eprintln!("{same_as_ref} of {} continuations identical to pytorch's", reference.prompts.len());
}

/// Prompts fed in chunks of 1 to 8 tokens (the GEMV path, batches of
/// every size): the fused steps (the gated activation inside the down
/// projection, residual add and RMSNorm inside the next projections) give
/// every row's logits of every chunk within `tol` of the steps launched
/// one by one. Kernel by kernel on both sides (no graph), so only the
/// fusion differs.
pub fn check_fused(m: &GpuModel, reference: &Reference, tol: f32) {
    let mut worst = 0f32;
    for (i, p) in reference.prompts.iter().enumerate() {
        let (mut fused, mut plain) = (m.new_session().unwrap(), m.new_session().unwrap());
        fused.set_graphs(false);
        plain.set_graphs(false);
        plain.set_fused(false);
        let (mut at, mut size) = (0, 1);
        while at < p.input_ids.len() {
            let chunk = &p.input_ids[at..(at + size).min(p.input_ids.len())];
            m.forward(&mut fused, chunk).unwrap();
            m.forward(&mut plain, chunk).unwrap();
            let a = m.logits(&mut fused, 0..chunk.len()).unwrap();
            let b = m.logits(&mut plain, 0..chunk.len()).unwrap();
            let d = max_abs_diff(&a, &b);
            assert!(a.iter().all(|v| v.is_finite()), "prompt {i}: fused logits not finite");
            assert!(d <= tol, "prompt {i}, tokens {at}..{}: fused and unfused differ by {d}", at + chunk.len());
            worst = worst.max(d);
            at += chunk.len();
            size = size % 8 + 1;
        }
    }
    eprintln!("fused vs unfused steps: max |diff| {worst:.2e}");
}

/// WikiText-2 perplexity by the reference protocol: the file tokenised
/// once (CRLF -> LF, the tokenizer's default BOS), 40 windows of 512 from
/// an empty cache, tokens 2..512 of each scored.
pub fn wikitext2_ppl(m: &GpuModel, cpu: &Engine, text_path: &Path) -> f64 {
    let text = std::fs::read_to_string(text_path).unwrap().replace("\r\n", "\n");
    let tokens = cpu.tokenizer.encode(&text, cpu.tokenizer.add_bos_default()).unwrap();
    let (ctx, vocab) = (512, m.config.vocab_size);
    let mut s = m.new_session().unwrap();
    let (mut nll, mut scored) = (0f64, 0usize);
    for w in 0..40 {
        let win = &tokens[w * ctx..(w + 1) * ctx];
        s.reset();
        m.forward(&mut s, win).unwrap();
        let logits = m.logits(&mut s, 0..ctx - 1).unwrap();
        for (r, row) in logits.chunks_exact(vocab).enumerate() {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let sum: f64 = row.iter().map(|&x| (f64::from(x) - max).exp()).sum();
            nll -= f64::from(row[win[r + 1] as usize]) - max - sum.ln();
            scored += 1;
        }
    }
    assert_eq!(scored, 20_440);
    (nll / scored as f64).exp()
}
