//! The sparse down projection on SmolLM2-135M's shape (`W_down` Q4_1,
//! 576 x 1536), 2 threads, 70% of the neurons kept: the dense matvec
//! against the neuron-major AXPYs (exact f32 and int8 coefficients), with
//! the outputs split over the threads inside one copy (the built-in
//! layout before session 8) or with one copy per thread of its own
//! outputs (`NeuronMajorSplit`, the layout now; also how a pack's
//! `GATHERED_COLUMN_AXPY` runs), and with the skipped neurons in whole
//! 32-neuron blocks (block-structured sparsity, not built). 64 matrices
//! are cycled, 35 MB against a 32 MB L3, so the weights stream from memory
//! as in decode.
//!
//! `cargo bench -p spinfer-sparse-kernels --bench sparse_down`

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, MatmulCall, MatmulDesc};
use spinfer_kernels::matmul::candidates;
use spinfer_kernels::pool::ThreadPool;
use spinfer_sparse_kernels::{NeuronMajor, NeuronMajorSplit};

const DIM: usize = 576;
const FFN: usize = 1536;
const COPIES: usize = 64;
const THREADS: usize = 2;

#[path = "../../kernels/benches/support/mod.rs"]
mod support;

fn bench(c: &mut Criterion) {
    let pool = ThreadPool::new(THREADS);
    let ws: Vec<Vec<u8>> = (0..COPIES as u64).map(|seed| support::q4_1(DIM, FFN, seed)).collect();
    // 70% kept, spread as the predictors spread them.
    let idx: Vec<u32> = (0..FFN as u32).filter(|j| (j * 2654435761u32) % 10 < 7).collect();
    let coef: Vec<f32> = idx.iter().map(|&j| ((j * 7919 % 2003) as f32 - 1001.0) * 1e-3).collect();
    let mut dense_x = vec![0.0f32; FFN];
    for (&j, &c) in idx.iter().zip(&coef) {
        dense_x[j as usize] = c;
    }
    let whole: Vec<NeuronMajor> =
        ws.iter().map(|w| NeuronMajor::from_weights(GgmlType::Q4_1, w, DIM, FFN).unwrap()).collect();
    let split: Vec<NeuronMajorSplit> =
        ws.iter().map(|w| NeuronMajorSplit::from_weights(GgmlType::Q4_1, w, DIM, FFN, THREADS).unwrap()).collect();
    let mut out = vec![0.0f32; DIM];
    let coef_all: Vec<f32> = (0..FFN).map(|i| (i as f32 * 0.1).sin()).collect();

    let mut g = c.benchmark_group(format!("sparse_down/t{THREADS}/{COPIES}x576x1536 q4_1, 70% kept"));
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(3));
    g.sample_size(20);
    let desc = MatmulDesc::dense(GgmlType::Q4_1, ActType::Q8_1, DIM, FFN);
    let dense = candidates(&desc, &CpuFeatures::detect()).remove(0);
    let mut scratch = Vec::new();
    g.bench_function(format!("dense matvec [{}]", dense.name()), |b| {
        b.iter(|| {
            for w in &ws {
                dense.run(&pool, MatmulCall::dense(black_box(w), &dense_x, 1, &mut out, &mut scratch)).unwrap();
            }
        })
    });
    g.bench_function("axpy exact, outputs split in one copy", |b| {
        b.iter(|| {
            for nm in &whole {
                nm.axpy(&pool, black_box(&idx), &coef, &mut out).unwrap();
            }
        })
    });
    g.bench_function("axpy int8, outputs split in one copy", |b| {
        b.iter(|| {
            for nm in &whole {
                nm.axpy_fast(&pool, black_box(&idx), &coef, &mut out).unwrap();
            }
        })
    });
    g.bench_function("axpy exact, a copy per thread (NeuronMajorSplit)", |b| {
        b.iter(|| {
            for nm in &split {
                nm.axpy(&pool, black_box(&idx), &coef, &mut out).unwrap();
            }
        })
    });
    g.bench_function("axpy int8, a copy per thread (NeuronMajorSplit)", |b| {
        b.iter(|| {
            for nm in &split {
                nm.axpy_fast(&pool, black_box(&idx), &coef, &mut out).unwrap();
            }
        })
    });
    // The same fractions with whole 32-neuron blocks skipped (what
    // block-structured sparsity would give: skipped codes and scales are
    // contiguous).
    for (label, keep) in [("70% kept in whole blocks", 70), ("50% kept in whole blocks", 50)] {
        let idx: Vec<u32> =
            (0..FFN as u32).filter(|j| ((j / 32).wrapping_mul(2654435761u32) >> 7) % 100 < keep).collect();
        let coef = &coef_all[..idx.len()];
        g.bench_function(format!("axpy int8, a copy per thread (NeuronMajorSplit), {label}"), |b| {
            b.iter(|| {
                for nm in &split {
                    nm.axpy_fast(&pool, black_box(&idx), coef, &mut out).unwrap();
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
