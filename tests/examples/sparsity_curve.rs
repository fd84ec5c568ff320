//! The quality and speed curve of activation sparsity on SmolLM2 (issue 4's
//! must-shows 1, 2 and 6; results in docs/sparsity.md).
//!
//! ```sh
//! cargo run --release -p spinfer-tests --example sparsity_curve -- \
//!     models/SmolLM2-135M-Instruct.Q4_1.gguf [--levels 0.3,0.5] \
//!     [--predictors gate-threshold,top-k,input-magnitude] [--windows 40] [--threads 2] \
//!     [--attn 0.4] [--rounds 10]
//! ```
//!
//! `--attn S` also calibrates the attention output projection to skip a
//! fraction `S` of its inputs (TEAL on W_o) in every sparse configuration.
//!
//! For each target sparsity it calibrates once (WikiText-2 test after byte
//! 800,000, 8,192 tokens) and, per predictor, measures on the evaluation
//! text (the file's start, the reference protocol): WikiText-2 perplexity,
//! agreement with the PyTorch reference logits of the 6 prompts (top-1
//! matches, mean and max |Δlogit|), how many of the 6 greedy 24-token
//! continuations equal the dense engine's and the mean kept fraction; each
//! row is printed as soon as it is measured, dense first. Then decode speed
//! (128 tokens after prompt 0): per round, every configuration next to a
//! dense run (the order alternating), and the median over the rounds of the
//! pair's ratio: runs seconds apart share the machine's state, which on a
//! shared 2-vCPU VM drifts by 10-20% over minutes.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use spinfer_engine::Engine;
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_engine::perplexity::perplexity;
use spinfer_engine::sparse::calibrate::{CalibrateOptions, calibrate};
use spinfer_engine::sparse::{CalibrationInfo, PredictorKind, SparsityOptions};
use spinfer_tests::{data, reference, top_k};

struct Args {
    model: PathBuf,
    levels: Vec<f32>,
    predictors: Vec<PredictorKind>,
    windows: usize,
    threads: usize,
    attn: f32,
    rounds: usize,
}

fn parse_args() -> Result<Args> {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        model: PathBuf::new(),
        levels: vec![0.3, 0.4, 0.5, 0.6, 0.7],
        predictors: vec![PredictorKind::GateThreshold, PredictorKind::TopK, PredictorKind::InputMagnitude],
        windows: 40,
        threads: 2,
        attn: 0.0,
        rounds: 10,
    };
    while let Some(x) = it.next() {
        let mut val = || it.next().with_context(|| format!("{x} needs a value"));
        match x.as_str() {
            "--levels" => a.levels = val()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--predictors" => {
                a.predictors = val()?
                    .split(',')
                    .map(|p| PredictorKind::parse(p).with_context(|| format!("unknown predictor '{p}'")))
                    .collect::<Result<_>>()?
            }
            "--windows" => a.windows = val()?.parse()?,
            "--threads" => a.threads = val()?.parse()?,
            "--attn" => a.attn = val()?.parse()?,
            "--rounds" => a.rounds = val()?.parse()?,
            _ if a.model.as_os_str().is_empty() => a.model = PathBuf::from(x),
            _ => bail!("unexpected argument '{x}'"),
        }
    }
    if a.model.as_os_str().is_empty() {
        bail!(
            "usage: sparsity_curve MODEL [--levels L,..] [--predictors P,..] [--windows N] [--threads N] [--attn S] [--rounds N]"
        );
    }
    Ok(a)
}

fn wikitext() -> Result<String> {
    let bytes = std::fs::read(data("wikitext-2-raw/wiki.test.raw"))?;
    Ok(String::from_utf8(bytes)?.replace("\r\n", "\n"))
}

/// Greedy continuation of `prompt`, `n` tokens.
fn greedy(e: &Engine, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
    let mut s = e.new_session();
    let mut step = prompt.to_vec();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let next = top_k(e.model.forward_last(&mut s, &step)?, 1)[0];
        out.push(next);
        step = vec![next];
    }
    Ok(out)
}

/// Decode tokens/s: 128 greedy tokens after `prompt`.
fn decode_speed(e: &Engine, prompt: &[u32]) -> Result<f64> {
    let mut s = e.new_session();
    let mut next = top_k(e.model.forward_last(&mut s, prompt)?, 1)[0];
    let t = Instant::now();
    for _ in 0..128 {
        next = top_k(e.model.forward_last(&mut s, &[next])?, 1)[0];
    }
    Ok(128.0 / t.elapsed().as_secs_f64())
}

struct Row {
    ppl: f64,
    kept: f64,
    top1: usize,
    mean_dlogit: f64,
    max_dlogit: f32,
    same_greedy: usize,
}

fn measure(e: &Engine, text_tokens: &[u32], windows: usize, dense_greedy: &[Vec<u32>]) -> Result<Row> {
    let mut s = e.new_session();
    let p = perplexity(&e.model, &mut s, text_tokens, 512, Some(windows), &mut |_, _, _| {})?;
    let kept = if e.model.sparse.is_some() { s.sparsity_stats().mean_active_fraction() } else { 1.0 };
    let (mut top1, mut sum, mut count, mut max_d, mut same) = (0, 0.0f64, 0usize, 0.0f32, 0);
    for (p, want_greedy) in reference().prompts.iter().zip(dense_greedy) {
        let mut s = e.new_session();
        let got = e.model.forward_last(&mut s, &p.input_ids)?.to_vec();
        let want = p.last_logits();
        top1 += usize::from(top_k(&got, 1) == top_k(&want, 1));
        for (a, b) in got.iter().zip(&want) {
            let d = (a - b).abs();
            sum += f64::from(d);
            max_d = max_d.max(d);
        }
        count += want.len();
        same += usize::from(greedy(e, &p.input_ids, 24)? == *want_greedy);
    }
    Ok(Row { ppl: p.ppl, kept, top1, mean_dlogit: sum / count as f64, max_dlogit: max_d, same_greedy: same })
}

fn print_row(level: &str, predictor: &str, r: &Row, dense: Option<&Row>) {
    let dppl = dense.map_or("—".into(), |d| format!("{:+.2}%", 100.0 * (r.ppl / d.ppl - 1.0)));
    println!(
        "| {level} | {predictor} | {:.1}% | {:.4} | {dppl} | {}/6 | {:.3} | {:.2} | {}/6 |",
        100.0 * (1.0 - r.kept),
        r.ppl,
        r.top1,
        r.mean_dlogit,
        r.max_dlogit,
        r.same_greedy,
    );
}

fn main() -> Result<()> {
    let a = parse_args()?;
    let options = |sparsity| ModelOptions {
        precision: Precision::Fast,
        ctx: 512,
        threads: a.threads,
        sparsity,
        ..ModelOptions::default()
    };
    let dense = Engine::load(&a.model, options(None))?;
    let text = wikitext()?;
    let eval_tokens = dense.tokenizer.encode(&text, false)?;
    let mut calib_tokens = dense.tokenizer.encode(&text[800_000..], false)?;
    calib_tokens.truncate(8192);
    let dense_greedy: Vec<Vec<u32>> =
        reference().prompts.iter().map(|p| greedy(&dense, &p.input_ids, 24)).collect::<Result<_>>()?;

    println!(
        "| target | predictor | measured sparsity | ppl | Δppl | top-1 vs ref | mean |Δlogit| | max |Δlogit| | greedy = dense |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let d = measure(&dense, &eval_tokens, a.windows, &dense_greedy)?;
    print_row("0", "dense", &d, None);

    let dir = tempfile::tempdir()?;
    let loader = GgufFile::open(&a.model)?;
    let mut engines = vec![("dense".to_string(), Engine::load(&a.model, options(None))?)];
    for &level in &a.levels {
        let opts = CalibrateOptions {
            target_sparsity: level,
            predictor: PredictorKind::GateThreshold,
            window: 512,
            info: CalibrationInfo { text: "wiki.test.raw".into(), byte_offset: 800_000, tokens: 0 },
            rank: if a.predictors.contains(&PredictorKind::LowRank) { 64 } else { 0 },
            recall_target: 0.95,
            attn_sparsity: a.attn,
        };
        let sidecar = calibrate(&dense.model, &loader, &calib_tokens, &opts, &mut |_, _, _| {})?;
        let path = dir.path().join(format!("s{level}.spinfer"));
        sidecar.write(&path)?;
        for &predictor in &a.predictors {
            let mut so = SparsityOptions::new(&path);
            so.predictor = Some(predictor);
            let e = Engine::load(&a.model, options(Some(so)))?;
            let r = measure(&e, &eval_tokens, a.windows, &dense_greedy)?;
            let name = match a.attn {
                0.0 => predictor.name().to_string(),
                s => format!("{} + W_o {:.0}%", predictor.name(), 100.0 * s),
            };
            print_row(&format!("{:.0}%", 100.0 * level), &name, &r, Some(&d));
            engines.push((format!("{:.0}% {name}", 100.0 * level), e));
        }
    }

    // Decode speed: per round, each configuration paired with a dense run.
    let prompt = &reference().prompts[0].input_ids;
    let n = engines.len();
    let (mut speeds, mut ratios) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    for r in 0..a.rounds {
        for (i, ratio) in ratios.iter_mut().enumerate().skip(1) {
            let pair = if (r + i) % 2 == 0 { [0, i] } else { [i, 0] };
            let mut t = [0.0; 2];
            for (k, &e) in pair.iter().enumerate() {
                t[k] = decode_speed(&engines[e].1, prompt)?;
                speeds[e].push(t[k]);
            }
            let (dense_t, sparse_t) = if pair[0] == 0 { (t[0], t[1]) } else { (t[1], t[0]) };
            ratio.push(sparse_t / dense_t);
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "\n| configuration | decode tok/s ({} threads) | vs dense (median of {} paired rounds) | rounds faster than dense |",
        a.threads, a.rounds
    );
    println!("|---|---:|---:|---:|");
    for (i, (name, _)) in engines.iter().enumerate() {
        let t = med(&mut speeds[i]);
        if i == 0 {
            println!("| {name} | {t:.1} | 1.00× | |");
        } else {
            let faster = ratios[i].iter().filter(|&&x| x > 1.0).count();
            println!("| {name} | {t:.1} | {:.3}× | {faster}/{} |", med(&mut ratios[i]), a.rounds);
        }
    }
    Ok(())
}
