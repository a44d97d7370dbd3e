//! Which part of a phase profile moves with the gates: a two-factor fit of the
//! gate-cycling profiles.
//!
//! Gate cycling measures an accuracy profile `A_d(r)` for every shift `d` of the gates
//! (`d = 0` is the clean model). The pure-shift prediction of [`super::profile`] says
//! `A_d(r) = A_0(r - d)`: the whole profile moves with the gates. It fails when part
//! of the profile is fixed by something the gates do not move, e.g. a binding split
//! by a window boundary at one phase whatever the gates weigh. Three models, each
//! fitted by least squares to all profiles at once (the clean one included):
//!
//! | model | form | free parameters |
//! |---|---|---|
//! | fixed | `A_d(r) = f(r)`: the roll does not move the profile | `P` |
//! | moving | `A_d(r) = g(r - d)`: the whole profile moves with the roll | `P` |
//! | both | `A_d(r) = f(r) * g(r - d)`: a fixed and a moving factor, both must pass | `2P - 1` |
//!
//! `f` and `g` of the product are found by alternating least squares (each step is
//! exact given the other factor), scaled so that `max g = 1`. R^2 is over every
//! (shift, phase) cell against the grand mean. With the cluster bootstrap over
//! logical examples ([`separable_ci`]) a claim such as "the profile is a fixed factor
//! times a moving one" comes with intervals.

use super::bootstrap::{BootstrapCi, PhaseCluster, bootstrap_ci_vec, phase_accuracy};
use super::{AnalysisError, Result};

/// One logical example's outcomes: its clean profile and one profile per shift.
#[derive(Debug, Clone, PartialEq)]
pub struct ShiftCluster {
    /// Clean outcomes per phase (`d = 0`).
    pub base: PhaseCluster,
    /// Outcomes with the gates shifted, in the order of the shifts.
    pub shifted: Vec<PhaseCluster>,
}

/// The three fits of a set of profiles (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct SeparableFit {
    /// R^2 of the fixed-only model.
    pub r2_fixed: f64,
    /// R^2 of the moving-only model (the whole profile moves; `g` fitted).
    pub r2_moving: f64,
    /// R^2 of the product of a fixed and a moving factor.
    pub r2_both: f64,
    /// The product's fixed factor `f(r)` (what the roll does not move).
    pub fixed: Vec<f64>,
    /// The product's moving factor `g(s)` (moves with the roll; `max g = 1`).
    pub moving: Vec<f64>,
}

/// Alternating least-squares sweeps of the product model.
const SWEEPS: usize = 200;

/// `(d, phase r) -> s = r - d mod P`.
fn src(r: usize, d: i64, p: usize) -> usize {
    (r as i64 - d).rem_euclid(p as i64) as usize
}

fn r2(cells: &[(i64, usize, f64)], pred: impl Fn(i64, usize) -> f64) -> f64 {
    let n = cells.len() as f64;
    let mean = cells.iter().map(|c| c.2).sum::<f64>() / n;
    let tot: f64 = cells.iter().map(|c| (c.2 - mean).powi(2)).sum();
    let res: f64 = cells.iter().map(|c| (c.2 - pred(c.0, c.1)).powi(2)).sum();
    if tot <= 0.0 {
        f64::NAN
    } else {
        1.0 - res / tot
    }
}

/// Fit the three models to profiles `(d, A_d)` (each `A_d` of length `P`, `NaN` for a
/// phase without observations; include `d = 0`).
///
/// # Errors
/// No profiles, profiles of different lengths, or fewer than two observed cells.
pub fn separable_fit(profiles: &[(i64, Vec<f64>)]) -> Result<SeparableFit> {
    let p = profiles
        .first()
        .map(|x| x.1.len())
        .ok_or(AnalysisError::Empty { what: "profiles" })?;
    if let Some((d, a)) = profiles.iter().find(|x| x.1.len() != p) {
        return Err(AnalysisError::InvalidParameter {
            name: "profiles",
            reason: format!("shift {d:+} has {} phases, the first has {p}", a.len()),
        });
    }
    let cells: Vec<(i64, usize, f64)> = profiles
        .iter()
        .flat_map(|(d, a)| a.iter().enumerate().map(move |(r, &v)| (*d, r, v)))
        .filter(|c| c.2.is_finite())
        .collect();
    if cells.len() < 2 {
        return Err(AnalysisError::InvalidParameter {
            name: "profiles",
            reason: format!("{} observed (shift, phase) cells; need 2", cells.len()),
        });
    }
    // Least squares of a one-factor model: the mean of the cells mapped to each level.
    let one = |key: &dyn Fn(i64, usize) -> usize| {
        let mut s = vec![0.0; p];
        let mut k = vec![0.0; p];
        for &(d, r, v) in &cells {
            s[key(d, r)] += v;
            k[key(d, r)] += 1.0;
        }
        s.iter()
            .zip(&k)
            .map(|(s, k)| if *k > 0.0 { s / k } else { 0.0 })
            .collect::<Vec<f64>>()
    };
    let f0 = one(&|_, r| r);
    let g0 = one(&|d, r| src(r, d, p));
    let r2_fixed = r2(&cells, |_, r| f0[r]);
    let r2_moving = r2(&cells, |d, r| g0[src(r, d, p)]);
    // The product: start from the moving fit (f = 1) and alternate exact updates.
    let mut f = vec![1.0; p];
    let mut g = g0.clone();
    for _ in 0..SWEEPS {
        let mut num = vec![0.0; p];
        let mut den = vec![0.0; p];
        for &(d, r, v) in &cells {
            let x = g[src(r, d, p)];
            num[r] += v * x;
            den[r] += x * x;
        }
        for r in 0..p {
            f[r] = if den[r] > 0.0 { num[r] / den[r] } else { 0.0 };
        }
        let mut num = vec![0.0; p];
        let mut den = vec![0.0; p];
        for &(d, r, v) in &cells {
            let s = src(r, d, p);
            num[s] += v * f[r];
            den[s] += f[r] * f[r];
        }
        for s in 0..p {
            g[s] = if den[s] > 0.0 { num[s] / den[s] } else { 0.0 };
        }
    }
    let scale = g.iter().cloned().fold(0.0_f64, f64::max);
    if scale > 0.0 {
        g.iter_mut().for_each(|x| *x /= scale);
        f.iter_mut().for_each(|x| *x *= scale);
    }
    let r2_both = r2(&cells, |d, r| f[r] * g[src(r, d, p)]);
    Ok(SeparableFit {
        r2_fixed,
        r2_moving,
        r2_both,
        fixed: f,
        moving: g,
    })
}

/// The pooled profiles of a resample: the clean one (`d = 0`) and one per shift.
pub fn pooled_profiles(deltas: &[i64], s: &[&ShiftCluster]) -> Vec<(i64, Vec<f64>)> {
    let mut out = vec![(0, phase_accuracy(s.iter().map(|c| &c.base)))];
    for (i, &d) in deltas.iter().enumerate() {
        out.push((d, phase_accuracy(s.iter().map(|c| &c.shifted[i]))));
    }
    out
}

/// Intervals of a [`SeparableFit`]: `[r2_fixed, r2_moving, r2_both, fixed.., moving..]`
/// (length `3 + 2P`), a cluster bootstrap over logical examples (each example's clean
/// and shifted outcomes resampled together).
///
/// # Errors
/// Empty clusters, shifts that do not match the clusters, or bad `reps`/`level`.
pub fn separable_ci(
    deltas: &[i64],
    clusters: &[ShiftCluster],
    reps: usize,
    seed: u64,
    level: f64,
) -> Result<Vec<BootstrapCi>> {
    let first = clusters
        .first()
        .ok_or(AnalysisError::Empty { what: "clusters" })?;
    let p = first.base.num_phases();
    if let Some(i) = clusters
        .iter()
        .position(|c| c.shifted.len() != deltas.len())
    {
        return Err(AnalysisError::InvalidParameter {
            name: "clusters",
            reason: format!(
                "example {i} has {} shifted profiles for {} shifts",
                clusters[i].shifted.len(),
                deltas.len()
            ),
        });
    }
    bootstrap_ci_vec(
        clusters,
        |s| match separable_fit(&pooled_profiles(deltas, s)) {
            Ok(fit) => [fit.r2_fixed, fit.r2_moving, fit.r2_both]
                .into_iter()
                .chain(fit.fixed)
                .chain(fit.moving)
                .collect(),
            Err(_) => vec![f64::NAN; 3 + 2 * p],
        },
        reps,
        seed,
        level,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roll(a: &[f64], d: i64) -> Vec<f64> {
        let p = a.len();
        (0..p).map(|r| a[src(r, d, p)]).collect()
    }

    #[test]
    fn a_profile_that_moves_with_the_gates_is_the_moving_model() {
        let g = [1.0, 0.9, 0.2, 1.0, 1.0, 0.5, 1.0, 0.8];
        let profiles: Vec<(i64, Vec<f64>)> = [0, -2, -1, 1, 3]
            .iter()
            .map(|&d| (d, roll(&g, d)))
            .collect();
        let fit = separable_fit(&profiles).unwrap();
        assert!((fit.r2_moving - 1.0).abs() < 1e-12, "{fit:?}");
        assert!((fit.r2_both - 1.0).abs() < 1e-9, "{fit:?}");
        assert!(fit.r2_fixed < 0.5, "{fit:?}");
        for (a, b) in fit.moving.iter().zip(&g) {
            assert!((a - b).abs() < 1e-6, "{fit:?}");
        }
    }

    #[test]
    fn a_fixed_weak_phase_times_a_moving_one_is_separated() {
        // A binding split at phase 7 (fails whatever the gates) and a gate that
        // under-weights offset 2 (moves with the roll).
        let f = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.02];
        let g = [1.0, 1.0, 0.3, 1.0, 1.0, 1.0, 1.0, 1.0];
        let profiles: Vec<(i64, Vec<f64>)> = [0, -3, -2, -1, 1, 2, 3]
            .iter()
            .map(|&d| {
                let gd = roll(&g, d);
                (d, f.iter().zip(&gd).map(|(a, b)| a * b).collect())
            })
            .collect();
        let fit = separable_fit(&profiles).unwrap();
        assert!(fit.r2_both > 0.999, "{fit:?}");
        assert!(fit.r2_moving < fit.r2_both - 0.2, "{fit:?}");
        assert!(fit.r2_fixed < fit.r2_both - 0.2, "{fit:?}");
        assert!(fit.fixed[7] < 0.05, "{fit:?}");
        assert!((fit.moving[2] - 0.3).abs() < 1e-3, "{fit:?}");
    }

    #[test]
    fn profiles_the_roll_does_not_move_are_the_fixed_model() {
        let f = [1.0, 0.1, 1.0, 0.6, 1.0, 1.0, 0.4, 1.0];
        let profiles: Vec<(i64, Vec<f64>)> =
            [0, 1, 2, -1].iter().map(|&d| (d, f.to_vec())).collect();
        let fit = separable_fit(&profiles).unwrap();
        assert!((fit.r2_fixed - 1.0).abs() < 1e-12);
        assert!(fit.r2_both > 0.999);
        assert!(fit.r2_moving < 0.5);
    }

    #[test]
    fn missing_cells_are_skipped_and_bad_input_is_named() {
        let profiles = vec![(0, vec![1.0, f64::NAN, 0.5]), (1, vec![0.5, 1.0, f64::NAN])];
        let fit = separable_fit(&profiles).unwrap();
        assert!(fit.r2_fixed.is_finite());
        assert!(separable_fit(&[]).is_err());
        let bad = vec![(0, vec![1.0, 0.0]), (1, vec![1.0])];
        let e = separable_fit(&bad).unwrap_err().to_string();
        assert!(e.contains("shift +1 has 1 phases"), "{e}");
    }

    #[test]
    fn the_bootstrap_resamples_examples_and_brackets_the_estimate() {
        // 40 examples with a fixed failure at phase 3 and a moving one at 1.
        let deltas = [1i64, 2];
        let p = 4;
        let mut clusters = Vec::new();
        for i in 0..40 {
            let ok = |r: usize, d: i64| {
                let s = src(r, d, p);
                r != 3 && !(s == 1 && i % 4 != 0)
            };
            let prof =
                |d: i64| PhaseCluster::from_correct(&(0..p).map(|r| ok(r, d)).collect::<Vec<_>>());
            clusters.push(ShiftCluster {
                base: prof(0),
                shifted: deltas.iter().map(|&d| prof(d)).collect(),
            });
        }
        let ci = separable_ci(&deltas, &clusters, 200, 7, 0.95).unwrap();
        assert_eq!(ci.len(), 3 + 2 * p);
        assert!(ci[2].estimate > 0.99, "{:?}", ci[2]);
        assert!(ci[2].lo <= ci[2].estimate && ci[2].estimate <= ci[2].hi);
        assert!(ci[3 + 3].estimate < 0.01, "fixed factor at phase 3");
        let e = separable_ci(&[1], &clusters, 10, 1, 0.95)
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 shifted profiles for 1 shifts"), "{e}");
    }
}
