//! The BERT encoder's elementwise kernels: the softmax's exponentials,
//! LayerNorm over rows, GELU (erf form), 16-lane reductions, and a row-split
//! helper over the pool. Vectorised where the CPU allows, each checked
//! against its scalar form in the tests below.

use spinfer_kernels::pool::{SyncPtr, ThreadPool, chunk};
use spinfer_models::model::add;

/// `row[i] = exp(scale · (row[i] − max))` for every element (`max` ≥ every
/// element, `scale > 0`), returning their sum: the unnormalised softmax of
/// `scale · row`. Vectorised with AVX-512 or AVX2 + FMA when the CPU has
/// them (the same code compiled for them: the same values; the sum in 16
/// partial sums either way).
pub(crate) fn softmax_exp(row: &mut [f32], max: f32, scale: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if spinfer_kernels::cpu::CpuFeatures::detect().has_avx512f_fma() {
            // SAFETY: the CPU has AVX-512F and FMA (checked just above, by `CpuFeatures::detect`).
            return unsafe { softmax_exp_avx512(row, max, scale) };
        }
        if spinfer_kernels::cpu::CpuFeatures::detect().has_avx2_fma() {
            // SAFETY: the CPU has AVX2 and FMA (checked just above, by `CpuFeatures::detect`).
            return unsafe { softmax_exp_avx2(row, max, scale) };
        }
    }
    softmax_exp_body(row, max, scale)
}

/// [`softmax_exp`] compiled for AVX-512.
///
/// # Safety
/// The CPU must support AVX-512F and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn softmax_exp_avx512(row: &mut [f32], max: f32, scale: f32) -> f32 {
    softmax_exp_body(row, max, scale)
}

/// [`softmax_exp`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_exp_avx2(row: &mut [f32], max: f32, scale: f32) -> f32 {
    softmax_exp_body(row, max, scale)
}

/// The body of [`softmax_exp`], branch-free so that it vectorises.
#[inline(always)]
fn softmax_exp_body(row: &mut [f32], max: f32, scale: f32) -> f32 {
    let (chunks, rest) = row.as_chunks_mut::<16>();
    let mut acc = [0.0f32; 16];
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c.iter_mut()) {
            *v = exp_nonpositive((*v - max) * scale);
            *a += *v;
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for v in rest {
        *v = exp_nonpositive((*v - max) * scale);
        sum += *v;
    }
    sum
}

/// `exp(y)` for `y ≤ 0` (NaN for NaN), without branches: Cody–Waite
/// reduction `y = n ln2 + r`, `|r| ≤ ln2/2`, the degree-6 polynomial of
/// [`gelu`] for `exp(r)`, an exponent shift. Relative error below 2e-7;
/// `y < −87.3` (results below 1.2e-38) gives `exp(−87.3)`, which softmax
/// sums never notice.
#[inline(always)]
fn exp_nonpositive(y: f32) -> f32 {
    const E: [f32; 7] = [1.0, 1.0, 0.499_999_94, 0.166_664_6, 0.041_668_236, 0.008_371_556, 0.001_382_483_4];
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23
    let y = y.max(-87.3);
    // n ≥ −126, so 2^n is normal.
    let big = y.mul_add(std::f32::consts::LOG2_E, ROUND);
    let n = big - ROUND;
    let ni = big.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, y));
    let mut p = E[6];
    for &c in E[..6].iter().rev() {
        p = p.mul_add(r, c);
    }
    p * f32::from_bits(((ni + 127) << 23) as u32)
}

/// `x[t] = LayerNorm(x[t] + residual[t])` (or of `x[t]` alone), each row
/// `(x - mean) / sqrt(var + eps) * w + b` with the population variance.
pub(crate) fn layer_norm_rows(
    pool: &ThreadPool,
    x: &mut [f32],
    residual: Option<&[f32]>,
    w: &[f32],
    b: &[f32],
    eps: f32,
) {
    let d = w.len();
    par_rows(pool, x, d, &|t, row| {
        if let Some(r) = residual {
            add(row, &r[t * d..(t + 1) * d]);
        }
        let mean = sum16(row, |v| v) / d as f32;
        let var = sum16(row, |v| (v - mean) * (v - mean)) / d as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, &wi), &bi) in row.iter_mut().zip(w).zip(b) {
            *v = (*v - mean) * inv * wi + bi;
        }
    });
}

/// The largest element (−∞ for an empty slice; NaNs ignored), with 16
/// partial maxima (so that the loop vectorises).
#[inline]
pub(crate) fn max16(x: &[f32]) -> f32 {
    let (chunks, rest) = x.as_chunks::<16>();
    let mut acc = [f32::NEG_INFINITY; 16];
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    acc.iter().chain(rest).fold(f32::NEG_INFINITY, |a, &v| if v > a { v } else { a })
}

/// `Σ f(x[i])` with 16 partial sums (so that the loop vectorises).
#[inline]
fn sum16(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let (chunks, rest) = x.as_chunks::<16>();
    let mut acc = [0.0f32; 16];
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f(v);
        }
    }
    acc.iter().sum::<f32>() + rest.iter().map(|&v| f(v)).sum::<f32>()
}

/// GELU in its exact form, `x/2 · (1 + erf(x/√2))` (PyTorch's default
/// `gelu`, BERT's `hidden_act = "gelu"`), in f32.
///
/// Written as `relu(x) − |x|/2 · erfc(|x|/√2)`, with `erfc(a/√2) =
/// exp(−a²/2) · g(a)`: `a²` is split exactly into `h + l` with an FMA, so
/// `exp(−a²/2) = exp(−h/2) · (1 − l/2)` keeps full relative precision far
/// into the tail (Cody–Waite reduction, a degree-6 polynomial, an exponent
/// shift), and the scaled complementary error function `g(a) = erfcx(a/√2)`
/// is a (5, 6) rational fit with positive coefficients on `[0, 13.5]`
/// (relative error 7e-11 in exact arithmetic). No branches: the loop over
/// a slice vectorises ([`gelu_slice`]). Relative error against the exact
/// function, measured on a dense grid of `[−13, 13]`: 7.6e-8 RMS, 3.3e-7 at
/// most for `|x| < 2`, 5.1e-7 at most in the far negative tail (the f64
/// formula this replaces: 5.2e-8 RMS, 1.6e-7 at most). For `x < −13`
/// (`|gelu(x)| < 1e-37`) the result is −0.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    const P: [f32; 6] = [1.0, 1.009_671_2, 0.496_346_65, 0.140_587_8, 0.022_829_548, 0.001_731_541];
    const Q: [f32; 7] = [1.0, 1.807_555_8, 1.438_567_6, 0.650_581_7, 0.178_377_15, 0.028_612_375, 0.002_170_169];
    let a = x.abs().min(13.0);
    // a² = h + l exactly; y = −h/2 exactly.
    let h = a * a;
    let l = a.mul_add(a, -h);
    // exp(−h/2) (h ≤ 169, inside exp_nonpositive's clamp), then · exp(−l/2).
    let e = exp_nonpositive(-0.5 * h);
    let e = e.mul_add(-0.5 * l, e);
    // |x|/2 · g(|x|) = (a/2 · P(a)) / Q(a).
    let (mut pp, mut qq) = (P[5], Q[6]);
    for &c in P[..5].iter().rev() {
        pp = pp.mul_add(a, c);
    }
    for &c in Q[..6].iter().rev() {
        qq = qq.mul_add(a, c);
    }
    let tail = e * ((0.5 * a * pp) / qq);
    let tail = if x.abs() > 13.0 { 0.0 } else { tail };
    let g = if x > 0.0 { x - tail } else { -tail };
    if x.is_nan() { x } else { g }
}

/// `x = gelu(x)` for every element, vectorised with AVX-512 or AVX2 + FMA
/// when the CPU has them (the same formula; FMAs round once).
pub fn gelu_slice(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if spinfer_kernels::cpu::CpuFeatures::detect().has_avx512f_fma() {
            // SAFETY: the CPU has AVX-512F and FMA (checked just above, by `CpuFeatures::detect`).
            return unsafe { gelu_avx512(xs) };
        }
        if spinfer_kernels::cpu::CpuFeatures::detect().has_avx2_fma() {
            // SAFETY: the CPU has AVX2 and FMA (checked just above, by `CpuFeatures::detect`).
            return unsafe { gelu_avx2(xs) };
        }
    }
    xs.iter_mut().for_each(|v| *v = gelu(*v));
}

/// [`gelu_slice`] compiled for AVX-512.
///
/// # Safety
/// The CPU must support AVX-512F and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn gelu_avx512(xs: &mut [f32]) {
    xs.iter_mut().for_each(|v| *v = gelu(*v));
}

/// [`gelu_slice`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_avx2(xs: &mut [f32]) {
    xs.iter_mut().for_each(|v| *v = gelu(*v));
}

/// Runs `f(row index, row)` for every `width`-wide row of `data`, the rows
/// split into contiguous ranges over the pool's threads.
pub(crate) fn par_rows(pool: &ThreadPool, data: &mut [f32], width: usize, f: &(dyn Fn(usize, &mut [f32]) + Sync)) {
    let n = data.len() / width;
    let ptr = SyncPtr::new(data.as_mut_ptr());
    pool.broadcast(&|ti, nt| {
        for r in chunk(n, ti, nt) {
            // SAFETY: `chunk` gives each index a disjoint range of rows,
            // each index runs once, and `data` (n * width floats) outlives
            // the broadcast.
            let row = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(r * width), width) };
            f(r, row);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_matches_erf_values() {
        // x/2 (1 + erf(x/√2)) from high-precision erf values.
        for (x, want) in [
            (0.0f32, 0.0f64),
            (1.0, 0.841_344_746_068_542_9),
            (-1.0, -0.158_655_253_931_457_07),
            (2.5, 2.484_475_836_685_559_7),
            (-3.0, -0.004_049_694_094_890_287),
            (-8.0, -4.976_768_459_417_455_5e-15),
        ] {
            let got = f64::from(gelu(x));
            assert!((got - want).abs() <= 3e-7 * want.abs(), "gelu({x}) = {got}, want {want}");
        }
    }

    /// The f64 formula `gelu` replaced (Numerical Recipes' `erfcc`, relative
    /// error below 1.2e-7), as a reference on a dense grid.
    fn gelu_f64(x: f32) -> f32 {
        let x = f64::from(x);
        let u = -x * std::f64::consts::FRAC_1_SQRT_2;
        let z = u.abs();
        let t = 1.0 / (1.0 + 0.5 * z);
        let c = [1.000_023_68, 0.374_091_96, 0.096_784_18, -0.186_288_06, 0.278_868_07, -1.135_203_98, 1.488_515_87];
        let tail = c.iter().rev().fold(-0.822_152_23 + t * 0.170_872_77, |acc, &ci| ci + t * acc);
        let r = t * (-z * z - 1.265_512_23 + t * tail).exp();
        (0.5 * x * if u >= 0.0 { r } else { 2.0 - r }) as f32
    }

    #[test]
    fn gelu_matches_the_f64_formula_on_a_dense_grid() {
        let mut xs: Vec<f32> = (-1_300_000..=1_300_000).map(|i| i as f32 * 1e-5).collect();
        xs.extend((0..2000).flat_map(|i| {
            let m = 10f32.powf(-30.0 + i as f32 * 0.015);
            [m, -m]
        }));
        let mut v = xs.clone();
        gelu_slice(&mut v);
        let mut worst = 0.0f64;
        for (&x, &g) in xs.iter().zip(&v) {
            // The vectorised loop computes the same correctly rounded
            // operations as the scalar function.
            assert_eq!(g.to_bits(), gelu(x).to_bits(), "gelu_slice({x}) = {g}, gelu({x}) = {}", gelu(x));
            let want = f64::from(gelu_f64(x));
            if want.abs() > 1e-35 {
                let rel = (f64::from(g) - want).abs() / want.abs();
                worst = worst.max(rel);
                assert!(rel <= 8e-7, "gelu({x}) = {g}, f64 formula {want} (relative {rel:e})");
            } else {
                assert!(f64::from(g).abs() <= 1e-35, "gelu({x}) = {g}, f64 formula {want}");
            }
        }
        assert!(worst > 0.0);
        for (x, want) in [(20.0f32, 20.0f32), (-20.0, 0.0), (f32::INFINITY, f32::INFINITY), (-f32::INFINITY, 0.0)] {
            assert_eq!(gelu(x), want, "gelu({x})");
        }
        assert!(gelu(f32::NAN).is_nan());
    }

    #[test]
    fn softmax_exp_matches_the_scalar_code_and_exp() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut rand = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        for len in [1usize, 7, 16, 33, 256, 300] {
            let row: Vec<f32> = (0..len).map(|_| (rand() - 0.5) * 60.0).collect();
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let scale = 0.176_776_7;
            let (mut fast, mut slow) = (row.clone(), row.clone());
            let s_fast = softmax_exp(&mut fast, max, scale);
            let s_slow = softmax_exp_body(&mut slow, max, scale);
            // The same operations, dispatched or not (FMAs round once).
            assert_eq!(s_fast.to_bits(), s_slow.to_bits(), "sum, len {len}");
            for (i, ((&f, &s), &x)) in fast.iter().zip(&slow).zip(&row).enumerate() {
                assert_eq!(f.to_bits(), s.to_bits(), "element {i} of {len}");
                let want = (f64::from((x - max) * scale)).exp();
                assert!((f64::from(f) - want).abs() <= 2e-7 * want, "exp({}) = {f}, want {want}", (x - max) * scale);
            }
            let total: f64 = row.iter().map(|&x| (f64::from((x - max) * scale)).exp()).sum();
            assert!((f64::from(s_fast) - total).abs() <= 1e-6 * total, "sum {s_fast}, want {total}");
        }
        let v: Vec<f32> = (0..37).map(|i| ((i * 7919) % 101) as f32 - 50.0).collect();
        assert_eq!(max16(&v), 50.0);
        assert_eq!(max16(&v[..5]), v[..5].iter().copied().fold(f32::NEG_INFINITY, f32::max));
        // Far below the maximum: tiny, never NaN or negative.
        let mut r = [0.0f32, -1000.0, -100.0];
        let s = softmax_exp(&mut r, 0.0, 1.0);
        assert_eq!(r[0], 1.0);
        assert!(r[1] >= 0.0 && r[1] < 1e-37 && r[2] >= 0.0 && r[2] < 1e-37 && s == 1.0 + r[1] + r[2]);
    }
}
