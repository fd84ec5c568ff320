//! What the hosts of untrusted kernels (WASM, CUDA) share: the spot check
//! of every call's result against the engine's scalar reference, and the
//! fingerprint that tells a resident weight copy from a freed-and-reused
//! host address.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use spinfer_kernels::kernel::{MatmulCall, MatmulDesc, MatmulKernel};
use spinfer_kernels::pool::ThreadPool;

/// A cheap fingerprint of a weight slice: length and 64 sampled 8-byte
/// windows (FNV-1a). Catches a freed-and-reused host address holding other
/// weights; it is not a content hash.
pub(crate) fn fingerprint(w: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ w.len() as u64;
    if w.is_empty() {
        return h;
    }
    let n = 64usize;
    for i in 0..n {
        let at = (w.len() - 1) * i / (n - 1);
        let end = (at + 8).min(w.len());
        for &b in &w[at..end] {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The scalar reference kernel for one row of an operation, with its
/// one-thread pool and scratch.
struct Reference {
    kernel: Box<dyn MatmulKernel>,
    pool: ThreadPool,
    scratch: Vec<u8>,
}

/// Per kernel: recomputes one output of every call, chosen anew on each
/// call, with the engine's scalar reference kernel (one row of `cols`
/// multiply-adds, next to the call's `rows x cols`). The registry's check
/// at selection cannot see a kernel that turns wrong later.
pub(crate) struct SpotCheck {
    desc: MatmulDesc,
    row_bytes: usize,
    calls: AtomicUsize,
    reference: OnceLock<Option<Mutex<Reference>>>,
}

impl SpotCheck {
    pub(crate) fn new(desc: MatmulDesc, row_bytes: usize) -> Self {
        Self { desc, row_bytes, calls: AtomicUsize::new(0), reference: OnceLock::new() }
    }

    /// Checks one output of a call over `w` (whole rows of the desc's
    /// type), reading the rows `rows` (all when `None`), `n_tokens` tokens
    /// of `x`, into `out` (`n_tokens` rows of one value per row read).
    /// `Err` describes the disagreement (call, token, row, both values).
    pub(crate) fn check(
        &self,
        w: &[u8],
        rows: Option<&[u32]>,
        x: &[f32],
        n_tokens: usize,
        out: &[f32],
    ) -> Result<(), String> {
        let d = &self.desc;
        let width = rows.map_or(w.len() / self.row_bytes.max(1), <[u32]>::len);
        if n_tokens == 0 || width == 0 {
            return Ok(());
        }
        let Some(reference) = self.reference.get_or_init(|| {
            let one_row = MatmulDesc { rows: 1, ..*d };
            spinfer_kernels::matmul::candidates(&one_row, &spinfer_kernels::cpu::CpuFeatures::default())
                .pop()
                .map(|kernel| Mutex::new(Reference { kernel, pool: ThreadPool::new(1), scratch: Vec::new() }))
        }) else {
            return Ok(()); // no reference for this pair: nothing to compare with
        };
        let n = self.calls.fetch_add(1, Ordering::Relaxed) as u64;
        // splitmix64 of the call number: a different (token, row) each call.
        let mut z = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let t = (z % n_tokens as u64) as usize;
        let j = ((z >> 32) % width as u64) as usize;
        let r = rows.map_or(j, |rows| rows[j] as usize);
        let Some(row) = w.get(r * self.row_bytes..(r + 1) * self.row_bytes) else {
            return Err(format!("row {r} is outside the weights"));
        };
        let mut want = [0.0f32];
        let xt = &x[t * d.cols..(t + 1) * d.cols];
        let mut guard = reference.lock().unwrap_or_else(PoisonError::into_inner);
        let Reference { kernel, pool, scratch } = &mut *guard;
        if kernel.run(pool, MatmulCall::dense(row, xt, 1, &mut want, scratch)).is_err() {
            return Ok(());
        }
        let (got, want) = (out[t * width + j], want[0]);
        // The same precise contract on both sides: agreement to rounding
        // (summation order), relative to the token's output scale where a
        // dot product cancels to ~0.
        let token = &out[t * width..(t + 1) * width];
        let scale = (token.iter().map(|v| v * v).sum::<f32>() / token.len() as f32).sqrt();
        let tol = 1e-3 * want.abs().max(scale) + 1e-6;
        let ok = if want.is_finite() { (got - want).abs() <= tol } else { got.is_nan() == want.is_nan() };
        if ok {
            return Ok(());
        }
        Err(format!("on call {n}, output [token {t}, row {r}] is {got}, the reference kernel gives {want}"))
    }
}
