//! f32 vector primitives for the non-matmul parts of a forward pass
//! (attention scores, weighted sums, softmax, the FFN activations): scalar
//! references plus AVX2 versions chosen at run time. The attention's rows
//! (`dot_rows`, `axpy_rows`) may be f32 or f16 ([`KvElem`]).

use crate::elem::KvElem;

/// `sum(a[i] * b[i])`.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { x86::dot(a, b) };
    }
    dot_scalar(a, b)
}

/// `y[i] += a * x[i]`.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { x86::axpy(a, x, y) };
    }
    axpy_scalar(a, x, y)
}

/// `out[j] = dot(q, k[j * stride..][..q.len()])` for each `j`: the dot
/// products of `q` with rows `stride` apart, each equal bit for bit to
/// one [`dot`] (with f16 rows: one [`dot`] with the rows widened to f32),
/// without a call and a feature check per row.
///
/// # Panics
/// If `k` is shorter than the last row's end.
pub fn dot_rows<E: KvElem>(q: &[f32], k: &[E], stride: usize, out: &mut [f32]) {
    let Some(last) = out.len().checked_sub(1) else { return };
    let hd = q.len();
    assert!(
        k.len() >= last * stride + hd,
        "dot_rows: {} rows of {hd} floats, {stride} apart, past {}",
        out.len(),
        k.len()
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { x86::dot_rows(q, k, stride, out) };
    }
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot_scalar(q, &k[j * stride..j * stride + hd]);
    }
}

/// `y += a[j] * x[j * stride..][..y.len()]` for each `j` in order: the
/// weighted sum of rows `stride` apart, equal bit for bit to one [`axpy`]
/// per row (with f16 rows: per row widened to f32). The AVX2 version keeps
/// up to 64 floats of `y` in registers across the rows instead of storing
/// and reloading them per row.
///
/// # Panics
/// If `x` is shorter than the last row's end.
pub fn axpy_rows<E: KvElem>(a: &[f32], x: &[E], stride: usize, y: &mut [f32]) {
    let Some(last) = a.len().checked_sub(1) else { return };
    assert!(
        x.len() >= last * stride + y.len(),
        "axpy_rows: {} rows of {} floats, {stride} apart, past {}",
        a.len(),
        y.len(),
        x.len()
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected at run time; the rows lie
        // inside `x` (asserted above).
        return unsafe { x86::axpy_rows(a, x, stride, y) };
    }
    for (j, &w) in a.iter().enumerate() {
        axpy_scalar(w, &x[j * stride..j * stride + y.len()], y);
    }
}

/// In-place softmax; returns nothing, leaves `x` summing to 1.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    #[cfg(target_arch = "x86_64")]
    let sum = if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected at run time.
        unsafe { x86::exp_sub_sum(x, max) }
    } else {
        exp_sub_sum_scalar(x, max)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let sum = exp_sub_sum_scalar(x, max);
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `silu(x) = x · sigmoid(x)`, in place (the same expression as
/// [`swiglu`], so `silu` then `* up` equals it bit for bit).
///
/// The AVX2 version computes every element the same way wherever it sits
/// in the slice (a tail goes through a padded vector), so `silu` of
/// gathered values then `* up` equals [`swiglu`]'s value bit for bit.
pub fn silu(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { x86::glu::<{ x86::SILU }>(x, None) };
    }
    silu_scalar(x)
}

/// `gate = silu(gate) * up` (SwiGLU), in place (see [`silu`]).
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { x86::glu::<{ x86::SILU }>(gate, Some(up)) };
    }
    swiglu_scalar(gate, up)
}

/// `gate = gelu(gate) * up` (GeGLU) with PyTorch's tanh approximation
/// `gelu(x) = x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`, in place.
/// The AVX2 version computes it as `x · sigmoid(2 √(2/π) (x + 0.044715
/// x³))`, the same function, with a vector exp.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { x86::glu::<{ x86::GELU }>(gate, Some(up)) };
    }
    geglu_scalar(gate, up)
}

/// Scalar reference of [`silu`].
pub fn silu_scalar(x: &mut [f32]) {
    for g in x {
        *g = *g / (1.0 + (-*g).exp());
    }
}

/// Scalar reference of [`swiglu`].
pub fn swiglu_scalar(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Scalar reference of [`geglu`].
pub fn geglu_scalar(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh()) * u;
    }
}

/// Scalar reference of [`dot`]: eight partial sums, as the SIMD version.
pub fn dot_scalar<E: KvElem>(a: &[f32], b: &[E]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, ra) = a.as_chunks::<8>();
    let (cb, rb) = b.as_chunks::<8>();
    for (x, y) in ca.iter().zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i].to_f32();
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y.to_f32();
    }
    s
}

pub fn axpy_scalar<E: KvElem>(a: f32, x: &[E], y: &mut [f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += a * xi.to_f32();
    }
}

/// `x[i] = exp(x[i] - max)`, returning the sum.
pub fn exp_sub_sum_scalar(x: &mut [f32], max: f32) -> f32 {
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
fn has_avx2_fma() -> bool {
    // Detected once per process (and capped by SPINFER_CPU); an atomic
    // load. F16C too: the rows may be f16 (every AVX2 CPU has it).
    crate::cpu::CpuFeatures::detect().has_avx2()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::elem::KvElem;

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot<E: KvElem>(a: &[f32], b: &[E]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n` keeps both 8-float unaligned loads of
            // each slice in bounds.
            unsafe {
                acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), E::load8(pb.add(i)), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), E::load8(pb.add(i + 8)), acc1);
            }
            i += 16;
        }
        if i + 8 <= n {
            // SAFETY: `i + 8 <= n` keeps the loads in bounds.
            unsafe {
                acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), E::load8(pb.add(i)), acc0);
            }
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(acc0, acc1));
        while i < n {
            s += a[i] * b[i].to_f32();
            i += 1;
        }
        s
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let va = _mm256_set1_ps(a);
        let (px, py) = (x.as_ptr(), y.as_mut_ptr());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n` keeps the load and store inside both slices.
            unsafe {
                let r = _mm256_fmadd_ps(va, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)));
                _mm256_storeu_ps(py.add(i), r);
            }
            i += 8;
        }
        while i < n {
            y[i] += a * x[i];
            i += 1;
        }
    }

    /// [`super::dot_rows`]: [`dot`] inlined into the loop over rows.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_rows<E: KvElem>(q: &[f32], k: &[E], stride: usize, out: &mut [f32]) {
        for (j, o) in out.iter_mut().enumerate() {
            prefetch_row(k.as_ptr().wrapping_add((j + PF_ROWS) * stride), q.len() * E::BYTES);
            // SAFETY: AVX2 and FMA (the caller).
            *o = unsafe { dot(q, &k[j * stride..j * stride + q.len()]) };
        }
    }

    /// Rows ahead that [`dot_rows`] and [`axpy_rows`] prefetch: the
    /// attention's cache rows are short runs `stride` apart, which this
    /// VM's hardware prefetchers follow poorly (docs/benchmarks.md,
    /// "Decode at depth").
    const PF_ROWS: usize = 8;

    /// Asks for the cache lines of `bytes` bytes from `p` (a hint: `p`
    /// may lie past the data, nothing is read).
    #[inline(always)]
    fn prefetch_row<E>(p: *const E, bytes: usize) {
        let p = p.cast::<u8>();
        let mut off = 0;
        while off < bytes {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off).cast()) };
            off += 64;
        }
    }

    /// [`super::axpy_rows`]: `y` in chunks of 8 vectors held in registers
    /// while every row adds to them, the same `fma(a, x, y)` per element
    /// as [`axpy`], then the scalar tail as [`axpy`]'s.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `x` must hold
    /// `(a.len() - 1) * stride + y.len()` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_rows<E: KvElem>(a: &[f32], x: &[E], stride: usize, y: &mut [f32]) {
        let n = y.len();
        let mut i = 0;
        while i + 64 <= n {
            // SAFETY: forwarded; `i + 64 <= n`.
            unsafe { rows_chunk::<E, 8>(a, x, stride, &mut y[i..i + 64], i) };
            i += 64;
        }
        // SAFETY: as above, for what is left of whole vectors.
        unsafe {
            match (n - i) / 8 {
                7 => rows_chunk::<E, 7>(a, x, stride, &mut y[i..i + 56], i),
                6 => rows_chunk::<E, 6>(a, x, stride, &mut y[i..i + 48], i),
                5 => rows_chunk::<E, 5>(a, x, stride, &mut y[i..i + 40], i),
                4 => rows_chunk::<E, 4>(a, x, stride, &mut y[i..i + 32], i),
                3 => rows_chunk::<E, 3>(a, x, stride, &mut y[i..i + 24], i),
                2 => rows_chunk::<E, 2>(a, x, stride, &mut y[i..i + 16], i),
                1 => rows_chunk::<E, 1>(a, x, stride, &mut y[i..i + 8], i),
                _ => {}
            }
        }
        i += (n - i) / 8 * 8;
        for (j, &w) in a.iter().enumerate() {
            for c in i..n {
                y[c] += w * x[j * stride + c].to_f32();
            }
        }
    }

    /// `NV` vectors of `y` (`y.len() == 8 * NV`), columns `col..` of the rows.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; every row `j` holds `col + 8 * NV` elements from
    /// `j * stride`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_chunk<E: KvElem, const NV: usize>(a: &[f32], x: &[E], stride: usize, y: &mut [f32], col: usize) {
        let py = y.as_mut_ptr();
        let mut acc = [_mm256_setzero_ps(); NV];
        for (v, acc) in acc.iter_mut().enumerate() {
            // SAFETY: `y` holds `8 * NV` floats.
            *acc = unsafe { _mm256_loadu_ps(py.add(8 * v)) };
        }
        for (j, &w) in a.iter().enumerate() {
            let va = _mm256_set1_ps(w);
            prefetch_row(x.as_ptr().wrapping_add((j + PF_ROWS) * stride + col), 8 * NV * E::BYTES);
            // SAFETY: row `j` holds `col + 8 * NV` floats (the caller).
            let px = unsafe { x.as_ptr().add(j * stride + col) };
            for (v, acc) in acc.iter_mut().enumerate() {
                // SAFETY: as above.
                *acc = _mm256_fmadd_ps(va, unsafe { E::load8(px.add(8 * v)) }, *acc);
            }
        }
        for (v, acc) in acc.iter().enumerate() {
            // SAFETY: `y` holds `8 * NV` floats.
            unsafe { _mm256_storeu_ps(py.add(8 * v), *acc) };
        }
    }

    /// `x[i] = exp(x[i] - max)` with a vector exp (Cephes polynomial,
    /// relative error ~1e-7), returning the sum.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_sub_sum(x: &mut [f32], max: f32) -> f32 {
        let n = x.len();
        let vmax = _mm256_set1_ps(max);
        let p = x.as_mut_ptr();
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n` keeps the load and store inside `x`.
            unsafe {
                let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), vmax));
                _mm256_storeu_ps(p.add(i), e);
                acc = _mm256_add_ps(acc, e);
            }
            i += 8;
        }
        let mut s = hsum(acc);
        while i < n {
            x[i] = (x[i] - max).exp();
            s += x[i];
            i += 1;
        }
        s
    }

    /// The activation of [`glu`]: SiLU.
    pub const SILU: u8 = 0;
    /// The activation of [`glu`]: tanh-approximated GELU.
    pub const GELU: u8 = 1;

    /// `x = act(x) (* up)` for the activation `A`, 8 lanes at a time; a
    /// tail goes through a zero-padded vector, so each element's value
    /// does not depend on its place in the slice.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn glu<const A: u8>(x: &mut [f32], up: Option<&[f32]>) {
        let n = up.map_or(x.len(), |u| u.len().min(x.len()));
        let one = _mm256_set1_ps(1.0);
        let f = |g: __m256, u: __m256| {
            // x / (1 + exp(-z)): z = x for SiLU; for GELU z = 2 √(2/π) (x
            // + 0.044715 x³), as 1 + tanh(z/2) = 2 / (1 + exp(-z)).
            let z = if A == SILU {
                g
            } else {
                let x3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
                _mm256_mul_ps(_mm256_set1_ps(2.0 * 0.797_884_6), _mm256_fmadd_ps(_mm256_set1_ps(0.044715), x3, g))
            };
            let e = exp256_any(_mm256_sub_ps(_mm256_setzero_ps(), z));
            _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u)
        };
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n` floats of `x` and of `up`.
            unsafe {
                let u = up.map_or(one, |u| _mm256_loadu_ps(u.as_ptr().add(i)));
                let p = x.as_mut_ptr().add(i);
                _mm256_storeu_ps(p, f(_mm256_loadu_ps(p), u));
            }
            i += 8;
        }
        if i < n {
            let len = n - i;
            let (mut gb, mut ub) = ([0.0f32; 8], [1.0f32; 8]);
            gb[..len].copy_from_slice(&x[i..n]);
            if let Some(u) = up {
                ub[..len].copy_from_slice(&u[i..n]);
            }
            // SAFETY: `gb` and `ub` hold 8 floats each.
            unsafe { _mm256_storeu_ps(gb.as_mut_ptr(), f(_mm256_loadu_ps(gb.as_ptr()), _mm256_loadu_ps(ub.as_ptr()))) };
            x[i..n].copy_from_slice(&gb[..len]);
        }
    }

    /// exp(x) for any x: below -87.3 it flushes to 0, above 88 it stays
    /// at exp(88) (~1.7e38).
    #[target_feature(enable = "avx2,fma")]
    fn exp256_any(x: __m256) -> __m256 {
        exp256(_mm256_min_ps(x, _mm256_set1_ps(88.0)))
    }

    /// exp(x) for x <= 88 (inputs below -87.3 flush to 0).
    #[target_feature(enable = "avx2,fma")]
    fn exp256(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.336_55));
        // exp(x) = 2^k * exp(r), k = round(x / ln2), r = x - k ln2.
        let k = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut y = _mm256_set1_ps(1.987_569_1e-4);
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.398_199_9e-3));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.333_452e-3));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.166_579_6e-2));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.666_666_5e-1));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5));
        let r2 = _mm256_mul_ps(r, r);
        y = _mm256_fmadd_ps(y, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let pow2k = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(k),
            _mm256_set1_epi32(127),
        )));
        _mm256_mul_ps(y, pow2k)
    }

    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| r.random_range(-3.0f32..3.0)).collect()
    }

    /// `x` rounded to f16, and those values widened back to f32.
    fn halves(x: &[f32]) -> (Vec<f16>, Vec<f32>) {
        let h: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let w = h.iter().map(|v| v.to_f32()).collect();
        (h, w)
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// One `dot_rows` is one `dot` per row, bit for bit; over f16 rows, it
    /// is the f32 one over the rows widened, bit for bit, and within
    /// rounding of the scalar reference.
    #[test]
    fn dot_rows_is_one_dot_per_row() {
        for (rows, width, stride) in [(1, 64, 64), (37, 64, 192), (5, 256, 300), (9, 77, 80), (3, 5, 7), (0, 16, 16)] {
            let (q, k) = (random(width, 3), random(rows * stride + width, 4));
            let mut got = vec![f32::NAN; rows];
            dot_rows(&q, &k, stride, &mut got);
            for (j, g) in got.iter().enumerate() {
                assert_eq!(
                    g.to_bits(),
                    dot(&q, &k[j * stride..j * stride + width]).to_bits(),
                    "{rows} rows of {width}"
                );
            }
            let (k16, wide) = halves(&k);
            let (mut half_rows, mut wide_rows) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
            dot_rows(&q, &k16, stride, &mut half_rows);
            dot_rows(&q, &wide, stride, &mut wide_rows);
            assert_eq!(bits(&half_rows), bits(&wide_rows), "f16: {rows} rows of {width}");
            for (j, g) in half_rows.iter().enumerate() {
                let want = dot_scalar(&q, &k16[j * stride..j * stride + width]);
                assert!((g - want).abs() <= 1e-4 * (1.0 + want.abs()), "f16 row {j}: {g} vs {want}");
            }
        }
    }

    /// One `axpy_rows` is one `axpy` per row, bit for bit, at widths with
    /// whole chunks, partial chunks and scalar tails.
    #[test]
    fn axpy_rows_is_one_axpy_per_row() {
        for (rows, width, stride) in [(1, 64, 64), (37, 64, 192), (5, 256, 300), (9, 77, 80), (3, 5, 7), (0, 16, 16)] {
            let (a, x) = (random(rows, 7), random(rows * stride + width, 8));
            let (mut y, mut want) = (random(width, 9), random(width, 9));
            axpy_rows(&a, &x, stride, &mut y);
            for (j, &w) in a.iter().enumerate() {
                axpy(w, &x[j * stride..j * stride + width], &mut want);
            }
            assert!(y.iter().zip(&want).all(|(u, v)| u.to_bits() == v.to_bits()), "{rows} rows of {width}");
            // f16 rows: the f32 result over the rows widened, bit for bit,
            // and within rounding of the scalar reference.
            let (x16, wide) = halves(&x);
            let (mut half_y, mut wide_y, mut scalar_y) = (random(width, 9), random(width, 9), random(width, 9));
            axpy_rows(&a, &x16, stride, &mut half_y);
            axpy_rows(&a, &wide, stride, &mut wide_y);
            assert_eq!(bits(&half_y), bits(&wide_y), "f16: {rows} rows of {width}");
            for (j, &w) in a.iter().enumerate() {
                axpy_scalar(w, &x16[j * stride..j * stride + width], &mut scalar_y);
            }
            for (g, want) in half_y.iter().zip(&scalar_y) {
                assert!((g - want).abs() <= 1e-4 * (1.0 + want.abs()), "f16: {g} vs {want}");
            }
        }
    }

    #[test]
    fn simd_matches_scalar_on_random_inputs() {
        for n in [1, 7, 8, 15, 16, 17, 64, 100, 513] {
            let (a, b) = (random(n, n as u64), random(n, 1000 + n as u64));
            let (d, ds) = (dot(&a, &b), dot_scalar(&a, &b));
            assert!((d - ds).abs() <= 1e-4 * (1.0 + ds.abs()), "dot n={n}: {d} vs {ds}");

            let (mut y, mut ys) = (b.clone(), b.clone());
            axpy(0.37, &a, &mut y);
            axpy_scalar(0.37, &a, &mut ys);
            for (u, v) in y.iter().zip(&ys) {
                assert!((u - v).abs() <= 1e-5 * (1.0 + v.abs()), "axpy n={n}");
            }

            let (mut s, mut ss) = (a.clone(), a.clone());
            softmax(&mut s);
            let max = ss.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum = exp_sub_sum_scalar(&mut ss, max);
            for (u, v) in s.iter().zip(&ss) {
                assert!((u - v / sum).abs() <= 1e-6, "softmax n={n}: {u} vs {}", v / sum);
            }
        }
    }

    /// The activations against their scalar references, and the same value
    /// for an element wherever it sits (vector body or tail).
    #[test]
    fn activations_match_scalar_and_do_not_depend_on_position() {
        for n in [1, 7, 8, 13, 64, 100] {
            let (g, u) = (random(n, 7 + n as u64), random(n, 70 + n as u64));
            let mut g = g.clone();
            g[0] = 40.0;
            if n > 1 {
                g[1] = -40.0;
            }
            for (f, fs, name) in [
                (swiglu as fn(&mut [f32], &[f32]), swiglu_scalar as fn(&mut [f32], &[f32]), "swiglu"),
                (geglu, geglu_scalar, "geglu"),
            ] {
                let (mut a, mut b) = (g.clone(), g.clone());
                f(&mut a, &u);
                fs(&mut b, &u);
                for (j, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert!((x - y).abs() <= 2e-6 * (1.0 + y.abs()), "{name} n={n} [{j}]: {x} vs {y}");
                }
                // Element j alone gives the same bits.
                for j in [0, n - 1] {
                    let mut one = [g[j]];
                    f(&mut one, &u[j..j + 1]);
                    assert_eq!(one[0].to_bits(), a[j].to_bits(), "{name} n={n} [{j}] alone");
                }
            }
            let (mut a, mut b) = (g.clone(), g.clone());
            silu(&mut a);
            silu_scalar(&mut b);
            let mut sw = g.clone();
            swiglu(&mut sw, &u);
            for j in 0..n {
                assert!((a[j] - b[j]).abs() <= 2e-6 * (1.0 + b[j].abs()), "silu n={n} [{j}]");
                assert_eq!((a[j] * u[j]).to_bits(), sw[j].to_bits(), "silu then * up = swiglu, n={n} [{j}]");
            }
        }
    }

    #[test]
    fn softmax_handles_extreme_values() {
        let mut x = vec![0.0, -200.0, 50.0, 49.0, -1e30, 50.0, 0.0, 1.0, 2.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x.iter().all(|v| v.is_finite() && *v >= 0.0));
        assert!(x[1] < 1e-30 && x[4] < 1e-30);
    }
}
