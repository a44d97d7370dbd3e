//! Wilson score interval for a binomial proportion.

/// The two-sided 95% standard-normal quantile, `Phi^-1(0.975)`.
pub const Z95: f64 = 1.959_963_984_540_054;

/// Wilson score interval for `correct` successes out of `n` trials.
///
/// With `p = correct / n` and quantile `z` (use [`Z95`] for 95%):
///
/// ```text
/// centre = (p + z^2 / (2n)) / (1 + z^2 / n)
/// half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / (4 n^2))
/// (lo, hi) = (centre - half, centre + half), clamped to [0, 1]
/// ```
///
/// Unlike the Wald interval it stays inside `[0, 1]` and is non-degenerate at
/// `p = 0` and `p = 1` (0/10 gives `(0, 0.2775)`). With `n = 0` there is no
/// information and the interval is `(0, 1)`.
///
/// # Panics
/// If `correct > n` or `z` is not a positive finite number (programming errors).
///
/// Example: `wilson(8, 10, Z95)` is `(0.4902, 0.9433)` to four decimals.
pub fn wilson(correct: u64, n: u64, z: f64) -> (f64, f64) {
    assert!(correct <= n, "wilson: correct ({correct}) > n ({n})");
    assert!(
        z.is_finite() && z > 0.0,
        "wilson: z must be positive, got {z}"
    );
    if n == 0 {
        return (0.0, 1.0);
    }
    let n_f = n as f64;
    let p = correct as f64 / n_f;
    let z2 = z * z;
    let denom = 1.0 + z2 / n_f;
    let centre = (p + z2 / (2.0 * n_f)) / denom;
    let half = z / denom * (p * (1.0 - p) / n_f + z2 / (4.0 * n_f * n_f)).sqrt();
    // Exact endpoints at the boundaries (avoid -1e-17 style rounding).
    let lo = if correct == 0 {
        0.0
    } else {
        (centre - half).max(0.0)
    };
    let hi = if correct == n {
        1.0
    } else {
        (centre + half).min(1.0)
    };
    (lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() < tol
    }

    #[test]
    fn known_values() {
        let (lo, hi) = wilson(8, 10, Z95);
        assert!(
            close(lo, 0.4902, 1e-4) && close(hi, 0.9433, 1e-4),
            "{lo} {hi}"
        );
        // 5/10: symmetric around 0.5, (0.2366, 0.7634).
        let (lo, hi) = wilson(5, 10, Z95);
        assert!(
            close(lo, 0.2366, 1e-4) && close(hi, 0.7634, 1e-4),
            "{lo} {hi}"
        );
        // 50/100 -> (0.4038, 0.5962).
        let (lo, hi) = wilson(50, 100, Z95);
        assert!(
            close(lo, 0.4038, 1e-4) && close(hi, 0.5962, 1e-4),
            "{lo} {hi}"
        );
        // 1/3 with z = 1.96 -> (0.0615, 0.7923).
        let (lo, hi) = wilson(1, 3, 1.96);
        assert!(
            close(lo, 0.0615, 1e-4) && close(hi, 0.7923, 1e-4),
            "{lo} {hi}"
        );
    }

    #[test]
    fn boundaries() {
        let (lo, hi) = wilson(0, 10, Z95);
        assert_eq!(lo, 0.0);
        assert!(close(hi, 0.2775, 1e-4), "{hi}");
        let (lo, hi) = wilson(10, 10, Z95);
        assert!(close(lo, 0.7225, 1e-4), "{lo}");
        assert_eq!(hi, 1.0);
        assert_eq!(wilson(0, 0, Z95), (0.0, 1.0));
    }

    #[test]
    fn narrows_with_n_and_contains_p() {
        let mut last_width = f64::INFINITY;
        for n in [10u64, 100, 1000, 10000] {
            let (lo, hi) = wilson(n * 3 / 10, n, Z95);
            assert!(lo < 0.3 && 0.3 < hi);
            assert!(hi - lo < last_width);
            last_width = hi - lo;
        }
    }

    #[test]
    #[should_panic(expected = "correct")]
    fn rejects_more_correct_than_trials() {
        let _ = wilson(11, 10, Z95);
    }
}
