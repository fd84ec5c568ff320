//! Timing tables of the kernels, printed, not asserted (speed lives in
//! benchmarks, not tests): `cargo bench -p spinfer-sparse-kernels --bench timings`
//! runs them all, `-- NAME` one (sparse_ffn_timings, fast_axpy_timings,
//! streaming_axpy_timings, gathered_rows_timings, gemm_throughput,
//! ternary_speed). Numbers and what they showed: docs/benchmarks.md.

#[path = "../../kernels/tests/kernels_common/mod.rs"]
mod kernels_common;
#[path = "../tests/sparse_common/mod.rs"]
mod sparse_common;

use std::time::Instant;

use kernels_common::ternary::{TYPES as TERNARY_TYPES, kernels, name, weights};
use kernels_common::*;
use rand::Rng;
use sparse_common::isas;
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, MatmulCall, MatmulDesc, MatmulKernel, Select};
use spinfer_kernels::matmul::candidates;
use spinfer_kernels::pool::ThreadPool;
use spinfer_sparse_kernels::{AxpyIsa, NeuronMajor, axpy_rows_q8_0_with, gather_rows, transpose_to_q8_0};

/// The exact neuron-major types.
const NM_TYPES: [GgmlType; 3] = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0];

const TABLES: [(&str, fn()); 6] = [
    ("sparse_ffn_timings", sparse_ffn_timings),
    ("fast_axpy_timings", fast_axpy_timings),
    ("streaming_axpy_timings", streaming_axpy_timings),
    ("gathered_rows_timings", gathered_rows_timings),
    ("gemm_throughput", gemm_throughput),
    ("ternary_speed", ternary_speed),
];

fn main() {
    // `cargo bench` passes `--bench`; any other argument names a table.
    let wanted: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    for (name, table) in TABLES {
        if wanted.is_empty() || wanted.iter().any(|w| name.contains(w.as_str())) {
            println!("== {name}");
            table();
        }
    }
}

fn time_us(iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..iters / 10 + 1 {
        f();
    }
    // Best of 5 batches.
    (0..5)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_secs_f64() * 1e6 / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

/// `cargo bench -p spinfer-sparse-kernels --bench timings -- sparse_ffn_timings`
fn sparse_ffn_timings() {
    let mut r = rng(51);
    let (dim, ffn) = (576, 1536);
    let ty = GgmlType::Q4_1;
    let down = random_weights(&mut r, ty, dim, ffn);
    let up = random_weights(&mut r, ty, ffn, dim);
    let h = random_acts(&mut r, ffn);
    let x = random_acts(&mut r, dim);
    let t0 = Instant::now();
    let wt = transpose_to_q8_0(ty, &down, dim, ffn).unwrap();
    let transpose_ms = t0.elapsed().as_secs_f64() * 1e3;
    let features = CpuFeatures::detect();
    let isa = AxpyIsa::select(&features);
    println!(
        "cpu: {}; axpy isa {}; transpose_to_q8_0 {dim}x{ffn} {ty}: {transpose_ms:.2} ms",
        features.describe(),
        isa.name()
    );
    let t0 = Instant::now();
    let nm = NeuronMajor::from_weights(ty, &down, dim, ffn).unwrap();
    println!(
        "NeuronMajor::from_weights {dim}x{ffn} {ty}: {:.2} ms, {} KiB (q8_0 transpose {} KiB, {ty} {} KiB)",
        t0.elapsed().as_secs_f64() * 1e3,
        nm.bytes() / 1024,
        wt.len() / 1024,
        down.len() / 1024
    );
    let dk = dense_kernel(ty, dim, ffn);
    let uk = dense_kernel(ty, ffn / 2, dim);
    for threads in [1, 2] {
        let pool = ThreadPool::new(threads);
        let mut out = vec![0.0; dim];
        let mut scratch = Vec::new();
        let dense = time_us(2000, || dk.run(&pool, MatmulCall::dense(&down, &h, 1, &mut out, &mut scratch)).unwrap());
        println!("[{threads}t] dense {} down {dim}x{ffn}: {dense:.2} us", dk.name());
        for pct in [100, 70, 50, 30] {
            let n = ffn * pct / 100;
            let idx = random_subset(&mut r, ffn, n);
            let coef: Vec<f32> = idx.iter().map(|&i| h[i as usize]).collect();
            for a in isas().into_iter().rev() {
                let t = time_us(2000, || axpy_rows_q8_0_with(&pool, a, &wt, dim, &idx, &coef, &mut out).unwrap());
                println!("[{threads}t] axpy_rows_q8_0 ({}) {pct}% ({n} neurons): {t:.2} us", a.name());
            }
            for a in isas().into_iter().rev() {
                let t = time_us(2000, || nm.axpy_with(&pool, a, &idx, &coef, &mut out).unwrap());
                println!("[{threads}t] NeuronMajor::axpy ({}) {pct}% ({n} neurons): {t:.2} us", a.name());
            }
            let t = time_us(2000, || nm.axpy_fast(&pool, &idx, &coef, &mut out).unwrap());
            let how = if NeuronMajor::axpy_fast_is_int8() { "int8 avx512-vnni" } else { "f32 fallback" };
            println!("[{threads}t] NeuronMajor::axpy_fast ({how}) {pct}% ({n} neurons): {t:.2} us");
        }
        let rb = ty.row_bytes(dim).unwrap();
        let idx = random_subset(&mut r, ffn, ffn / 2);
        let mut g = Vec::new();
        let gather = time_us(2000, || gather_rows(&pool, &up, rb, &idx, &mut g).unwrap());
        let mut up_out = vec![0.0; ffn / 2];
        let upmv = time_us(2000, || uk.run(&pool, MatmulCall::dense(&g, &x, 1, &mut up_out, &mut scratch)).unwrap());
        let uk_full = dense_kernel(ty, ffn, dim);
        let mut full_out = vec![0.0; ffn];
        let upfull =
            time_us(2000, || uk_full.run(&pool, MatmulCall::dense(&up, &x, 1, &mut full_out, &mut scratch)).unwrap());
        println!(
            "[{threads}t] gather_rows 50% of {ffn}x{dim} {ty} ({} KiB): {gather:.2} us; dense up on gathered: {upmv:.2} us; dense up full: {upfull:.2} us",
            g.len() / 1024
        );
    }
}

/// Only the down projection at the SmolLM2 shape, 1 thread: dense matvec,
/// f32 `NeuronMajor::axpy` and int8 `NeuronMajor::axpy_fast`.
/// `cargo bench -p spinfer-sparse-kernels --bench timings -- fast_axpy_timings`
fn fast_axpy_timings() {
    let mut r = rng(52);
    let (dim, ffn) = (576, 1536);
    let pool = ThreadPool::new(1);
    let h = random_acts(&mut r, ffn);
    let mut out = vec![0.0; dim];
    for ty in NM_TYPES {
        let down = random_weights(&mut r, ty, dim, ffn);
        let nm = NeuronMajor::from_weights(ty, &down, dim, ffn).unwrap();
        let dk = dense_kernel(ty, dim, ffn);
        let mut scratch = Vec::new();
        let dense = time_us(3000, || dk.run(&pool, MatmulCall::dense(&down, &h, 1, &mut out, &mut scratch)).unwrap());
        let mut line = format!("[1t] {ty} {dim}x{ffn}: dense {} {dense:.2} us", dk.name());
        for pct in [100, 70, 50] {
            let idx = random_subset(&mut r, ffn, ffn * pct / 100);
            let coef: Vec<f32> = idx.iter().map(|&i| h[i as usize]).collect();
            let f = time_us(3000, || nm.axpy(&pool, &idx, &coef, &mut out).unwrap());
            let q = time_us(3000, || nm.axpy_fast(&pool, &idx, &coef, &mut out).unwrap());
            line += &format!(" | {pct}%: axpy {f:.2}, fast {q:.2}");
        }
        println!("{line}");
    }
}

/// The down projection as decode sees it: 96 distinct 576x1536 Q4_1
/// matrices (53 MB, more than the last-level cache), swept in turn, so
/// every matrix comes from DRAM. Per matrix, the dense matvec against the
/// integer AXPY at 70% and 50% kept; `SPINFER_THREADS` threads (default 2).
/// `cargo bench -p spinfer-sparse-kernels --bench timings -- streaming_axpy_timings`
fn streaming_axpy_timings() {
    let mut r = rng(53);
    let (dim, ffn) = (576, 1536);
    let n_mats = std::env::var("SPINFER_MATRICES").ok().and_then(|s| s.parse().ok()).unwrap_or(96);
    let threads = std::env::var("SPINFER_THREADS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    let pool = ThreadPool::new(threads);
    let ty = GgmlType::Q4_1;
    let h = random_acts(&mut r, ffn);
    let mut out = vec![0.0; dim];
    let mats: Vec<Vec<u8>> = (0..n_mats).map(|_| random_weights(&mut r, ty, dim, ffn)).collect();
    let nms: Vec<NeuronMajor> = mats.iter().map(|w| NeuronMajor::from_weights(ty, w, dim, ffn).unwrap()).collect();
    let dk = dense_kernel(ty, dim, ffn);
    let mut scratch = Vec::new();
    let subsets: Vec<(usize, Vec<u32>, Vec<f32>)> = [70, 50]
        .into_iter()
        .map(|pct| {
            let idx = random_subset(&mut r, ffn, ffn * pct / 100);
            let coef = idx.iter().map(|&i| h[i as usize]).collect();
            (pct, idx, coef)
        })
        .collect();
    // Interleaved sweeps: dense, then each subset, 15 rounds; the median of
    // the per-round ratios to dense.
    let mut dense_us = Vec::new();
    let mut ratios = vec![Vec::new(); subsets.len()];
    for _ in 0..15 {
        let t = Instant::now();
        for w in &mats {
            dk.run(&pool, MatmulCall::dense(w, &h, 1, &mut out, &mut scratch)).unwrap();
        }
        let d = t.elapsed().as_secs_f64() * 1e6 / n_mats as f64;
        dense_us.push(d);
        for (s, (_, idx, coef)) in subsets.iter().enumerate() {
            let t = Instant::now();
            for nm in &nms {
                nm.axpy_fast(&pool, idx, coef, &mut out).unwrap();
            }
            ratios[s].push(t.elapsed().as_secs_f64() * 1e6 / n_mats as f64 / d);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut line = format!("[{threads}t, {n_mats} matrices from DRAM] dense {:.2} us", median(&mut dense_us));
    for ((pct, _, _), rs) in subsets.iter().zip(&mut ratios) {
        line += &format!(" | {pct}% kept: {:.3} of dense", median(rs));
    }
    println!("{line}");
}

/// Timings (`cargo bench -p spinfer-sparse-kernels --bench timings --
/// gathered_rows_timings`): a gathered-row call (`Select::Rows`) on
/// half the rows of 64 SmolLM2 up projections (1536x576 Q4_1, 2 tokens as
/// fast-mode decode, 2 threads, streamed from DRAM), as a fraction of the
/// dense product, interleaved with it and with the contiguous half. Kept
/// rows spread at random save little: the hardware prefetcher fetches the
/// skipped neighbours anyway. Clustered rows (80% of the first half, 20%
/// of the second) save more.
fn gathered_rows_timings() {
    let mut r = rng(99);
    let ty = GgmlType::Q4_1;
    let (rows, cols) = (1536, 576);
    let pool = ThreadPool::new(2);
    let mats: Vec<Vec<u8>> = (0..64).map(|_| random_weights(&mut r, ty, rows, cols)).collect();
    let rb = ty.row_bytes(cols).unwrap();
    let x = random_acts(&mut r, 2 * cols);
    let (full, half) = (dense_kernel(ty, rows, cols), dense_kernel(ty, rows / 2, cols));
    let random = random_subset(&mut r, rows, rows / 2);
    let clustered: Vec<u32> =
        (0..rows as u32).filter(|&i| r.random_range(0..10) < if (i as usize) < rows / 2 { 8 } else { 2 }).collect();
    let (mut out, mut s) = (vec![0f32; 2 * rows], Vec::new());
    for (name, idx) in [("random", &random), ("clustered", &clustered)] {
        for round in 0..3 {
            let mut t = [0u128; 3];
            for i in 0..3000 {
                let m = |k: usize| &mats[(i * 3 + k) % mats.len()];
                let t0 = Instant::now();
                full.run(&pool, MatmulCall::dense(m(0), &x, 2, &mut out, &mut s)).unwrap();
                t[0] += t0.elapsed().as_nanos();
                let t0 = Instant::now();
                half.run(&pool, MatmulCall::dense(&m(1)[..rows / 2 * rb], &x, 2, &mut out[..rows], &mut s)).unwrap();
                t[1] += t0.elapsed().as_nanos();
                let t0 = Instant::now();
                full.run(
                    &pool,
                    MatmulCall {
                        w: m(2),
                        select: Select::Rows(idx),
                        x: &x,
                        n_tokens: 2,
                        out: &mut out[..2 * idx.len()],
                        scratch: &mut s,
                        prefill: false,
                    },
                )
                .unwrap();
                t[2] += t0.elapsed().as_nanos();
            }
            let f = |k: usize| t[k] as f64 / t[0] as f64;
            eprintln!(
                "{name} ({} of {rows} rows), round {round}: dense {} ns; contiguous half {:.2}, gathered {:.2} of dense",
                idx.len(),
                t[0] / 3000,
                f(1),
                f(2)
            );
        }
    }
}

/// Throughput of the best kernel on MiniLM's shapes (not a check):
/// `cargo bench -p spinfer-sparse-kernels --bench timings -- gemm_throughput`.
fn gemm_throughput() {
    let mut r = rng(1);
    for threads in [1, 2] {
        let pool = ThreadPool::new(threads);
        for (rows, cols) in [(384, 384), (1536, 384), (384, 1536)] {
            let w = random_weights(&mut r, GgmlType::F32, rows, cols);
            let desc = MatmulDesc::dense(GgmlType::F32, ActType::F32, rows, cols);
            let k = candidates(&desc, &CpuFeatures::detect()).into_iter().next().unwrap();
            for n in [4, 16, 128, 2048] {
                let x: Vec<f32> = (0..n * cols).map(|_| r.random_range(-1.0f32..1.0)).collect();
                let mut out = vec![0.0; n * rows];
                let mut scratch = Vec::new();
                let reps = (2e9 / (2.0 * (n * rows * cols) as f64)).ceil() as usize;
                k.run(&pool, MatmulCall::dense(&w, &x, n, &mut out, &mut scratch)).unwrap();
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    k.run(&pool, MatmulCall::dense(&w, &x, n, &mut out, &mut scratch)).unwrap();
                }
                let gflops = 2.0 * (n * rows * cols * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
                println!("{} threads={threads} {rows}x{cols} n={n}: {gflops:.1} GFLOP/s", k.name());
            }
        }
    }
}

/// Timings, one thread, best of 7 batches: ns per weight row for decode (1 token) and per
/// (row, token) for a 16-token batch, for every ternary kernel and for the
/// dequantise + f32 path (`ActType::F32`, precise mode) on the same
/// weights. `cargo bench -p spinfer-sparse-kernels --bench timings -- ternary_speed`.
fn ternary_speed() {
    let pool = ThreadPool::new(1);
    let f = CpuFeatures::detect();
    let mut r = rng(9);
    let (rows, cols) = (2048, 2048);
    let time = |k: &dyn MatmulKernel, w: &[u8], x: &[f32], n: usize| {
        let mut out = vec![0.0; n * rows];
        let mut s = Vec::new();
        k.run(&pool, MatmulCall::dense(w, x, n, &mut out, &mut s)).unwrap();
        // The best of 7 batches of 10 calls (the machine may be busy).
        (0..7)
            .map(|_| {
                let t0 = Instant::now();
                for _ in 0..10 {
                    k.run(&pool, MatmulCall::dense(w, x, n, &mut out, &mut s)).unwrap();
                }
                t0.elapsed().as_nanos() as f64 / 10.0 / (rows * n) as f64
            })
            .fold(f64::INFINITY, f64::min)
    };
    for ty in TERNARY_TYPES {
        let w = weights(&mut r, ty, rows, cols);
        for n in [1, 16] {
            let x = random_acts(&mut r, n * cols);
            let mut line = format!("{:6} {rows}x{cols} n={n:2}:", name(ty));
            for k in kernels(ty, rows, cols) {
                line += &format!("  {} {:.1} ns", k.name(), time(k.as_ref(), &w, &x, n));
            }
            if let Some(t) = ty {
                for k in candidates(&MatmulDesc::dense(t, ActType::F32, rows, cols), &f) {
                    line += &format!("  {} {:.1} ns", k.name(), time(k.as_ref(), &w, &x, n));
                }
            }
            eprintln!("{line}");
        }
    }
}
