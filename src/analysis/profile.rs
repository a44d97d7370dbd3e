//! Agreement between a predicted and an observed phase profile (gate cycling).
//!
//! Gate cycling shifts the learned gates by `delta` offsets; if the gates cause
//! the phase profile, the accuracy profile shifts by `delta` too. The *predicted*
//! profile is the clean profile rotated by `delta` ([`PhaseCluster::shifted`]); the
//! *observed* profile is measured with the shifted gates on the same logical
//! examples. Agreement is summarised by R^2 and MAE over phases, with cluster
//! bootstrap intervals (each logical example, with its predicted and observed
//! outcomes, is one cluster).

use super::bootstrap::{BootstrapCi, PhaseCluster, bootstrap_ci_vec, phase_accuracy};
use super::{AnalysisError, Result, ensure_finite};

fn check_pair(predicted: &[f64], observed: &[f64]) -> Result<()> {
    if predicted.len() != observed.len() {
        return Err(AnalysisError::LengthMismatch {
            left: "predicted",
            left_len: predicted.len(),
            right: "observed",
            right_len: observed.len(),
        });
    }
    if observed.is_empty() {
        return Err(AnalysisError::Empty { what: "observed" });
    }
    ensure_finite("predicted", predicted)?;
    ensure_finite("observed", observed)
}

/// Coefficient of determination of `predicted` for `observed` (same length `P`):
///
/// ```text
/// R^2 = 1 - sum_r (o_r - p_r)^2 / sum_r (o_r - mean(o))^2
/// ```
///
/// This is the R^2 of the prediction itself (no fitted slope or intercept), so it
/// is 1 for a perfect prediction, 0 for predicting the observed mean, and negative
/// for predictions worse than the mean. `NaN` when the observed profile is
/// constant (the denominator is 0), since agreement is then undefined.
///
/// # Errors
/// Length mismatch, empty input or non-finite values.
pub fn r_squared(predicted: &[f64], observed: &[f64]) -> Result<f64> {
    check_pair(predicted, observed)?;
    Ok(r_squared_unchecked(predicted, observed))
}

/// Mean absolute error `sum_r |o_r - p_r| / P`.
///
/// # Errors
/// Length mismatch, empty input or non-finite values.
pub fn mae(predicted: &[f64], observed: &[f64]) -> Result<f64> {
    check_pair(predicted, observed)?;
    Ok(mae_unchecked(predicted, observed))
}

fn r_squared_unchecked(predicted: &[f64], observed: &[f64]) -> f64 {
    let n = observed.len() as f64;
    let mean = observed.iter().sum::<f64>() / n;
    let ss_tot: f64 = observed.iter().map(|o| (o - mean).powi(2)).sum();
    let ss_res: f64 = observed
        .iter()
        .zip(predicted)
        .map(|(o, p)| (o - p).powi(2))
        .sum();
    if ss_tot == 0.0 {
        f64::NAN
    } else {
        1.0 - ss_res / ss_tot
    }
}

fn mae_unchecked(predicted: &[f64], observed: &[f64]) -> f64 {
    observed
        .iter()
        .zip(predicted)
        .map(|(o, p)| (o - p).abs())
        .sum::<f64>()
        / observed.len() as f64
}

/// One logical example's predicted and observed per-phase outcomes.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileCluster {
    /// Outcomes that form the predicted profile (e.g. the clean outcomes shifted by delta).
    pub predicted: PhaseCluster,
    /// Outcomes observed under the intervention.
    pub observed: PhaseCluster,
}

/// Result of [`profile_fit`].
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileFit {
    /// Pooled predicted profile (length `P`).
    pub predicted: Vec<f64>,
    /// Pooled observed profile (length `P`).
    pub observed: Vec<f64>,
    /// R^2 with its percentile bootstrap interval.
    pub r2: BootstrapCi,
    /// MAE with its percentile bootstrap interval (same units as the profiles).
    pub mae: BootstrapCi,
}

/// Profiles pooled over a resample, restricted to phases where both are defined.
fn pooled(s: &[&ProfileCluster]) -> (Vec<f64>, Vec<f64>) {
    let pred = phase_accuracy(s.iter().map(|c| &c.predicted));
    let obs = phase_accuracy(s.iter().map(|c| &c.observed));
    pred.into_iter()
        .zip(obs)
        .filter(|(p, o)| p.is_finite() && o.is_finite())
        .unzip()
}

/// MAE between the pooled profiles of a resample, `NaN` where undefined: the MAE
/// statistic of [`profile_fit`], for a bootstrap when R^2 is undefined (a constant
/// observed profile).
pub fn pooled_mae(s: &[&ProfileCluster]) -> f64 {
    let (a, b) = pooled(s);
    mae(&a, &b).unwrap_or(f64::NAN)
}

/// Several interventions at once: each example holds one [`ProfileCluster`] per
/// intervention (the same count for every example). The pooled profiles of every
/// intervention, concatenated (phases defined in both only).
pub fn concatenated_profiles(s: &[&Vec<ProfileCluster>]) -> (Vec<f64>, Vec<f64>) {
    let mut pred = Vec::new();
    let mut obs = Vec::new();
    for i in 0..s.first().map_or(0, |e| e.len()) {
        let pr = phase_accuracy(s.iter().map(|e| &e[i].predicted));
        let ob = phase_accuracy(s.iter().map(|e| &e[i].observed));
        for (a, b) in pr.into_iter().zip(ob) {
            if a.is_finite() && b.is_finite() {
                pred.push(a);
                obs.push(b);
            }
        }
    }
    (pred, obs)
}

/// R^2 of [`concatenated_profiles`], `NaN` where undefined.
pub fn concatenated_r2(s: &[&Vec<ProfileCluster>]) -> f64 {
    let (a, b) = concatenated_profiles(s);
    r_squared(&a, &b).unwrap_or(f64::NAN)
}

/// MAE of [`concatenated_profiles`], `NaN` where undefined.
pub fn concatenated_mae(s: &[&Vec<ProfileCluster>]) -> f64 {
    let (a, b) = concatenated_profiles(s);
    mae(&a, &b).unwrap_or(f64::NAN)
}

/// R^2 and MAE between the pooled predicted and observed profiles, with cluster
/// bootstrap percentile intervals (examples are clusters; predicted and observed
/// outcomes of an example are resampled together). Phases missing from either
/// profile are skipped.
///
/// # Errors
/// Empty clusters, mismatched phase counts, fewer than two phases defined in both
/// profiles, or bad `reps`/`level`.
pub fn profile_fit(
    clusters: &[ProfileCluster],
    reps: usize,
    seed: u64,
    level: f64,
) -> Result<ProfileFit> {
    let first = clusters
        .first()
        .ok_or(AnalysisError::Empty { what: "clusters" })?;
    let p = first.predicted.num_phases();
    for (i, c) in clusters.iter().enumerate() {
        if c.predicted.num_phases() != p || c.observed.num_phases() != p {
            return Err(AnalysisError::InvalidParameter {
                name: "clusters",
                reason: format!(
                    "cluster {i} has {}/{} predicted/observed phases, expected {p}",
                    c.predicted.num_phases(),
                    c.observed.num_phases()
                ),
            });
        }
    }
    let all: Vec<&ProfileCluster> = clusters.iter().collect();
    let (pred, _) = pooled(&all);
    if pred.len() < 2 {
        return Err(AnalysisError::TooFewPhases {
            what: "profile fit",
            needed: 2,
            found: pred.len(),
        });
    }
    let cis = bootstrap_ci_vec(
        clusters,
        |s| {
            let (p, o) = pooled(s);
            if p.len() < 2 {
                return vec![f64::NAN, f64::NAN];
            }
            vec![r_squared_unchecked(&p, &o), mae_unchecked(&p, &o)]
        },
        reps,
        seed,
        level,
    )?;
    Ok(ProfileFit {
        predicted: phase_accuracy(clusters.iter().map(|c| &c.predicted)),
        observed: phase_accuracy(clusters.iter().map(|c| &c.observed)),
        r2: cis[0],
        mae: cis[1],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn known_values() {
        let obs = [1.0, 2.0, 3.0, 4.0];
        let pred = [1.0, 2.0, 3.0, 5.0];
        assert!((r_squared(&pred, &obs).unwrap() - 0.8).abs() < 1e-12);
        assert!((mae(&pred, &obs).unwrap() - 0.25).abs() < 1e-12);
        assert_eq!(r_squared(&obs, &obs).unwrap(), 1.0);
        assert_eq!(r_squared(&[2.5; 4], &obs).unwrap(), 0.0);
        // Anti-correlated prediction is worse than the mean.
        assert!(r_squared(&[4.0, 3.0, 2.0, 1.0], &obs).unwrap() < 0.0);
        assert!(r_squared(&[1.0, 2.0], &[3.0, 3.0]).unwrap().is_nan());
    }

    #[test]
    fn input_errors() {
        assert!(matches!(
            r_squared(&[1.0], &[1.0, 2.0]),
            Err(AnalysisError::LengthMismatch { .. })
        ));
        assert!(matches!(mae(&[], &[]), Err(AnalysisError::Empty { .. })));
        assert!(matches!(
            mae(&[f64::NAN], &[1.0]),
            Err(AnalysisError::NonFinite {
                what: "predicted",
                ..
            })
        ));
    }

    /// Clean profile with a weak phase; the intervention moves it by `delta`.
    fn cycling_clusters(n: usize, delta: i64, true_shift: i64, seed: u64) -> Vec<ProfileCluster> {
        let p = 8usize;
        let profile: Vec<f64> = (0..p).map(|r| 0.3 + 0.08 * r as f64).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let clean: Vec<bool> = profile.iter().map(|&q| rng.random::<f64>() < q).collect();
                let shifted: Vec<bool> = (0..p)
                    .map(|r| {
                        let src = (r as i64 - true_shift).rem_euclid(p as i64) as usize;
                        rng.random::<f64>() < profile[src]
                    })
                    .collect();
                ProfileCluster {
                    predicted: PhaseCluster::from_correct(&clean).shifted(delta),
                    observed: PhaseCluster::from_correct(&shifted),
                }
            })
            .collect()
    }

    #[test]
    fn cycling_prediction_fits_when_shift_matches() {
        let good = profile_fit(&cycling_clusters(400, 2, 2, 1), 500, 5, 0.95).unwrap();
        assert!(good.r2.estimate > 0.8, "{good:?}");
        assert!(good.r2.contains(good.r2.estimate) && good.mae.contains(good.mae.estimate));
        assert!(good.mae.estimate < 0.05);
        let bad = profile_fit(&cycling_clusters(400, -2, 2, 1), 500, 5, 0.95).unwrap();
        assert!(bad.r2.estimate < 0.0, "{bad:?}");
        assert!(bad.r2.hi < good.r2.lo);
        // Deterministic under the seed.
        let again = profile_fit(&cycling_clusters(400, 2, 2, 1), 500, 5, 0.95).unwrap();
        assert_eq!(good, again);
    }

    #[test]
    fn fit_rejects_degenerate_inputs() {
        assert!(profile_fit(&[], 10, 0, 0.95).is_err());
        let one_phase = vec![ProfileCluster {
            predicted: PhaseCluster::from_values(&[1.0, f64::NAN]),
            observed: PhaseCluster::from_values(&[1.0, 0.0]),
        }];
        assert!(matches!(
            profile_fit(&one_phase, 10, 0, 0.95),
            Err(AnalysisError::TooFewPhases { .. })
        ));
    }
}
