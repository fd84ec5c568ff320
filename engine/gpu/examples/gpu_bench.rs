//! Prefill and decode speed of a model fully on the GPU, as llama-bench
//! measures them: pp512 (one forward of 512 tokens from an empty cache) and
//! tg128 (128 single-token forwards from an empty cache, each with its
//! logits copied to the host, the next token drawn at random as
//! llama-bench does), median of `--reps` runs after a warm-up. Decode is
//! also measured greedy (the host picks each step's token with the sampler
//! `spinfer generate --temp 0` uses), with the graph of the unfused steps,
//! and with every kernel launched from the host.
//!
//! `--profile N` instead runs a 64-token prompt and then N decode steps
//! kernel by kernel, and prints where the decode kernels start in the launch
//! count (for a profiler's `--launch-skip`) and how many each step launches.
//!
//! `cargo run --release -p spinfer-gpu --features cuda --example gpu_bench --
//! MODEL.gguf [--reps 5] [--json] [--profile N]`

use std::time::Instant;

use spinfer_engine::gguf::GgufFile;
use spinfer_engine::sampling::{Sampler, SamplerParams};
use spinfer_gpu::{GpuModel, GpuSession};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> Res<T>
where
    T::Err: std::error::Error + 'static,
{
    Ok(args.iter().skip_while(|a| *a != name).nth(1).map_or(Ok(default), |v| v.parse())?)
}

/// 128 decode steps from an empty cache; tok/s. `greedy`: the next token is
/// the one `generate --temp 0`'s sampler picks from the logits, else a
/// pseudo-random one (llama-bench).
fn decode(m: &GpuModel, s: &mut GpuSession, greedy: bool) -> Res<f64> {
    s.reset();
    let vocab = m.config.vocab_size as u64;
    let mut sampler = Sampler::new(SamplerParams::greedy())?;
    let t0 = Instant::now();
    let (mut tok, mut rng) = (1u32, 0x9e37_79b9_7f4a_7c15u64);
    for _ in 0..128 {
        m.forward(s, &[tok])?;
        let logits = m.row_logits(s, 0)?;
        rng = rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        tok = if greedy { sampler.sample(logits, &[]) } else { ((rng >> 33) % vocab) as u32 };
    }
    Ok(128.0 / t0.elapsed().as_secs_f64())
}

fn profile(m: &GpuModel, steps: usize) -> Res<()> {
    let vocab = m.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..64u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut s = m.new_session()?;
    s.set_graphs(false);
    m.forward(&mut s, &prompt)?;
    m.row_logits(&mut s, 63)?;
    let first = m.backend().launches();
    for i in 0..steps {
        m.forward(&mut s, &[(i as u32 * 31 + 7) % vocab])?;
        m.row_logits(&mut s, 0)?;
    }
    let per_step = (m.backend().launches() - first) / steps.max(1) as u64;
    println!("profile: decode launches from {first}, {per_step} per step, {steps} steps");
    Ok(())
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args.first().ok_or("usage: gpu_bench MODEL.gguf [--reps N] [--json] [--profile N]")?;
    let reps: usize = arg(&args, "--reps", 5)?;
    let json = args.iter().any(|a| a == "--json");
    let g = GgufFile::open(path)?;
    let m = GpuModel::load(&g, 1024)?;
    if args.iter().any(|a| a == "--profile") {
        return profile(&m, arg(&args, "--profile", 4)?);
    }
    let vocab = m.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..512u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut s = m.new_session()?;
    let mut plain = m.new_session()?;
    plain.set_graphs(false);
    let mut unfused = m.new_session()?;
    unfused.set_fused(false);
    let (mut pp, mut tg, mut tg_greedy, mut tg_plain, mut tg_unfused) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for rep in 0..=reps {
        // pp512
        s.reset();
        m.backend().synchronize()?;
        let t0 = Instant::now();
        m.forward(&mut s, &prompt)?;
        m.backend().synchronize()?;
        let pp_tok_s = 512.0 / t0.elapsed().as_secs_f64();
        // tg128: the four ways interleaved
        let (t, gr) = (decode(&m, &mut s, false)?, decode(&m, &mut s, true)?);
        let (p, u) = (decode(&m, &mut plain, false)?, decode(&m, &mut unfused, false)?);
        if rep > 0 {
            pp.push(pp_tok_s);
            tg.push(t);
            tg_greedy.push(gr);
            tg_plain.push(p);
            tg_unfused.push(u);
        }
    }
    // Launches per decode step with every kernel launched from the host.
    let before = m.backend().launches();
    m.forward(&mut plain, &[1])?;
    let per_step = m.backend().launches() - before;
    let (pp, tg, tg_greedy) = (median(pp), median(tg), median(tg_greedy));
    let (tg_plain, tg_unfused) = (median(tg_plain), median(tg_unfused));
    let name = &m.backend().device().name;
    if json {
        println!(
            "{{\"device\":\"{name}\",\"model\":\"{path}\",\"pp512_tok_s\":{pp:.1},\"tg128_tok_s\":{tg:.1},\"tg128_greedy_tok_s\":{tg_greedy:.1},\"tg128_no_graph_tok_s\":{tg_plain:.1},\"tg128_unfused_tok_s\":{tg_unfused:.1},\"launches_per_step\":{per_step}}}"
        );
    } else {
        println!("device: {}", m.backend().device());
        println!("model: {path} ({:.1} MB of weights on the device)", m.weight_bytes() as f64 / 1e6);
        println!("pp512            {pp:10.1} tok/s");
        println!("tg128            {tg:10.1} tok/s");
        println!("tg128 (greedy)   {tg_greedy:10.1} tok/s");
        println!("tg128 (no graph) {tg_plain:10.1} tok/s");
        println!("tg128 (unfused)  {tg_unfused:10.1} tok/s");
        println!("launches per decode step: {per_step}");
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
