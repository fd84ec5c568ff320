//! Decode speed of the hybrid CPU/GPU split (PowerInfer's) against the
//! CPU engine alone and the full offload, on one machine, interleaved:
//! tg128 (128 single-token forwards, logits copied to the host) and pp512,
//! medians of `--reps` runs after a warm-up. The hot FFN neuron groups are
//! chosen from the sidecar's calibrated activation frequencies within a
//! budget of 25% and 50% of the FFN's bytes.
//!
//! `cargo run --release -p spinfer-gpu --features cuda --example hybrid_bench --
//! MODEL.gguf SIDECAR.spinfer [--reps 5] [--threads N]`

use std::time::Instant;

use spinfer_engine::Engine;
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_engine::sparse::Sidecar;
use spinfer_gpu::placement::plan;
use spinfer_gpu::{GpuModel, ffn_bytes, ffn_costs};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn argmax(x: &[f32]) -> u32 {
    x.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as u32)
}

/// One way of running the model: tg128 and pp512 in tokens/s.
trait Runner {
    fn tg128(&mut self) -> Res<f64>;
    fn pp512(&mut self, prompt: &[u32]) -> Res<f64>;
}

struct Gpu<'a>(&'a GpuModel, spinfer_gpu::GpuSession);

impl Runner for Gpu<'_> {
    fn tg128(&mut self) -> Res<f64> {
        self.1.reset();
        let t0 = Instant::now();
        let mut tok = 1u32;
        for _ in 0..128 {
            tok = argmax(&self.0.forward_last(&mut self.1, &[tok])?);
        }
        Ok(128.0 / t0.elapsed().as_secs_f64())
    }

    fn pp512(&mut self, prompt: &[u32]) -> Res<f64> {
        self.1.reset();
        let t0 = Instant::now();
        self.0.forward(&mut self.1, prompt)?;
        self.0.backend().synchronize()?;
        Ok(prompt.len() as f64 / t0.elapsed().as_secs_f64())
    }
}

struct Cpu<'a>(&'a Engine, spinfer_engine::model::Session);

impl Runner for Cpu<'_> {
    fn tg128(&mut self) -> Res<f64> {
        self.1 = self.0.new_session();
        let t0 = Instant::now();
        let mut tok = 1u32;
        for _ in 0..128 {
            tok = argmax(self.0.model.forward_last(&mut self.1, &[tok])?);
        }
        Ok(128.0 / t0.elapsed().as_secs_f64())
    }

    fn pp512(&mut self, prompt: &[u32]) -> Res<f64> {
        self.1 = self.0.new_session();
        let t0 = Instant::now();
        self.0.model.forward_last(&mut self.1, prompt)?;
        Ok(prompt.len() as f64 / t0.elapsed().as_secs_f64())
    }
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: hybrid_bench MODEL.gguf SIDECAR.spinfer [--reps N] [--threads N]";
    let (path, sidecar) = (args.first().ok_or(usage)?, args.get(1).ok_or(usage)?);
    let opt = |name: &str, default: usize| -> Res<usize> {
        Ok(args.iter().skip_while(|a| *a != name).nth(1).map_or(Ok(default), |v| v.parse())?)
    };
    let reps = opt("--reps", 5)?;
    let threads = opt("--threads", std::thread::available_parallelism().map_or(4, |n| n.get()))?;
    let g = GgufFile::open(path)?;
    let side = Sidecar::read(std::path::Path::new(sidecar))?;
    let freq: Vec<Vec<f32>> = side.layers.iter().map(|l| l.active_freq.clone()).collect();

    let full = GpuModel::load(&g, 1024)?;
    let c = full.config.clone();
    let (costs, total) = (ffn_costs(&g, &c)?, ffn_bytes(&g, &c)?);
    let mut hybrids = Vec::new();
    for fraction in [0.25, 0.5] {
        let p = plan(&freq, &costs, c.ffn_dim, (total as f64 * fraction) as usize)?;
        let m = GpuModel::load_hybrid(&g, 1024, &p, threads)?;
        let (cpu_bytes, transfer) = m.cpu_split();
        let hot = p.hot_fraction(&costs, c.ffn_dim);
        let line = format!(
            "hybrid {:.0}% of FFN bytes on the gpu ({:.1}% of neurons, {:.1} MB), {:.1} MB on the cpu, {transfer} B/token copied",
            fraction * 100.0,
            hot * 100.0,
            p.bytes as f64 / 1e6,
            cpu_bytes as f64 / 1e6
        );
        hybrids.push((line, m));
    }
    let options = |precision| ModelOptions { precision, ctx: 1024, threads, ..ModelOptions::default() };
    let precise = Engine::load(path, options(Precision::Precise))?;
    let fast = Engine::load(path, options(Precision::Fast))?;

    let mut names = vec![
        format!("cpu only, precise ({threads} threads)"),
        format!("cpu only, fast ({threads} threads)"),
        "gpu full offload (graph)".to_string(),
        "gpu full offload (no graph)".to_string(),
    ];
    let mut runners: Vec<Box<dyn Runner>> = vec![
        Box::new(Cpu(&precise, precise.new_session())),
        Box::new(Cpu(&fast, fast.new_session())),
        Box::new(Gpu(&full, full.new_session()?)),
        Box::new(Gpu(&full, {
            let mut s = full.new_session()?;
            s.set_graphs(false);
            s
        })),
    ];
    for (line, m) in &hybrids {
        names.push(line.clone());
        runners.push(Box::new(Gpu(m, m.new_session()?)));
    }
    let vocab = c.vocab_size as u32;
    let prompt: Vec<u32> = (0..512u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut tg = vec![Vec::new(); runners.len()];
    let mut pp = vec![Vec::new(); runners.len()];
    for rep in 0..=reps {
        for (i, r) in runners.iter_mut().enumerate() {
            let (t, p) = (r.tg128()?, r.pp512(&prompt)?);
            if rep > 0 {
                tg[i].push(t);
                pp[i].push(p);
            }
        }
    }
    println!("device: {}, model: {path}, FFN {:.1} MB", full.backend().device(), total as f64 / 1e6);
    println!("{:<110} {:>10} {:>10}", "run", "tg128", "pp512");
    for (i, name) in names.iter().enumerate() {
        println!("{name:<110} {:>10.1} {:>10.1}", median(tg[i].clone()), median(pp[i].clone()));
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
