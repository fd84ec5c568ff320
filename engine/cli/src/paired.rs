//! What alternating sparse/dense rounds say: the median per-round ratio,
//! a distribution-free 95% confidence interval for it, and a sign test of
//! "neither is faster". This VM's round-to-round spread (±25%) is far
//! larger than the few percent a sparse configuration gains, so a median
//! alone does not tell a gain from noise.

/// Summary of per-round ratios (sparse / dense tokens per second).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Paired {
    pub rounds: usize,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    /// Distribution-free 95% interval for the median (order statistics);
    /// `None` below 6 rounds, where no such interval reaches 95%.
    pub ci95: Option<(f64, f64)>,
    /// Rounds with a ratio above 1.
    pub faster: usize,
    /// Two-sided sign test p-value of "sparse is as likely to be faster
    /// as slower" (rounds with a ratio of exactly 1 are dropped).
    pub sign_p: f64,
}

impl Paired {
    /// Summarises `ratios` (at least one).
    pub fn of(ratios: &[f64]) -> Self {
        let mut v = ratios.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let faster = v.iter().filter(|&&r| r > 1.0).count();
        let slower = v.iter().filter(|&&r| r < 1.0).count();
        Paired {
            rounds: n,
            median: v[n / 2],
            min: v[0],
            max: v[n - 1],
            ci95: median_ci95(n).map(|(lo, hi)| (v[lo], v[hi])),
            faster,
            sign_p: sign_test(faster, faster + slower),
        }
    }
}

/// P(X ≤ k) for X ~ Binomial(n, 1/2).
fn binom_cdf(k: usize, n: usize) -> f64 {
    // Terms C(n, i) / 2^n by the ratio C(n, i+1) = C(n, i) (n - i) / (i + 1),
    // in logs so large n does not underflow.
    let mut log_term = -(n as f64) * std::f64::consts::LN_2;
    let mut sum = 0.0;
    for i in 0..=k.min(n) {
        sum += log_term.exp();
        log_term += ((n - i) as f64).ln() - ((i + 1) as f64).ln();
    }
    sum.min(1.0)
}

/// Two-sided sign test: `k` successes in `n` fair trials.
fn sign_test(k: usize, n: usize) -> f64 {
    if n == 0 {
        return 1.0;
    }
    let tail = binom_cdf(k.min(n - k), n);
    (2.0 * tail).min(1.0)
}

/// 0-based ranks `(lo, hi)` of the sorted sample bounding a 95% interval
/// for the median: the largest `j` with P(X < j) ≤ 0.025, X ~ Bin(n, 1/2),
/// gives `[x_(j), x_(n-1-j)]`.
fn median_ci95(n: usize) -> Option<(usize, usize)> {
    let j = (0..n / 2).take_while(|&j| j == 0 || binom_cdf(j - 1, n) <= 0.025).last()?;
    (j > 0).then(|| (j - 1, n - j))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binomial_tails_match_tables() {
        assert!((binom_cdf(0, 10) - 1.0 / 1024.0).abs() < 1e-12);
        assert!((binom_cdf(5, 10) - 638.0 / 1024.0).abs() < 1e-12);
        assert!((binom_cdf(10, 10) - 1.0).abs() < 1e-12);
        // 10 of 10 faster: p = 2 / 1024; 15 of 20: p = 0.0414.
        assert!((sign_test(10, 10) - 2.0 / 1024.0).abs() < 1e-12);
        assert!((sign_test(15, 20) - 0.041_389).abs() < 1e-5);
        assert!((sign_test(5, 20) - 0.041_389).abs() < 1e-5);
        assert_eq!(sign_test(10, 20), 1.0);
        assert_eq!(sign_test(0, 0), 1.0);
    }

    #[test]
    fn median_interval_uses_the_order_statistics_of_the_tables() {
        // n = 20: x_(6)..x_(15) (1-based), 95.9%; n = 40: x_(14)..x_(27).
        assert_eq!(median_ci95(20), Some((5, 14)));
        assert_eq!(median_ci95(40), Some((13, 26)));
        assert_eq!(median_ci95(5), None);
        assert_eq!(median_ci95(6), Some((0, 5)));
        let ratios: Vec<f64> = (0..20).rev().map(|i| 0.905 + 0.01 * f64::from(i)).collect();
        let p = Paired::of(&ratios);
        assert_eq!((p.rounds, p.faster), (20, 10));
        assert!((p.median - 1.005).abs() < 1e-12 && (p.min - 0.905).abs() < 1e-12 && (p.max - 1.095).abs() < 1e-12);
        let (lo, hi) = p.ci95.unwrap();
        assert!((lo - 0.955).abs() < 1e-12 && (hi - 1.045).abs() < 1e-12, "{lo} {hi}");
        assert_eq!(p.sign_p, 1.0);
    }
}
