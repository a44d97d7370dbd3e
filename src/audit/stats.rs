//! The audit's own statistics (pure functions); everything else comes from
//! [`crate::analysis`] (cluster bootstrap, selection-adjusted phase gap, Wilson).
//!
//! - [`flatness_test`]: a permutation test of "accuracy does not depend on the phase".
//!   Every logical example is rendered once at every phase, so under the null its P
//!   outcomes are exchangeable: the test shuffles them within each example and
//!   compares the observed range of the per-phase accuracies (the phase gap) with the
//!   shuffled ones.
//! - [`shift_flips`]: the shift-invariance statistic: the fraction of logical examples
//!   whose correctness is not the same at every shift.
//! - [`logical_for_width`]: logical examples per phase that a requested CI width needs.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

/// One logical example's outcome at each phase (`None`: not observed).
pub type Row = Vec<Option<bool>>;

/// The range (max - min) of the per-phase means, in pp; phases without observations
/// are left out. `NaN` with fewer than two observed phases.
pub fn range_pp(rows: &[Row], p: usize) -> f64 {
    let mut sum = vec![0u64; p];
    let mut n = vec![0u64; p];
    for r in rows {
        for (ph, o) in r.iter().enumerate().take(p) {
            if let Some(ok) = o {
                n[ph] += 1;
                sum[ph] += u64::from(*ok);
            }
        }
    }
    let acc: Vec<f64> = (0..p)
        .filter(|&i| n[i] > 0)
        .map(|i| sum[i] as f64 / n[i] as f64)
        .collect();
    if acc.len() < 2 {
        return f64::NAN;
    }
    let hi = acc.iter().cloned().fold(f64::MIN, f64::max);
    let lo = acc.iter().cloned().fold(f64::MAX, f64::min);
    100.0 * (hi - lo)
}

/// Result of the permutation test of flatness (`flatness_test`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Flatness {
    /// Observed range of the per-phase accuracies (pp).
    pub statistic_pp: f64,
    /// `(1 + #{shuffled >= observed}) / (1 + permutations)`.
    pub p_value: f64,
    /// Permutations drawn.
    pub permutations: usize,
}

/// Permutation test of flatness (see the module doc). Deterministic in `seed`.
pub fn flatness_test(rows: &[Row], p: usize, permutations: usize, seed: u64) -> Flatness {
    let observed = range_pp(rows, p);
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xf1a7_7e57);
    let mut shuffled: Vec<Row> = rows.to_vec();
    let mut at_least = 0usize;
    for _ in 0..permutations {
        for (r, orig) in shuffled.iter_mut().zip(rows) {
            // Only observed cells are exchanged, so a missing phase stays missing.
            let mut vals: Vec<bool> = orig.iter().flatten().copied().collect();
            vals.shuffle(&mut rng);
            let mut it = vals.into_iter();
            for (slot, o) in r.iter_mut().zip(orig) {
                if o.is_some() {
                    *slot = it.next();
                }
            }
        }
        // A tolerance keeps ties (the common case with 0/1 outcomes) counted as ties.
        if range_pp(&shuffled, p) >= observed - 1e-9 {
            at_least += 1;
        }
    }
    Flatness {
        statistic_pp: observed,
        p_value: if observed.is_finite() {
            (1 + at_least) as f64 / (1 + permutations) as f64
        } else {
            f64::NAN
        },
        permutations,
    }
}

/// `(flipping examples, examples)`: examples observed at two or more shifts whose
/// correctness differs between shifts.
pub fn shift_flips(rows: &[Row]) -> (u64, u64) {
    let mut flips = 0;
    let mut n = 0;
    for r in rows {
        let seen: Vec<bool> = r.iter().flatten().copied().collect();
        if seen.len() < 2 {
            continue;
        }
        n += 1;
        if seen.iter().any(|&b| b != seen[0]) {
            flips += 1;
        }
    }
    (flips, n)
}

/// Logical examples per phase for a 95% CI of full width `width_pp` on the
/// difference of two phases' accuracies in the worst case (p = 0.5, independent
/// phases): `2 z^2 (0.5)^2 ... = 0.5 (2 z / w)^2`.
pub fn logical_for_width(width_pp: f64) -> usize {
    let w = (width_pp / 100.0).max(1e-6);
    let z = crate::analysis::Z95;
    (0.5 * (2.0 * z / w).powi(2)).ceil() as usize
}

/// The worst-case full CI width (pp) `n` logical examples per phase give
/// (inverse of [`logical_for_width`]).
pub fn width_for_logical(n: usize) -> f64 {
    let z = crate::analysis::Z95;
    100.0 * 2.0 * z * (0.5 / n.max(1) as f64).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows_from(acc: &[f64], n: usize, seed: u64) -> Vec<Row> {
        use rand::Rng;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n)
            .map(|_| acc.iter().map(|&a| Some(rng.random::<f64>() < a)).collect())
            .collect()
    }

    #[test]
    fn a_real_phase_gap_is_detected_and_a_flat_profile_is_not() {
        let gap = rows_from(&[0.9, 0.9, 0.9, 0.2], 64, 1);
        let t = flatness_test(&gap, 4, 500, 0);
        assert!(t.statistic_pp > 50.0 && t.p_value < 0.01, "{t:?}");
        let flat = rows_from(&[0.6, 0.6, 0.6, 0.6], 64, 2);
        let t = flatness_test(&flat, 4, 500, 0);
        assert!(t.p_value > 0.05, "{t:?}");
        // Same seed, same answer.
        assert_eq!(t, flatness_test(&flat, 4, 500, 0));
    }

    #[test]
    fn constant_outcomes_have_a_zero_range_and_p_value_one() {
        let rows: Vec<Row> = (0..10).map(|_| vec![Some(true); 4]).collect();
        let t = flatness_test(&rows, 4, 200, 0);
        assert_eq!(t.statistic_pp, 0.0);
        assert_eq!(t.p_value, 1.0);
    }

    #[test]
    fn flips_count_examples_whose_correctness_depends_on_the_shift() {
        let rows = vec![
            vec![Some(true), Some(true)],
            vec![Some(true), Some(false)],
            vec![Some(false), None],
            vec![Some(false), Some(false)],
        ];
        assert_eq!(shift_flips(&rows), (1, 3));
    }

    #[test]
    fn ci_width_and_sample_size_are_inverse() {
        let n = logical_for_width(30.0);
        assert!(width_for_logical(n) <= 30.0 && width_for_logical(n - 1) > 30.0);
        assert_eq!(logical_for_width(30.0), 86);
    }
}
