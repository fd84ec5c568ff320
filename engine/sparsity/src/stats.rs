//! Log-scale activation histograms: what calibration (of the Llama FFN and
//! of BERT's) collects and takes quantiles of.

/// Histogram bins: `log2 |a|` from `LO` to `HI` in steps of `1/STEPS`;
/// values below `2^LO` (and exact zeros) land in bin 0.
const LO: f32 = -40.0;
const HI: f32 = 16.0;
const STEPS: f32 = 64.0;
pub const BINS: usize = ((HI - LO) * STEPS) as usize + 1;

/// The bin of `|a|`.
pub fn bin_of(a: f32) -> usize {
    let a = a.abs();
    if a <= 0.0 || !a.is_finite() {
        return if a.is_finite() { 0 } else { BINS - 1 };
    }
    (((a.log2() - LO) * STEPS).max(0.0) as usize).min(BINS - 1)
}

/// The value whose fraction of samples below equals `q` (log-linear
/// interpolation inside the bin).
pub fn quantile(hist: &[u64], q: f64) -> f32 {
    let total: u64 = hist.iter().sum();
    if total == 0 {
        return 0.0;
    }
    let want = q * total as f64;
    let mut below = 0u64;
    for (b, &count) in hist.iter().enumerate() {
        if count > 0 && (below + count) as f64 >= want {
            let frac = ((want - below as f64) / count as f64).clamp(0.0, 1.0) as f32;
            if b == 0 {
                return 0.0;
            }
            return (LO + (b as f32 + frac) / STEPS).exp2();
        }
        below += count;
    }
    (HI).exp2()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_of_a_known_distribution() {
        let mut h = vec![0u64; BINS];
        // 1000 samples at each of 2^-4, 2^-2, 2^0, 2^2.
        for e in [-4.0f32, -2.0, 0.0, 2.0] {
            h[bin_of(e.exp2())] += 1000;
        }
        let q = |p| quantile(&h, p);
        assert!(q(0.25) <= 2f32.powf(-4.0 + 1.0 / STEPS) && q(0.25) >= 2f32.powf(-4.0));
        assert!(q(0.5) >= 0.25 && q(0.5) < 0.25 * 1.02);
        assert!(q(0.99) >= 4.0 && q(0.99) < 4.0 * 1.02);
        assert_eq!(quantile(&vec![0; BINS], 0.5), 0.0);
        assert_eq!(bin_of(0.0), 0);
        assert_eq!(bin_of(f32::INFINITY), BINS - 1);
    }
}
