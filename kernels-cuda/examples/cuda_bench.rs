//! Kernel benchmarks on a CUDA device, timed with device events (median of
//! repeated runs after a warm-up):
//!
//! 1. the bandwidth ceiling (a device-to-device copy, bytes read + written);
//! 2. dense GEMV per format (1 and 8 tokens; f32/f16/bf16 activations for
//!    Q4_0), as weight bytes per second against that ceiling;
//! 3. sparse: gathered-row GEMV (gate/up) and gathered-row AXPY on the
//!    neuron-major down projection at 10..90% kept neurons, each against the
//!    dense GEMV of the same matrix;
//! 4. ternary (TQ1_0, TQ2_0, I2_S) against Q4_0 of the same shape.
//!
//! `cargo run --release -p spinfer-kernels-cuda --features cuda --example
//! cuda_bench [-- --json FILE]`. Without a device it says why and exits 1.

use std::fmt::Write as _;

use spinfer_kernels_cuda::{
    ActType, CudaBackend, DeviceMatrix, Result, WeightFormat, synthetic_acts, synthetic_matrix,
};

const WARMUP: usize = 10;
const ITERS: usize = 50;
const REPEATS: usize = 5;

/// Median over `REPEATS` of the mean time per call in microseconds.
fn time_us(be: &CudaBackend, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut v = Vec::new();
    for _ in 0..REPEATS {
        v.push(be.time_ms(WARMUP, ITERS, &mut f)? * 1e3);
    }
    v.sort_by(f64::total_cmp);
    Ok(v[REPEATS / 2])
}

struct Report {
    text: String,
    json: Vec<String>,
}

impl Report {
    fn row(&mut self, group: &str, name: &str, us: f64, gbps: Option<f64>, ratio: Option<f64>) {
        let g = gbps.map_or(String::new(), |g| format!("{g:8.0} GB/s"));
        let r = ratio.map_or(String::new(), |r| format!("  x{r:.3}"));
        let _ = writeln!(self.text, "{group:<10} {name:<44} {us:10.2} us {g}{r}");
        self.json.push(format!(
            "{{\"group\":\"{group}\",\"name\":\"{name}\",\"us\":{us:.3},\"gbps\":{},\"ratio\":{}}}",
            gbps.map_or("null".into(), |g| format!("{g:.1}")),
            ratio.map_or("null".into(), |r| format!("{r:.4}"))
        ));
    }
}

fn matrix(be: &CudaBackend, f: WeightFormat, rows: usize, cols: usize) -> Result<(DeviceMatrix, usize)> {
    let bytes = synthetic_matrix(f, rows, cols, 42)?;
    Ok((be.upload_matrix(f, rows, cols, &bytes)?, bytes.len()))
}

/// `n` of `total` indices, spread out and sorted (as a predictor's kept set).
fn kept(total: usize, n: usize) -> Vec<u32> {
    let mut v: Vec<u32> = (0..total as u32).collect();
    // A fixed shuffle (multiplicative hashing), then the first n, sorted.
    v.sort_by_key(|&i| (u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 17);
    v.truncate(n);
    v.sort_unstable();
    v
}

fn run() -> Result<Report> {
    let be = CudaBackend::new()?;
    let mut rep = Report { text: format!("device: {}\n", be.device()), json: Vec::new() };

    // 1. Ceiling: copy 1 GiB (the buffers are freed at the block's end).
    {
        let n = 1 << 28;
        let src = be.alloc::<f32>(n)?;
        let mut dst = be.alloc::<f32>(n)?;
        let us = time_us(&be, || be.copy(&src, &mut dst))?;
        let ceiling = 2.0 * (n * 4) as f64 / us / 1e3;
        rep.row("ceiling", "dtod copy 1 GiB (read + write)", us, Some(ceiling), None);
    }

    // 2. Dense GEMV per format: 16384 x 8192 (Q4_0: 75 MB, past the L2).
    let (rows, cols) = (16384, 8192);
    let mut q4 = 0.0;
    for f in WeightFormat::ALL {
        let (m, bytes) = matrix(&be, f, rows, cols)?;
        for tokens in [1, 8] {
            let acts: &[ActType] = if f == WeightFormat::Q4_0 { &ActType::ALL } else { &[ActType::F32] };
            for &act in acts {
                let x = be.upload_acts(act, tokens, cols, &synthetic_acts(tokens * cols, 1))?;
                let mut y = be.alloc::<f32>(tokens * rows)?;
                let us = time_us(&be, || be.gemv(&m, &x, None, &mut y))?;
                if f == WeightFormat::Q4_0 && tokens == 1 && act == ActType::F32 {
                    q4 = us;
                }
                let gbps = bytes as f64 / us / 1e3;
                let ratio = (f.name().starts_with('t') || f == WeightFormat::I2_S).then(|| q4 / us);
                let name = format!("{f} {rows}x{cols} {} t={tokens}", act.name());
                rep.row("gemv", &name, us, Some(gbps), ratio.filter(|_| tokens == 1));
            }
        }
    }

    // 3. Sparse FFN shapes (Llama-8B-like: hidden 4096, ffn 14336).
    let (hidden, ffn) = (4096, 14336);
    for f in [WeightFormat::Q4_0, WeightFormat::Q4_K] {
        let (up, _) = matrix(&be, f, ffn, hidden)?; // gate/up: one row per neuron
        let (down, _) = matrix(&be, f, hidden, ffn)?; // down, model layout
        let (down_t, _) = matrix(&be, f, ffn, hidden)?; // down, neuron-major copy
        let x = be.upload_acts(ActType::F32, 1, hidden, &synthetic_acts(hidden, 3))?;
        let xf = be.upload_acts(ActType::F32, 1, ffn, &synthetic_acts(ffn, 4))?;
        let mut y_up = be.alloc::<f32>(ffn)?;
        let mut y_down = be.alloc::<f32>(hidden)?;
        let dense_up = time_us(&be, || be.gemv(&up, &x, None, &mut y_up))?;
        let dense_down = time_us(&be, || be.gemv(&down, &xf, None, &mut y_down))?;
        rep.row("sparse", &format!("{f} up dense {ffn}x{hidden}"), dense_up, None, Some(1.0));
        rep.row("sparse", &format!("{f} down dense {hidden}x{ffn}"), dense_down, None, Some(1.0));
        for pct in [10, 20, 30, 50, 70, 90] {
            let k = ffn * pct / 100;
            let idx = be.upload_rows(&kept(ffn, k), ffn)?;
            let us = time_us(&be, || be.gemv(&up, &x, Some(&idx), &mut y_up))?;
            rep.row("sparse", &format!("{f} up gathered rows {pct}%"), us, None, Some(dense_up / us));
            let a = be.upload(&synthetic_acts(k, 5))?;
            let us = time_us(&be, || be.axpy_rows(&down_t, &a, 1, &idx, &mut y_down))?;
            rep.row("sparse", &format!("{f} down gathered cols (axpy) {pct}%"), us, None, Some(dense_down / us));
        }
    }
    Ok(rep)
}

fn main() {
    let json_path = std::env::args().skip_while(|a| a != "--json").nth(1);
    match run() {
        Ok(rep) => {
            print!("{}", rep.text);
            if let Some(p) = json_path {
                let body = format!("[\n{}\n]\n", rep.json.join(",\n"));
                if let Err(e) = std::fs::write(&p, body) {
                    eprintln!("error: {p}: {e}");
                    std::process::exit(1);
                }
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
