//! Cost of one low-rank prediction at SmolLM2's shape (dim 576, FFN 1536),
//! one thread, for ranks 32, 64 and 128: printed, not asserted.
//! `cargo bench -p spinfer-sparsity --bench lowrank_cost`.

use spinfer_kernel_select::registry::KernelRegistry;
use spinfer_kernels::pool::ThreadPool;
use spinfer_sparsity::lowrank::LowRank;

fn main() {
    let (dim, ffn) = (576, 1536);
    let pool = ThreadPool::new(1);
    for rank in [32, 64, 128] {
        let p: Vec<f32> = (0..rank * dim).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let q: Vec<f32> = (0..ffn * rank).map(|i| ((i * 104_729) % 1000) as f32 / 1000.0 - 0.5).collect();
        let lr = LowRank::new(&p, &q, (rank, dim, ffn), 0.1, &KernelRegistry::builtin()).expect("valid factors");
        let x: Vec<f32> = (0..dim).map(|i| (i as f32).sin()).collect();
        let (mut t, mut out, mut bytes) = (Vec::new(), vec![0.0; ffn], Vec::new());
        let mut best = f64::MAX;
        for _ in 0..20 {
            let start = std::time::Instant::now();
            for _ in 0..100 {
                lr.scores(&pool, &x, &mut t, &mut out, &mut bytes).expect("scores");
            }
            best = best.min(start.elapsed().as_secs_f64() / 100.0);
        }
        println!("rank {rank}: {} bytes per layer, {:.2} us per layer (1 thread)", lr.bytes(), best * 1e6);
    }
}
