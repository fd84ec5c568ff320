//! Prefill and decode speed of a model fully on the GPU, as llama-bench
//! measures them: pp512 (one forward of 512 tokens from an empty cache) and
//! tg128 (128 single-token forwards, each with its logits copied to the
//! host), median of `--reps` runs after a warm-up. Decode is measured with
//! the captured graph and fused steps (the default), with the graph of the
//! unfused steps, and with every kernel launched.
//!
//! `cargo run --release -p spinfer-gpu --features cuda --example gpu_bench --
//! MODEL.gguf [--reps 5] [--json]`

use std::time::Instant;

use spinfer_engine::gguf::GgufFile;
use spinfer_gpu::GpuModel;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args.first().ok_or("usage: gpu_bench MODEL.gguf [--reps N] [--json]")?;
    let reps: usize = args.iter().skip_while(|a| *a != "--reps").nth(1).map_or(Ok(5), |v| v.parse())?;
    let json = args.iter().any(|a| a == "--json");
    let g = GgufFile::open(path)?;
    let m = GpuModel::load(&g, 1024)?;
    let vocab = m.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..512u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut s = m.new_session()?;
    let mut plain = m.new_session()?;
    plain.set_graphs(false);
    let mut unfused = m.new_session()?;
    unfused.set_fused(false);
    let (mut pp, mut tg, mut tg_plain, mut tg_unfused) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let decode = |s: &mut spinfer_gpu::GpuSession| -> Result<f64, Box<dyn std::error::Error>> {
        s.reset();
        let t0 = Instant::now();
        let mut tok = 1u32;
        for _ in 0..128 {
            let logits = m.forward_last(s, &[tok])?;
            tok = logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as u32);
        }
        Ok(128.0 / t0.elapsed().as_secs_f64())
    };
    for rep in 0..=reps {
        // pp512
        s.reset();
        m.backend().synchronize()?;
        let t0 = Instant::now();
        m.forward(&mut s, &prompt)?;
        m.backend().synchronize()?;
        let pp_tok_s = 512.0 / t0.elapsed().as_secs_f64();
        // tg128: the three ways interleaved
        let (g, p, u) = (decode(&mut s)?, decode(&mut plain)?, decode(&mut unfused)?);
        if rep > 0 {
            pp.push(pp_tok_s);
            tg.push(g);
            tg_plain.push(p);
            tg_unfused.push(u);
        }
    }
    let (pp, tg, tg_plain, tg_unfused) = (median(pp), median(tg), median(tg_plain), median(tg_unfused));
    let name = &m.backend().device().name;
    if json {
        println!(
            "{{\"device\":\"{name}\",\"model\":\"{path}\",\"pp512_tok_s\":{pp:.1},\"tg128_tok_s\":{tg:.1},\"tg128_no_graph_tok_s\":{tg_plain:.1},\"tg128_unfused_tok_s\":{tg_unfused:.1}}}"
        );
    } else {
        println!("device: {}", m.backend().device());
        println!("model: {path} ({:.1} MB of weights on the device)", m.weight_bytes() as f64 / 1e6);
        println!("pp512            {pp:10.1} tok/s");
        println!("tg128            {tg:10.1} tok/s");
        println!("tg128 (no graph) {tg_plain:10.1} tok/s");
        println!("tg128 (unfused)  {tg_unfused:10.1} tok/s");
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
