//! The grid-shift test of a phase effect: when the compression grid of run B is offset
//! by `D` tokens against run A (same prompts), a phase effect caused by the grid moves
//! its profile by `D`.
//!
//! With per-phase profiles `a` and `b` (length `P`), `roll(a, k)[r] = a[(r - k) mod P]`
//! and `r(k) = corr(b, roll(a, k))` (Pearson) for `k = 0..P`. The test reports `r(D)`,
//! `r(D) - r(0)` and the best `k` (the largest `r(k)`). Intervals come from a paired
//! cluster bootstrap over logical examples: each example was rendered at every phase
//! in both runs, so a resample draws example indices with replacement and recomputes
//! both profiles from the same drawn examples (ChaCha8 seeded with `seed`); intervals
//! are percentile intervals over the replicates where the statistic is finite, and
//! `P(best k = k)` is the fraction of all replicates whose best shift is `k`.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{AnalysisError, BootstrapCi, PhaseCluster, Result, percentile, phase_accuracy};

/// One logical example's outcomes in both runs (the bootstrap's cluster).
#[derive(Debug, Clone, PartialEq)]
pub struct PairedExample {
    /// Its outcomes per phase in run A (the reference grid).
    pub a: PhaseCluster,
    /// Its outcomes per phase in run B (the grid offset by `D`).
    pub b: PhaseCluster,
}

/// `profile` rolled by `k`: `out[r] = profile[(r - k) mod P]` (numpy's `roll`).
pub fn roll(profile: &[f64], k: usize) -> Vec<f64> {
    let p = profile.len();
    (0..p).map(|r| profile[(r + p - k % p) % p]).collect()
}

/// Pearson correlation of `x` and `y`; NaN when either is constant, they differ in
/// length, have fewer than 2 values or hold a non-finite value.
pub fn pearson(x: &[f64], y: &[f64]) -> f64 {
    let finite = x.iter().chain(y).all(|v| v.is_finite());
    if x.len() != y.len() || x.len() < 2 || !finite {
        return f64::NAN;
    }
    let n = x.len() as f64;
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (u, v) in x.iter().zip(y) {
        sxy += (u - mx) * (v - my);
        sxx += (u - mx) * (u - mx);
        syy += (v - my) * (v - my);
    }
    // A constant profile whose values differ only by rounding counts as constant.
    let tiny = 1e-24 * n;
    if sxx <= tiny || syy <= tiny {
        return f64::NAN;
    }
    (sxy / (sxx * syy).sqrt()).clamp(-1.0, 1.0)
}

/// `r(k) = corr(b, roll(a, k))` for `k = 0..P` (NaN where undefined).
pub fn shift_correlations(a: &[f64], b: &[f64]) -> Vec<f64> {
    (0..a.len()).map(|k| pearson(b, &roll(a, k))).collect()
}

/// The `k` with the largest finite `r[k]` (the smallest such `k` on ties within
/// 1e-12); `None` when no `r[k]` is finite.
pub fn best_shift(r: &[f64]) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (k, &v) in r.iter().enumerate() {
        if v.is_finite() && best.is_none_or(|b| v > r[b] + 1e-12) {
            best = Some(k);
        }
    }
    best
}

/// The test's result: both profiles, `r(k)` and `r(D) - r(0)` with percentile CIs, the
/// best shift and how often each shift is best over the bootstrap replicates.
#[derive(Debug, Clone, PartialEq)]
pub struct GridShift {
    /// Number of phases P.
    pub period: usize,
    /// The grid offset `D` of run B against run A (`0..P`).
    pub offset: usize,
    /// Logical examples (clusters).
    pub n_examples: usize,
    /// Run A's per-phase profile.
    pub profile_a: Vec<BootstrapCi>,
    /// Run B's per-phase profile.
    pub profile_b: Vec<BootstrapCi>,
    /// `r(k)` for `k = 0..P`.
    pub r: Vec<BootstrapCi>,
    /// `r(D) - r(0)`.
    pub r_diff: BootstrapCi,
    /// The best shift on the data (`None`: no `r(k)` defined).
    pub best_k: Option<usize>,
    /// Per `k`: the fraction of the replicates whose best shift is `k` (replicates
    /// without a defined best shift count for no `k`).
    pub best_k_fraction: Vec<f64>,
}

impl GridShift {
    /// `r(D)` with its interval.
    pub fn r_offset(&self) -> &BootstrapCi {
        &self.r[self.offset]
    }

    /// The fraction of the replicates whose best shift is `D`.
    pub fn p_best_is_offset(&self) -> f64 {
        self.best_k_fraction[self.offset]
    }
}

/// The statistics of one sample of examples.
struct Stat {
    a: Vec<f64>,
    b: Vec<f64>,
    r: Vec<f64>,
}

impl Stat {
    fn of(sample: &[&PairedExample]) -> Stat {
        let a = phase_accuracy(sample.iter().map(|e| &e.a));
        let b = phase_accuracy(sample.iter().map(|e| &e.b));
        let r = shift_correlations(&a, &b);
        Stat { a, b, r }
    }
}

/// Checks the examples: at least one, every cluster with `P >= 3` phases in both runs,
/// every phase observed in both runs, `offset < P`, `reps >= 1`, `level` in (0, 1).
fn check(examples: &[PairedExample], offset: usize, reps: usize, level: f64) -> Result<usize> {
    let first = examples
        .first()
        .ok_or(AnalysisError::Empty { what: "examples" })?;
    let p = first.a.num_phases();
    for e in examples {
        for (what, c) in [("run B's phases", &e.b), ("run A's phases", &e.a)] {
            if c.num_phases() != p {
                return Err(AnalysisError::LengthMismatch {
                    left: "run A's first example's phases",
                    left_len: p,
                    right: what,
                    right_len: c.num_phases(),
                });
            }
        }
    }
    let run_a: fn(&PairedExample) -> &PhaseCluster = |e| &e.a;
    let run_b: fn(&PairedExample) -> &PhaseCluster = |e| &e.b;
    for (what, run) in [("run A", run_a), ("run B", run_b)] {
        let seen = (0..p)
            .filter(|&r| examples.iter().any(|e| run(e).counts()[r] > 0))
            .count();
        if p < 3 || seen < p {
            let needed = p.max(3);
            return Err(AnalysisError::TooFewPhases {
                what,
                needed,
                found: seen,
            });
        }
    }
    let bad = |name, reason: String| Err(AnalysisError::InvalidParameter { name, reason });
    if offset >= p {
        return bad("offset", format!("{offset} is not below the period {p}"));
    }
    if reps == 0 {
        return bad("reps", "must be at least 1".into());
    }
    if !(level > 0.0 && level < 1.0) {
        return bad("level", format!("must be in (0, 1), got {level}"));
    }
    Ok(p)
}

/// The percentile interval of the finite `replicates` around `estimate` (NaN bounds
/// when none is finite).
fn interval(estimate: f64, mut replicates: Vec<f64>, reps: usize, level: f64) -> BootstrapCi {
    replicates.retain(|v| v.is_finite());
    let q = |x: f64| percentile(&replicates, x).unwrap_or(f64::NAN);
    BootstrapCi {
        estimate,
        lo: q((1.0 - level) / 2.0),
        hi: q((1.0 + level) / 2.0),
        level,
        reps,
        valid_reps: replicates.len(),
    }
}

/// The grid-shift test of `examples` for run B's grid offset `offset` against run A:
/// `reps` paired cluster-bootstrap replicates (seed `seed`), `level` intervals.
///
/// # Errors
/// No examples; clusters with different numbers of phases; fewer than 3 phases or a
/// phase without an observation in either run; `offset >= P`; `reps == 0`; `level`
/// outside (0, 1).
pub fn grid_shift(
    examples: &[PairedExample],
    offset: usize,
    reps: usize,
    seed: u64,
    level: f64,
) -> Result<GridShift> {
    let p = check(examples, offset, reps, level)?;
    let all: Vec<&PairedExample> = examples.iter().collect();
    let est = Stat::of(&all);
    // Replicates per component: a (P), b (P), r (P), r(D) - r(0) (1).
    let mut comps: Vec<Vec<f64>> = vec![Vec::with_capacity(reps); 3 * p + 1];
    let mut best_counts = vec![0usize; p];
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = examples.len();
    let mut sample: Vec<&PairedExample> = Vec::with_capacity(n);
    for _ in 0..reps {
        sample.clear();
        sample.extend((0..n).map(|_| &examples[rng.random_range(0..n)]));
        let s = Stat::of(&sample);
        let diff = s.r[offset] - s.r[0];
        for (slot, v) in comps.iter_mut().zip(s.a.iter().chain(&s.b).chain(&s.r)) {
            slot.push(*v);
        }
        comps[3 * p].push(diff);
        if let Some(k) = best_shift(&s.r) {
            best_counts[k] += 1;
        }
    }
    let diff = est.r[offset] - est.r[0];
    let estimates = est.a.iter().chain(&est.b).chain(&est.r).chain([&diff]);
    let mut cis: Vec<BootstrapCi> = estimates
        .zip(comps)
        .map(|(&e, v)| interval(e, v, reps, level))
        .collect();
    let r_diff = cis.pop().expect("3P + 1 components");
    let r = cis.split_off(2 * p);
    let profile_b = cis.split_off(p);
    Ok(GridShift {
        period: p,
        offset,
        n_examples: n,
        profile_a: cis,
        profile_b,
        best_k: best_shift(&est.r),
        r,
        r_diff,
        best_k_fraction: best_counts
            .iter()
            .map(|&c| c as f64 / reps as f64)
            .collect(),
    })
}
