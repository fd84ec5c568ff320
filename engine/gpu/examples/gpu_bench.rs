//! Prefill and decode speed of a model fully on the GPU, as llama-bench
//! measures them: pp512 (one forward of 512 tokens from an empty cache) and
//! tg128 (128 single-token forwards from an empty cache, each with its
//! logits copied to the host, the next token drawn at random as
//! llama-bench does), median of `--reps` runs after a warm-up. Decode is
//! also measured greedy (the host picks each step's token from the logits
//! with the sampler `spinfer generate --temp 0` uses, or the device picks
//! it and only the token comes back, what `generate --device cuda --temp 0`
//! does), with the graph of the unfused steps, and with every kernel
//! launched from the host. With `--head-index FILE` (from `spinfer
//! calibrate-head`), tg128 and greedy decode are measured again through the
//! sparse output head, interleaved with the dense runs.
//!
//! `--profile N` instead runs a 64-token prompt and then N decode steps
//! kernel by kernel, and prints where the decode kernels start in the launch
//! count (for a profiler's `--launch-skip`) and how many each step launches.
//!
//! `cargo run --release -p spinfer-gpu --features cuda --example gpu_bench --
//! MODEL.gguf [--reps 5] [--json] [--profile N] [--head-index FILE [--head-probes N]]`

use std::time::Instant;

use spinfer_engine::gguf::GgufFile;
use spinfer_engine::head::HeadIndex;
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

/// How a decode step's next token is chosen.
#[derive(Clone, Copy)]
enum Pick {
    /// Pseudo-random, after the logits are copied to the host (llama-bench).
    Random,
    /// By the sampler of `generate --temp 0`, from the logits on the host.
    HostGreedy,
    /// On the device; only the token comes back.
    DeviceGreedy,
}

/// 128 decode steps from an empty cache, each token chosen by `pick`; tok/s.
fn decode(m: &GpuModel, s: &mut GpuSession, pick: Pick) -> Res<f64> {
    s.reset();
    let vocab = m.config.vocab_size as u64;
    let mut sampler = Sampler::new(SamplerParams::greedy())?;
    let t0 = Instant::now();
    let (mut tok, mut rng) = (1u32, 0x9e37_79b9_7f4a_7c15u64);
    for _ in 0..128 {
        m.forward(s, &[tok])?;
        rng = rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        tok = match pick {
            Pick::Random => {
                m.row_logits(s, 0)?;
                ((rng >> 33) % vocab) as u32
            }
            Pick::HostGreedy => sampler.sample(m.row_logits(s, 0)?, &[], 0),
            Pick::DeviceGreedy => m.greedy_token(s, 0)?,
        };
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
    let mut m = GpuModel::load(&g, 1024)?;
    if args.iter().any(|a| a == "--profile") {
        return profile(&m, arg(&args, "--profile", 4)?);
    }
    let head_index: Option<String> = args.iter().skip_while(|a| *a != "--head-index").nth(1).cloned();
    let head_model = head_index.as_ref().map(|_| GpuModel::head_model(&g)).transpose()?;
    let vocab = m.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..512u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let names =
        ["tg128", "greedy (host)", "greedy (device)", "no graph", "unfused", "sparse head", "greedy, sparse head"];
    let mut tg: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    let (mut pp, mut head_rows) = (Vec::new(), 0.0);
    // Sessions (and their captured graphs) kept across the reps.
    let mut s = m.new_session()?;
    let mut plain = m.new_session()?;
    plain.set_graphs(false);
    let mut unfused = m.new_session()?;
    unfused.set_fused(false);
    let mut hs = m.new_session()?;
    for rep in 0..=reps {
        // pp512
        s.reset();
        m.backend().synchronize()?;
        let t0 = Instant::now();
        m.forward(&mut s, &prompt)?;
        m.backend().synchronize()?;
        let pp_tok_s = 512.0 / t0.elapsed().as_secs_f64();
        // tg128: the ways interleaved, the sparse head's last.
        let mut t = vec![
            decode(&m, &mut s, Pick::Random)?,
            decode(&m, &mut s, Pick::HostGreedy)?,
            decode(&m, &mut s, Pick::DeviceGreedy)?,
            decode(&m, &mut plain, Pick::Random)?,
            decode(&m, &mut unfused, Pick::Random)?,
        ];
        if let (Some(file), Some(want)) = (&head_index, &head_model) {
            let index = HeadIndex::load(std::path::Path::new(file), want)?;
            let probes = arg(&args, "--head-probes", index.default_probes())?;
            m.set_sparse_head(Some(index), probes)?;
            t.push(decode(&m, &mut hs, Pick::Random)?);
            t.push(decode(&m, &mut hs, Pick::DeviceGreedy)?);
            let st = hs.head_stats();
            head_rows = st.rows as f64 / st.tokens.max(1) as f64;
            m.set_sparse_head(None, 1)?;
        }
        if rep > 0 {
            pp.push(pp_tok_s);
            t.into_iter().zip(&mut tg).for_each(|(v, all)| all.push(v));
        }
    }
    // Launches per decode step with every kernel launched from the host.
    let before = m.backend().launches();
    m.forward(&mut plain, &[1])?;
    let per_step = m.backend().launches() - before;
    let pp = median(pp);
    let tg: Vec<Option<f64>> = tg.into_iter().map(|v| (!v.is_empty()).then(|| median(v))).collect();
    let name = &m.backend().device().name;
    if json {
        let keys = ["tg128", "tg128_greedy", "tg128_greedy_device", "tg128_no_graph", "tg128_unfused"];
        let keys = keys.iter().chain(&["tg128_sparse_head", "tg128_greedy_sparse_head"]);
        let fields: Vec<String> =
            keys.zip(&tg).filter_map(|(k, v)| v.map(|v| format!("\"{k}_tok_s\":{v:.1}"))).collect();
        println!(
            "{{\"device\":\"{name}\",\"model\":\"{path}\",\"pp512_tok_s\":{pp:.1},{},\"head_rows_per_token\":{head_rows:.0},\"launches_per_step\":{per_step}}}",
            fields.join(",")
        );
    } else {
        println!("device: {}", m.backend().device());
        println!("model: {path} ({:.1} MB of weights on the device)", m.weight_bytes() as f64 / 1e6);
        println!("pp512                       {pp:10.1} tok/s");
        for (n, v) in names.iter().zip(&tg) {
            if let Some(v) = v {
                println!("tg128 {n:22}{v:10.1} tok/s");
            }
        }
        if head_index.is_some() {
            println!("sparse head: {head_rows:.0} rows of {vocab} computed per token");
        }
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
