//! Interleaved rounds of the sparse down projection against the dense
//! matvec on SmolLM2-135M's shape (`W_down` Q4_1, 576 x 1536), 64 copies
//! streamed from memory (35 MB against a 32 MB L3), as in decode. Each
//! round times every variant once, in rotated order; the report is each
//! variant's median time relative to the dense matvec of the same round,
//! which is what survives this VM's minute-to-minute noise better than
//! criterion's separate runs.
//!
//! `cargo run --release -p spinfer-sparse-kernels --example down_rounds -- [ROUNDS] [THREADS] [COPIES]`
//! (COPIES 2: the weights stay in L2, which shows the kernels' arithmetic).
//! With `ONE_COPY=1` the AXPYs run on one `NeuronMajor` of all outputs
//! instead of a copy per thread.

use std::hint::black_box;
use std::time::Instant;

use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, MatmulCall, MatmulDesc};
use spinfer_kernels::matmul::candidates;
use spinfer_kernels::pool::ThreadPool;
use spinfer_sparse_kernels::{NeuronMajor, NeuronMajorSplit};

const DIM: usize = 576;
const FFN: usize = 1536;
const COPIES: usize = 64;

#[path = "../../kernels/benches/support/mod.rs"]
mod support;

/// The kept neurons: `keep`% of them, at random or in whole 32-neuron
/// blocks.
fn kept(keep: u32, blocks: bool) -> Vec<u32> {
    (0..FFN as u32)
        .filter(|&j| {
            let key = if blocks { (j / 32).wrapping_mul(2654435761) >> 7 } else { j.wrapping_mul(2654435761) >> 7 };
            key % 100 < keep
        })
        .collect()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().map_or(30, |a| a.parse().expect("ROUNDS: a number"));
    let threads: usize = args.next().map_or(2, |a| a.parse().expect("THREADS: a number"));
    let pool = ThreadPool::new(threads);
    let copies: usize = args.next().map_or(COPIES, |a| a.parse().expect("COPIES: a number"));
    let ws: Vec<Vec<u8>> = (0..copies as u64).map(|seed| support::q4_1(DIM, FFN, seed)).collect();
    let split: Vec<NeuronMajorSplit> =
        ws.iter().map(|w| NeuronMajorSplit::from_weights(GgmlType::Q4_1, w, DIM, FFN, threads).unwrap()).collect();
    let whole: Vec<NeuronMajor> =
        ws.iter().map(|w| NeuronMajor::from_weights(GgmlType::Q4_1, w, DIM, FFN).unwrap()).collect();
    let one_copy = std::env::var_os("ONE_COPY").is_some();
    let coef_all: Vec<f32> = (0..FFN).map(|i| (i as f32 * 0.1).sin()).collect();
    let desc = MatmulDesc::dense(GgmlType::Q4_1, ActType::Q8_1, DIM, FFN);
    let dense = candidates(&desc, &CpuFeatures::detect()).remove(0);

    let sets: Vec<(String, Vec<u32>)> = vec![
        ("all".into(), (0..FFN as u32).collect()),
        ("70% at random".into(), kept(70, false)),
        ("70% in blocks".into(), kept(70, true)),
        ("50% at random".into(), kept(50, false)),
        ("50% in blocks".into(), kept(50, true)),
    ];
    let mut out = vec![0.0f32; DIM];
    let mut scratch = Vec::new();
    let x: Vec<f32> = coef_all.clone();
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    // Variant 0 is the dense matvec; then one int8 AXPY per set.
    let n = 1 + sets.len();
    let mut ratios = vec![Vec::new(); n];
    let mut dense_ms = Vec::new();
    for round in 0..rounds + 1 {
        let mut t = vec![0.0; n];
        for k in 0..n {
            let v = (k + round) % n;
            t[v] = if v == 0 {
                time(&mut || {
                    for w in &ws {
                        dense.run(&pool, MatmulCall::dense(black_box(w), &x, 1, &mut out, &mut scratch)).unwrap();
                    }
                })
            } else {
                let idx = &sets[v - 1].1;
                let coef = &coef_all[..idx.len()];
                time(&mut || {
                    if one_copy {
                        for nm in &whole {
                            nm.axpy_fast(&pool, black_box(idx), coef, &mut out).unwrap();
                        }
                    } else {
                        for nm in &split {
                            nm.axpy_fast(&pool, black_box(idx), coef, &mut out).unwrap();
                        }
                    }
                })
            };
        }
        // Round 0 warms up.
        if round > 0 {
            dense_ms.push(t[0] * 1e3);
            for v in 0..n {
                ratios[v].push(t[v] / t[0]);
            }
        }
    }
    println!(
        "{rounds} rounds, {threads} threads, {copies} x {DIM}x{FFN} Q4_1; dense [{}] median {:.3} ms per {copies} matrices",
        dense.name(),
        median(&mut dense_ms)
    );
    for (v, (label, idx)) in sets.iter().enumerate() {
        println!("int8 axpy, {label:>14} ({:4} kept): {:.3} x dense", idx.len(), median(&mut ratios[v + 1]));
    }
}
