//! SmolLM2-135M-Instruct fully on the GPU against PyTorch's reference
//! (tests/data/reference) and the CPU engine: last-position logits of the
//! 6 reference prompts, greedy continuations, WikiText-2 perplexity.
//!
//! Without a device (CI) every test says why it is skipped; with
//! `SPINFER_EXPECT_GPU=1` a missing device fails instead.

use spinfer_engine::Engine;
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_gpu::{GpuError, GpuModel};
use spinfer_kernels_cuda::CudaError;
use spinfer_tests::{data, reference, smollm2};

fn gpu_model(ctx: usize) -> Option<GpuModel> {
    let path = smollm2()?;
    let g = GgufFile::open(&path).expect("model opens");
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

fn cpu_engine(precision: Precision, ctx: usize) -> Engine {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(16));
    Engine::load(smollm2().expect("model"), ModelOptions { precision, ctx, threads, sparsity: None })
        .expect("cpu engine")
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn argmax(x: &[f32]) -> u32 {
    x.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as u32)
}

/// Last-position logits within the fast mode's bound of PyTorch's (0.3)
/// and of the CPU engine's precise mode; the same top token everywhere.
#[test]
fn logits_match_pytorch_and_the_cpu_engine() {
    let Some(m) = gpu_model(512) else { return };
    eprintln!("device: {}", m.backend().device());
    let cpu = cpu_engine(Precision::Precise, 512);
    for (i, p) in reference().prompts.iter().enumerate() {
        let mut s = m.new_session().unwrap();
        let got = m.forward_last(&mut s, &p.input_ids).unwrap();
        let want = p.last_logits();
        let mut cs = cpu.new_session();
        let cpu_logits = cpu.model.forward_last(&mut cs, &p.input_ids).unwrap().to_vec();
        let (d_ref, d_cpu) = (max_abs_diff(&got, &want), max_abs_diff(&got, &cpu_logits));
        eprintln!("prompt {i}: max |gpu - pytorch| {d_ref:.4}, max |gpu - cpu precise| {d_cpu:.4}");
        assert_eq!(got.len(), want.len());
        assert!(d_ref <= 0.3 && d_cpu <= 0.3, "prompt {i}: {d_ref} / {d_cpu}");
        assert_eq!(argmax(&got), argmax(&want), "prompt {i}");
    }
}

/// Greedy continuations, one token per forward call (the decode path, a
/// replayed graph): identical to the CPU engine's (precise mode) on every
/// prompt, and reported against PyTorch's; each step's logits equal those
/// of the same step with every kernel launched (no graph).
#[test]
fn greedy_continuations_match_the_cpu_engine() {
    let Some(m) = gpu_model(512) else { return };
    let cpu = cpu_engine(Precision::Precise, 512);
    let mut same_as_ref = 0;
    let prompts = reference().prompts;
    for (i, p) in prompts.iter().enumerate() {
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
    eprintln!("{same_as_ref} of {} continuations identical to pytorch's", prompts.len());
}

/// WikiText-2 by the reference protocol (40 windows of 512 tokens, tokens
/// 2..512 of each scored): within 1% of PyTorch's perplexity.
#[test]
fn wikitext2_perplexity_within_one_percent() {
    let Some(m) = gpu_model(512) else { return };
    let cpu = cpu_engine(Precision::Precise, 512);
    let text = std::fs::read_to_string(data("wikitext-2-raw/wiki.test.raw")).unwrap().replace("\r\n", "\n");
    let tokens = cpu.tokenizer.encode(&text, false).unwrap();
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
    let ppl = (nll / scored as f64).exp();
    let want = reference().wikitext2_ppl["ppl"].as_f64().unwrap();
    eprintln!("gpu ppl {ppl:.4} (reference {want:.4}, {:+.3}%)", (ppl / want - 1.0) * 100.0);
    assert!((ppl / want - 1.0).abs() <= 0.01, "gpu ppl {ppl} vs {want}");
}
