//! Effect sizes of interventions.

/// Smallest `|ld_clean - ld_corrupt|` for which a normalised logit difference is
/// defined. Below it the clean and corrupted runs are indistinguishable and the
/// ratio would only amplify noise.
pub const MIN_LOGIT_DIFF_DENOM: f64 = 1e-6;

/// Normalised logit difference of an activation-patching run:
///
/// ```text
/// NLD = (ld_patched - ld_corrupt) / (ld_clean - ld_corrupt)
/// ```
///
/// where `ld` is the logit difference between the clean answer and the corrupted
/// answer (`logit(clean) - logit(corrupt)`) in each run. 0 means the patch left the
/// corrupted behaviour, 1 means it fully restored the clean behaviour (denoising);
/// values outside `[0, 1]` are possible (over-restoration, harm). `None` when
/// `|ld_clean - ld_corrupt| < MIN_LOGIT_DIFF_DENOM` or any input is not finite.
///
/// Example: `normalized_logit_diff(2.0, 5.0, -1.0)` is `Some(0.5)`.
pub fn normalized_logit_diff(ld_patched: f64, ld_clean: f64, ld_corrupt: f64) -> Option<f64> {
    let denom = ld_clean - ld_corrupt;
    if !(ld_patched.is_finite() && denom.is_finite()) || denom.abs() < MIN_LOGIT_DIFF_DENOM {
        return None;
    }
    Some((ld_patched - ld_corrupt) / denom)
}

/// Relative change in percent, `100 * (x - clean) / clean` (the paper's knockout
/// metric: -100 means the intervention destroyed all of the clean accuracy).
/// `None` when `clean == 0` (the change is undefined) or an input is not finite.
pub fn relative_change_pct(x: f64, clean: f64) -> Option<f64> {
    if clean == 0.0 || !x.is_finite() || !clean.is_finite() {
        return None;
    }
    Some(100.0 * (x - clean) / clean)
}

/// [`normalized_logit_diff`] of summed `(LD_patched, LD_clean, LD_corrupted)` over `n`
/// prompts (the means' NLD; NaN when undefined): the estimator the patching kinds
/// bootstrap.
pub fn nld_of_sums(s: &[f64; 3], n: u64) -> f64 {
    let k = n as f64;
    normalized_logit_diff(s[0] / k, s[1] / k, s[2] / k).unwrap_or(f64::NAN)
}

/// [`relative_change_pct`] of summed `(edited, clean)` outcomes (NaN when undefined):
/// the ablation kinds' estimator.
pub fn rel_change_of_sums(s: &[f64; 2], _n: u64) -> f64 {
    relative_change_pct(s[0], s[1]).unwrap_or(f64::NAN)
}

/// The mean of the first of summed `(edited, clean)` outcomes over `n` prompts (the
/// edited run's accuracy when the outcomes are 0/1).
pub fn rate_of_sums(s: &[f64; 2], n: u64) -> f64 {
    s[0] / n as f64
}

/// Mean and sample standard deviation (0 for fewer than two values).
pub fn mean_sd(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let sd = if v.len() > 1 {
        (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    (mean, sd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nld_known_values() {
        assert_eq!(normalized_logit_diff(2.0, 5.0, -1.0), Some(0.5));
        assert_eq!(normalized_logit_diff(-1.0, 5.0, -1.0), Some(0.0));
        assert_eq!(normalized_logit_diff(5.0, 5.0, -1.0), Some(1.0));
        assert_eq!(normalized_logit_diff(8.0, 5.0, -1.0), Some(1.5));
        // Sign-agnostic: works when the clean run prefers the "corrupt" answer less.
        assert_eq!(normalized_logit_diff(0.0, -2.0, 2.0), Some(0.5));
    }

    #[test]
    fn nld_guards() {
        assert_eq!(normalized_logit_diff(1.0, 3.0, 3.0), None);
        assert_eq!(normalized_logit_diff(1.0, 3.0, 3.0 + 1e-9), None);
        assert_eq!(normalized_logit_diff(f64::NAN, 3.0, 1.0), None);
        assert_eq!(normalized_logit_diff(1.0, f64::INFINITY, 1.0), None);
    }

    #[test]
    fn relative_change_known_values() {
        assert_eq!(relative_change_pct(0.3, 0.6), Some(-50.0));
        assert_eq!(
            relative_change_pct(0.9, 0.6).map(|v| (v * 1e9).round() / 1e9),
            Some(50.0)
        );
        assert_eq!(relative_change_pct(0.0, 0.5), Some(-100.0));
        assert_eq!(relative_change_pct(0.5, 0.0), None);
        assert_eq!(relative_change_pct(f64::NAN, 0.5), None);
    }
}
