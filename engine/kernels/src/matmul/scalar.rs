//! The scalar reference matmul: GGML-block activations from the reference
//! quantisers and one [`crate::dot::scalar`] call per (row, token).

use bytemuck::Pod;

use super::{Job, pack_tokens, scratch_aligned};
use crate::blocks::{BlockQ8_0, BlockQ8_1, BlockQ8K};
use crate::dot::scalar as dot;
use crate::kernel::ActType;
use crate::pool::{ThreadPool, chunk};
use crate::q16::{Q16Layout, pack_q16_scalar};
use crate::quantize;
use crate::{GgmlType, Result};

/// Runs `job` with scalar code.
pub(super) fn run(pool: &ThreadPool, job: &Job<'_>, scratch: &mut Vec<u8>) -> Result<()> {
    let d = job.desc;
    match d.act {
        ActType::F32 => {
            let ty = d.wtype;
            rows_loop(pool, job, |row, t| {
                let xt = &job.x[t * d.cols..(t + 1) * d.cols];
                dot::dot_f32(ty, row, xt).unwrap_or(f32::NAN)
            });
        }
        ActType::Q8_0 => {
            let f = match d.wtype {
                GgmlType::Q4_0 => dot::dot_q4_0_q8_0,
                GgmlType::Q5_0 => dot::dot_q5_0_q8_0,
                _ => dot::dot_q8_0_q8_0,
            };
            let q = quantise::<BlockQ8_0>(pool, job, scratch, GgmlType::Q8_0, |x, y| {
                let _ = quantize::quantize_row_q8_0_ref(x, y);
            });
            let nb = d.cols / 32;
            rows_loop(pool, job, |row, t| f(row, &q[t * nb..(t + 1) * nb]));
        }
        ActType::Q8_1 => {
            let f = match d.wtype {
                GgmlType::Q4_1 => dot::dot_q4_1_q8_1,
                _ => dot::dot_q5_1_q8_1,
            };
            let q = quantise::<BlockQ8_1>(pool, job, scratch, GgmlType::Q8_1, |x, y| {
                let _ = quantize::quantize_row_q8_1_ref(x, y);
            });
            let nb = d.cols / 32;
            rows_loop(pool, job, |row, t| f(row, &q[t * nb..(t + 1) * nb]));
        }
        ActType::Q16 => {
            let l = Q16Layout::new(d.cols);
            let buf = scratch_aligned(scratch, l.stride * job.n_tokens);
            pack_tokens(pool, job.x, d.cols, job.n_tokens, buf, l.stride, &|x, dst| pack_q16_scalar(&l, x, dst));
            let buf = &*buf;
            rows_loop(pool, job, |row, t| {
                let (v, dx, s) = l.sections(&buf[t * l.stride..(t + 1) * l.stride]);
                dot::dot_q16(d.wtype, row, v, dx, s)
            });
        }
        ActType::Q8_K => {
            let f = match d.wtype {
                GgmlType::Q2_K => dot::dot_q2_k_q8_k,
                GgmlType::Q3_K => dot::dot_q3_k_q8_k,
                GgmlType::Q4_K => dot::dot_q4_k_q8_k,
                GgmlType::Q5_K => dot::dot_q5_k_q8_k,
                _ => dot::dot_q6_k_q8_k,
            };
            let q = quantise::<BlockQ8K>(pool, job, scratch, GgmlType::Q8_K, |x, y| {
                let _ = quantize::quantize_row_q8_k_ref(x, y);
            });
            let nb = d.cols / 256;
            rows_loop(pool, job, |row, t| f(row, &q[t * nb..(t + 1) * nb]));
        }
    }
    Ok(())
}

/// Quantises all tokens into GGML blocks `B` inside `scratch`.
fn quantise<'s, B: Pod>(
    pool: &ThreadPool,
    job: &Job<'_>,
    scratch: &'s mut Vec<u8>,
    ty: GgmlType,
    q: impl Fn(&[f32], &mut [B]) + Sync,
) -> &'s [B] {
    let cols = job.desc.cols;
    let stride = cols / ty.block_size() * ty.type_size();
    let buf = scratch_aligned(scratch, stride * job.n_tokens);
    pack_tokens(pool, job.x, cols, job.n_tokens, buf, stride, &|x, dst| {
        q(x, bytemuck::cast_slice_mut(dst));
    });
    bytemuck::cast_slice(buf)
}

/// Computes `out[t * rows + r] = f(weight row of output row r, t)`, output
/// rows split over the pool.
fn rows_loop(pool: &ThreadPool, job: &Job<'_>, f: impl Fn(&[u8], usize) -> f32 + Sync) {
    let rows = job.out_rows();
    let out = job.out;
    pool.broadcast(&|ti, nt| {
        for r in chunk(rows, ti, nt) {
            let wr = job.w_row(r);
            let row = &job.w[wr * job.row_bytes..(wr + 1) * job.row_bytes];
            for t in 0..job.n_tokens {
                // SAFETY: `out` holds `n_tokens * rows` floats (validated);
                // output row `r` belongs to this thread only.
                unsafe { *out.get().add(t * rows + r) = f(row, t) };
            }
        }
    });
}
