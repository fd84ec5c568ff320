//! Matmul throughput on SmolLM2-135M shapes: decode (1 token) and prefill
//! (64 tokens), 1 and 2 threads, best kernel for the CPU. Throughput is
//! reported as bytes of weights read per second.
//!
//! `cargo bench -p spinfer-kernels --bench matmul [-- FILTER]`

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use half::f16;
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, MatmulCall, MatmulDesc};
use spinfer_kernels::matmul::candidates;
use spinfer_kernels::pool::ThreadPool;

#[path = "support/mod.rs"]
mod support;

/// Deterministic pseudo-random bytes (xorshift), with sane f16 scales.
fn weights(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let mut w = support::xorshift_bytes(rows * ty.row_bytes(cols).unwrap(), 0);
    let scale = f16::from_f32(0.01).to_le_bytes();
    let offs: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[],
    };
    for blk in w.chunks_exact_mut(ty.type_size()) {
        for &o in offs {
            blk[o..o + 2].copy_from_slice(&scale);
        }
    }
    w
}

fn acts(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7919 % 2003) as f32 - 1001.0) * 1e-3).collect()
}

fn bench(c: &mut Criterion) {
    let features = CpuFeatures::detect();
    let shapes: [(&str, GgmlType, ActType, usize, usize); 8] = [
        ("q4_1 576x576 (q,o)", GgmlType::Q4_1, ActType::Q8_1, 576, 576),
        ("q4_1 192x576 (k,v)", GgmlType::Q4_1, ActType::Q8_1, 192, 576),
        ("q4_1 1536x576 (gate,up)", GgmlType::Q4_1, ActType::Q8_1, 1536, 576),
        ("q4_1 576x1536 (down)", GgmlType::Q4_1, ActType::Q8_1, 576, 1536),
        ("q8_0 49152x576 (lm head)", GgmlType::Q8_0, ActType::Q8_0, 49152, 576),
        ("q4_k 1536x768", GgmlType::Q4_K, ActType::Q8_K, 1536, 768),
        ("q6_k 1536x768", GgmlType::Q6_K, ActType::Q8_K, 1536, 768),
        ("q4_1 precise 1536x576", GgmlType::Q4_1, ActType::F32, 1536, 576),
    ];
    for threads in [1, 2] {
        let pool = ThreadPool::new(threads);
        for n_tokens in [1usize, 64] {
            let mode = if n_tokens == 1 { "decode" } else { "prefill64" };
            let mut g = c.benchmark_group(format!("{mode}/t{threads}"));
            g.warm_up_time(Duration::from_millis(500));
            g.measurement_time(Duration::from_secs(2));
            g.sample_size(20);
            for (label, ty, act, rows, cols) in shapes {
                let desc = MatmulDesc::dense(ty, act, rows, cols);
                let kernels = candidates(&desc, &features);
                let Some(k) = kernels.first() else { continue };
                let w = weights(ty, rows, cols);
                let x = acts(n_tokens * cols);
                let mut out = vec![0.0f32; n_tokens * rows];
                let mut scratch = Vec::new();
                g.throughput(Throughput::Bytes(w.len() as u64));
                g.bench_function(format!("{label} [{}]", k.name()), |b| {
                    b.iter(|| {
                        k.run(&pool, MatmulCall::dense(black_box(&w), black_box(&x), n_tokens, &mut out, &mut scratch))
                            .unwrap();
                    })
                });
            }
            g.finish();
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
