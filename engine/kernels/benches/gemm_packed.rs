//! The BERT encoder's matmuls (all-MiniLM-L6-v2 shapes: Q/K/V fused,
//! attention output, FFN up and down) on 16 and 256 tokens, 2 threads:
//! the prepacked GEMM (`matmul::gemm_packed`, f32, and bf16 where the CPU
//! has it) next to the registry's best f32 kernel on the same matrix (what
//! the encoder runs without prepacking). Throughput is in floating-point
//! operations (`elem/s` = 2 · rows · cols · tokens per second).
//!
//! `cargo bench -p spinfer-kernels --bench gemm_packed [-- FILTER]`

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, MatmulCall, MatmulDesc};
use spinfer_kernels::matmul::candidates;
use spinfer_kernels::matmul::gemm_packed::{PackedMatrix, PackedType, gemm_packed, kernel_name, packed_simd_available};
use spinfer_kernels::pool::ThreadPool;

#[path = "support/mod.rs"]
mod support;

fn bench(c: &mut Criterion) {
    let features = CpuFeatures::detect();
    let pool = ThreadPool::new(2);
    let shapes = [
        ("qkv 1152x384", 1152, 384),
        ("out 384x384", 384, 384),
        ("up 1536x384", 1536, 384),
        ("down 384x1536", 384, 1536),
    ];
    for n in [16usize, 256] {
        let mut g = c.benchmark_group(format!("encoder/n{n}/t2"));
        g.warm_up_time(Duration::from_millis(500));
        g.measurement_time(Duration::from_secs(2));
        g.sample_size(20);
        for (label, rows, cols) in shapes {
            let w = support::xorshift_f32(rows * cols, 1);
            let x = support::xorshift_f32(n * cols, 2);
            let bias = support::xorshift_f32(rows, 3);
            let mut out = vec![0.0f32; n * rows];
            g.throughput(Throughput::Elements((2 * rows * cols * n) as u64));
            let desc = MatmulDesc::dense(GgmlType::F32, ActType::F32, rows, cols);
            if let Some(k) = candidates(&desc, &features).first() {
                let bytes: &[u8] = bytemuck::cast_slice(&w);
                let mut scratch = Vec::new();
                g.bench_function(format!("{label} registry [{}]", k.name()), |b| {
                    b.iter(|| {
                        k.run(&pool, MatmulCall::dense(black_box(bytes), black_box(&x), n, &mut out, &mut scratch))
                            .unwrap();
                    })
                });
            }
            for ty in [PackedType::F32, PackedType::Bf16, PackedType::I16] {
                if !packed_simd_available(ty) {
                    continue;
                }
                let p = PackedMatrix::from_f32(ty, &w, rows, cols).unwrap();
                let mut scratch = Vec::new();
                g.bench_function(format!("{label} [{}]", kernel_name(ty)), |b| {
                    b.iter(|| {
                        gemm_packed(&pool, &p, black_box(&x), n, Some(&bias), &mut out, &mut scratch, None).unwrap();
                    })
                });
            }
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
