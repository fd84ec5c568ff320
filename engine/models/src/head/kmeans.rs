//! Balanced spherical k-means over the output head's rows: every cluster
//! holds `ceil(n / k)` rows at most, so probing `P` clusters reads about
//! `P / k` of the head whatever the token.
//!
//! Rows and centroids are unit vectors; a row's affinity to a centroid is
//! their dot product, computed for all rows against all centroids as one
//! f32 GEMM per batch through the built-in kernel. Assignment is greedy
//! balanced: every (row, one of its `CANDIDATES` best centroids) pair, best
//! affinity first, places the row if the cluster has room; the few rows
//! left over go to the best cluster with room among all.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use spinfer_kernels::GgmlType;
use spinfer_kernels::kernel::{ActType, MatmulCall, MatmulDesc, MatmulKernel};
use spinfer_kernels::pool::ThreadPool;

use crate::{Error, Result};

/// Centroids remembered per row for the balanced assignment.
const CANDIDATES: usize = 8;
/// Rows scored per GEMM call (bounds the score buffer to `BATCH × k`).
const BATCH: usize = 2048;

/// Scales each `d`-wide row of `v` to unit length (zero rows stay zero);
/// returns their lengths.
pub(crate) fn normalize_rows(v: &mut [f32], d: usize) -> Vec<f32> {
    v.chunks_exact_mut(d)
        .map(|r| {
            let n = r.iter().map(|x| x * x).sum::<f32>().sqrt();
            if n > 0.0 {
                r.iter_mut().for_each(|x| *x /= n);
            }
            n
        })
        .collect()
}

/// The f32 × f32 GEMM kernel for `k` centroids of width `d`.
fn gemm(k: usize, d: usize) -> Result<Box<dyn MatmulKernel>> {
    Ok(spinfer_kernel_select::registry::builtin_kernel(&MatmulDesc::dense(GgmlType::F32, ActType::F32, k, d))?)
}

/// Calls `each(row, scores)` with the affinities of every row of `rows`
/// (`n × d`) to the `k` centroids (`k × d`), batch by batch.
pub(crate) fn score_all(
    pool: &ThreadPool,
    rows: &[f32],
    centroids: &[f32],
    d: usize,
    k: usize,
    each: &mut dyn FnMut(usize, &[f32]),
) -> Result<()> {
    let kernel = gemm(k, d)?;
    let w: &[u8] = bytemuck::cast_slice(centroids);
    let (mut out, mut scratch) = (vec![0f32; BATCH * k], Vec::new());
    for (b, batch) in rows.chunks(BATCH * d).enumerate() {
        let m = batch.len() / d;
        kernel
            .run(pool, MatmulCall::dense(w, batch, m, &mut out[..m * k], &mut scratch))
            .map_err(|source| Error::Kernel { kernel: kernel.name().into(), source })?;
        for (i, s) in out[..m * k].chunks_exact(k).enumerate() {
            each(b * BATCH + i, s);
        }
    }
    Ok(())
}

/// The cluster of each of the `n` unit rows (`n × d`): `k` balanced
/// clusters after `iters` rounds of assignment and centroid update, from
/// `k` distinct rows drawn with `seed`. `progress(done, iters)`.
pub(crate) fn balanced_kmeans(
    pool: &ThreadPool,
    rows: &[f32],
    d: usize,
    k: usize,
    iters: usize,
    seed: u64,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<u32>> {
    let n = rows.len() / d;
    if k == 0 || k > n {
        return Err(Error::InvalidArgument(format!("cannot make {k} clusters of {n} rows")));
    }
    let cap = n.div_ceil(k);
    let mut rng = StdRng::seed_from_u64(seed);
    // Initial centroids: k distinct rows (a partial Fisher-Yates shuffle).
    let mut order: Vec<u32> = (0..n as u32).collect();
    for i in 0..k {
        let j = rng.random_range(i..n);
        order.swap(i, j);
    }
    let mut centroids: Vec<f32> = order[..k].iter().flat_map(|&r| rows[r as usize * d..][..d].to_vec()).collect();
    let mut assign = vec![0u32; n];
    for it in 0..iters.max(1) {
        // Each row's best CANDIDATES centroids.
        let t = CANDIDATES.min(k);
        let mut cand = vec![(0f32, 0u32); n * t];
        score_all(pool, rows, &centroids, d, k, &mut |r, s| {
            let best = &mut cand[r * t..(r + 1) * t];
            best.fill((f32::NEG_INFINITY, 0));
            for (c, &v) in s.iter().enumerate() {
                if v > best[t - 1].0 {
                    let mut i = t - 1;
                    while i > 0 && best[i - 1].0 < v {
                        best[i] = best[i - 1];
                        i -= 1;
                    }
                    best[i] = (v, c as u32);
                }
            }
        })?;
        // Greedy balanced assignment, best affinity first.
        let mut pairs: Vec<(f32, u32, u32)> =
            cand.iter().enumerate().map(|(i, &(v, c))| (v, (i / t) as u32, c)).collect();
        pairs.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut fill = vec![0usize; k];
        let mut placed = vec![false; n];
        for &(_, r, c) in &pairs {
            if !placed[r as usize] && fill[c as usize] < cap {
                placed[r as usize] = true;
                fill[c as usize] += 1;
                assign[r as usize] = c;
            }
        }
        // Rows whose candidates were all full: the best cluster with room.
        let left: Vec<usize> = (0..n).filter(|&r| !placed[r]).collect();
        if !left.is_empty() {
            let sub: Vec<f32> = left.iter().flat_map(|&r| rows[r * d..][..d].to_vec()).collect();
            score_all(pool, &sub, &centroids, d, k, &mut |i, s| {
                let best = (0..k).filter(|&c| fill[c] < cap).max_by(|&a, &b| s[a].total_cmp(&s[b]).then(b.cmp(&a)));
                let c = best.expect("k clusters of cap rows hold all n rows");
                fill[c] += 1;
                assign[left[i]] = c as u32;
            })?;
        }
        // New centroids: the normalised mean of each cluster's rows (an
        // empty cluster takes a random row).
        centroids.fill(0.0);
        for (r, &c) in assign.iter().enumerate() {
            let dst = &mut centroids[c as usize * d..][..d];
            dst.iter_mut().zip(&rows[r * d..][..d]).for_each(|(a, b)| *a += b);
        }
        for (c, &f) in fill.iter().enumerate() {
            if f == 0 {
                let r = rng.random_range(0..n);
                centroids[c * d..][..d].copy_from_slice(&rows[r * d..][..d]);
            }
        }
        normalize_rows(&mut centroids, d);
        progress(it + 1, iters.max(1));
    }
    Ok(assign)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows drawn around 8 well-separated directions come back as 8
    /// clusters of equal size, each holding one direction's rows.
    #[test]
    fn recovers_separated_balanced_clusters() {
        let (d, k, per) = (16, 8, 40);
        let mut rng = StdRng::seed_from_u64(7);
        let mut rows = Vec::new();
        for i in 0..k * per {
            let mut v = vec![0f32; d];
            v[i % k] = 1.0;
            v.iter_mut().for_each(|x| *x += rng.random_range(-0.05..0.05));
            rows.extend(v);
        }
        normalize_rows(&mut rows, d);
        let pool = ThreadPool::new(2);
        let a = balanced_kmeans(&pool, &rows, d, k, 5, 1, &mut |_, _| {}).unwrap();
        let mut sizes = vec![0; k];
        for (i, &c) in a.iter().enumerate() {
            sizes[c as usize] += 1;
            assert_eq!(c, a[i % k], "row {i} left its direction's cluster");
        }
        assert!(sizes.iter().all(|&s| s == per), "{sizes:?}");
    }

    #[test]
    fn clusters_never_exceed_their_capacity() {
        let (d, k, n) = (8, 5, 103);
        let mut rng = StdRng::seed_from_u64(3);
        let mut rows: Vec<f32> = (0..n * d).map(|_| rng.random_range(-1.0..1.0)).collect();
        normalize_rows(&mut rows, d);
        let pool = ThreadPool::new(1);
        let a = balanced_kmeans(&pool, &rows, d, k, 3, 2, &mut |_, _| {}).unwrap();
        let mut sizes = vec![0; k];
        a.iter().for_each(|&c| sizes[c as usize] += 1);
        assert!(sizes.iter().all(|&s| s <= n.div_ceil(k)), "{sizes:?}");
        assert!(balanced_kmeans(&pool, &rows, d, 0, 1, 0, &mut |_, _| {}).is_err());
        assert!(balanced_kmeans(&pool, &rows, d, n + 1, 1, 0, &mut |_, _| {}).is_err());
    }
}
