//! Cluster bootstrap over logical examples.
//!
//! A *logical example* (one set of bindings and one query) is rendered at several
//! phases; its outcomes at different phases are correlated, so the unit of
//! resampling is the example, not the prompt. Each example is a *cluster*; a
//! bootstrap replicate draws `n` clusters with replacement from the `n` observed
//! clusters (seeded ChaCha8 RNG, so results are reproducible) and recomputes the
//! statistic on the resample. Intervals are percentile intervals: for level `L`,
//! `(Q((1-L)/2), Q((1+L)/2))` of the replicate distribution, with `Q` the
//! linear-interpolation quantile ([`percentile`]). Replicates whose statistic is
//! not finite (for example a resample missing a phase entirely) are dropped and
//! counted in [`BootstrapCi::valid_reps`].
//!
//! [`phase_gap`] is the paper's headline statistic: the largest difference between
//! per-phase accuracies, in percentage points, with two intervals (see its docs
//! for why the selection-adjusted one is the default).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{AnalysisError, Result};

/// Default number of bootstrap replicates (as in the paper).
pub const DEFAULT_REPS: usize = 2000;
/// Default two-sided confidence level.
pub const DEFAULT_LEVEL: f64 = 0.95;

/// Outcomes of one logical example, aggregated per phase.
///
/// Shape: `sums[r]` is the sum of the outcome values observed at phase `r`
/// (1.0 = correct, 0.0 = wrong for accuracy; any real value for other metrics),
/// `counts[r]` the number of observations; both have length `P`. A phase the
/// example was not rendered at has `counts[r] == 0`.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseCluster {
    sums: Vec<f64>,
    counts: Vec<u64>,
}

impl PhaseCluster {
    /// An empty cluster over `num_phases` phases.
    pub fn new(num_phases: usize) -> Self {
        Self {
            sums: vec![0.0; num_phases],
            counts: vec![0; num_phases],
        }
    }

    /// One correct/wrong outcome per phase (`correct[r]` is the outcome at phase `r`).
    pub fn from_correct(correct: &[bool]) -> Self {
        Self {
            sums: correct.iter().map(|&c| if c { 1.0 } else { 0.0 }).collect(),
            counts: vec![1; correct.len()],
        }
    }

    /// One value per phase; `NaN` marks a phase without an observation.
    pub fn from_values(values: &[f64]) -> Self {
        Self {
            sums: values
                .iter()
                .map(|&v| if v.is_nan() { 0.0 } else { v })
                .collect(),
            counts: values.iter().map(|v| u64::from(!v.is_nan())).collect(),
        }
    }

    /// Aggregates `(phase, value)` observations.
    ///
    /// # Errors
    /// [`AnalysisError::PhaseOutOfRange`] or [`AnalysisError::NonFinite`].
    pub fn from_observations(
        num_phases: usize,
        observations: impl IntoIterator<Item = (usize, f64)>,
    ) -> Result<Self> {
        let mut cluster = Self::new(num_phases);
        for (phase, value) in observations {
            cluster.observe(phase, value)?;
        }
        Ok(cluster)
    }

    /// Adds one observation `value` at `phase`.
    ///
    /// # Errors
    /// [`AnalysisError::PhaseOutOfRange`] or [`AnalysisError::NonFinite`].
    pub fn observe(&mut self, phase: usize, value: f64) -> Result<()> {
        if phase >= self.sums.len() {
            return Err(AnalysisError::PhaseOutOfRange {
                phase,
                num_phases: self.sums.len(),
            });
        }
        if !value.is_finite() {
            return Err(AnalysisError::NonFinite {
                what: "observation",
                index: phase,
                value,
            });
        }
        self.sums[phase] += value;
        self.counts[phase] += 1;
        Ok(())
    }

    /// Number of phases `P`.
    pub fn num_phases(&self) -> usize {
        self.sums.len()
    }

    /// Per-phase sums of outcome values (length `P`).
    pub fn sums(&self) -> &[f64] {
        &self.sums
    }

    /// Per-phase observation counts (length `P`).
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    /// The cluster with phases rotated by `delta`: the outcome at phase `r` moves to
    /// phase `(r + delta) mod P`. Used to predict the profile after shifting the
    /// gates by `delta` offsets.
    pub fn shifted(&self, delta: i64) -> Self {
        let p = self.sums.len();
        if p == 0 {
            return self.clone();
        }
        let mut out = Self::new(p);
        for r in 0..p {
            let to = (r as i64 + delta).rem_euclid(p as i64) as usize;
            out.sums[to] = self.sums[r];
            out.counts[to] = self.counts[r];
        }
        out
    }
}

/// Per-phase mean outcome (accuracy for 0/1 outcomes) pooled over `clusters`:
/// `acc[r] = sum_c sums_c[r] / sum_c counts_c[r]`, `NaN` where no cluster has an
/// observation at `r`. The length is the largest `P` among the clusters.
pub fn phase_accuracy<'a>(clusters: impl IntoIterator<Item = &'a PhaseCluster>) -> Vec<f64> {
    let mut sums: Vec<f64> = Vec::new();
    let mut counts: Vec<u64> = Vec::new();
    for c in clusters {
        if c.sums.len() > sums.len() {
            sums.resize(c.sums.len(), 0.0);
            counts.resize(c.sums.len(), 0);
        }
        for (r, (&s, &k)) in c.sums.iter().zip(&c.counts).enumerate() {
            sums[r] += s;
            counts[r] += k;
        }
    }
    sums.iter()
        .zip(&counts)
        .map(|(&s, &k)| if k == 0 { f64::NAN } else { s / k as f64 })
        .collect()
}

/// A bootstrap percentile interval around a point estimate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BootstrapCi {
    /// The statistic on the full (non-resampled) data.
    pub estimate: f64,
    /// Lower bound, the `(1 - level) / 2` quantile of the replicates.
    pub lo: f64,
    /// Upper bound, the `(1 + level) / 2` quantile of the replicates.
    pub hi: f64,
    /// Two-sided confidence level, e.g. 0.95.
    pub level: f64,
    /// Replicates drawn.
    pub reps: usize,
    /// Replicates with a finite statistic (the ones the interval is computed from).
    pub valid_reps: usize,
}

impl BootstrapCi {
    /// Whether `x` lies in `[lo, hi]`.
    pub fn contains(&self, x: f64) -> bool {
        self.lo <= x && x <= self.hi
    }
}

/// Linear-interpolation quantile (type 7 of Hyndman and Fan, the default of R and
/// numpy) of `values` at `q` in `[0, 1]`: with the values sorted ascending as
/// `v[0..n]`, `h = q (n - 1)`, `Q = v[floor h] + (h - floor h) (v[floor h + 1] - v[floor h])`.
/// Returns `None` for an empty slice or a `q` outside `[0, 1]`. NaNs sort last.
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() || !(0.0..=1.0).contains(&q) {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    Some(percentile_sorted(&sorted, q))
}

/// [`percentile`] on an already sorted, non-empty slice.
fn percentile_sorted(sorted: &[f64], q: f64) -> f64 {
    let h = q * (sorted.len() - 1) as f64;
    let lo = h.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] + (h - lo as f64) * (sorted[hi] - sorted[lo])
}

fn check_params(n_clusters: usize, reps: usize, level: f64) -> Result<()> {
    if n_clusters == 0 {
        return Err(AnalysisError::Empty { what: "clusters" });
    }
    if reps == 0 {
        return Err(AnalysisError::InvalidParameter {
            name: "reps",
            reason: "must be at least 1".into(),
        });
    }
    if !(level > 0.0 && level < 1.0) {
        return Err(AnalysisError::InvalidParameter {
            name: "level",
            reason: format!("must be in (0, 1), got {level}"),
        });
    }
    Ok(())
}

/// Draws `reps` cluster resamples (each `clusters.len()` draws with replacement,
/// ChaCha8 seeded with `seed`) and calls `visit` on each. The sequence of
/// resamples depends only on `(clusters.len(), reps, seed)`, so statistics computed
/// from the same seed are paired replicate by replicate.
fn for_each_resample<T>(clusters: &[T], reps: usize, seed: u64, mut visit: impl FnMut(&[&T])) {
    let n = clusters.len();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut buf: Vec<&T> = Vec::with_capacity(n);
    for _ in 0..reps {
        buf.clear();
        buf.extend((0..n).map(|_| &clusters[rng.random_range(0..n)]));
        visit(&buf);
    }
}

/// The `reps` bootstrap replicates of `stat` (non-finite values included, in draw
/// order). Returns an empty vector when `clusters` is empty.
pub fn bootstrap_replicates<T, F>(clusters: &[T], stat: F, reps: usize, seed: u64) -> Vec<f64>
where
    F: Fn(&[&T]) -> f64,
{
    if clusters.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(reps);
    for_each_resample(clusters, reps, seed, |s| out.push(stat(s)));
    out
}

fn interval_from(
    estimate: f64,
    mut replicates: Vec<f64>,
    reps: usize,
    level: f64,
    what: &'static str,
) -> Result<BootstrapCi> {
    replicates.retain(|v| v.is_finite());
    if replicates.is_empty() {
        return Err(AnalysisError::NoValidReplicates { what, reps });
    }
    replicates.sort_by(f64::total_cmp);
    let alpha = 1.0 - level;
    Ok(BootstrapCi {
        estimate,
        lo: percentile_sorted(&replicates, alpha / 2.0),
        hi: percentile_sorted(&replicates, 1.0 - alpha / 2.0),
        level,
        reps,
        valid_reps: replicates.len(),
    })
}

/// Percentile cluster-bootstrap CI of any scalar statistic.
///
/// `stat_fn` receives a resample as a slice of references to clusters (the full
/// data for the point estimate) and returns the statistic; it may return a
/// non-finite value for a degenerate resample, which is then dropped.
///
/// # Errors
/// Empty `clusters`, `reps == 0`, `level` outside `(0, 1)`, or no finite replicate.
pub fn bootstrap_ci<T, F>(
    clusters: &[T],
    stat_fn: F,
    reps: usize,
    seed: u64,
    level: f64,
) -> Result<BootstrapCi>
where
    F: Fn(&[&T]) -> f64,
{
    check_params(clusters.len(), reps, level)?;
    let all: Vec<&T> = clusters.iter().collect();
    let estimate = stat_fn(&all);
    let replicates = bootstrap_replicates(clusters, &stat_fn, reps, seed);
    interval_from(estimate, replicates, reps, level, "statistic")
}

/// Percentile cluster-bootstrap CIs of a vector-valued statistic (one interval per
/// component; all components share the same resamples). `stat_fn` must return the
/// same length for every resample; a component that is not finite in a replicate
/// is dropped for that component only.
///
/// # Errors
/// As [`bootstrap_ci`]; [`AnalysisError::LengthMismatch`] if a replicate's length
/// differs from the estimate's.
pub fn bootstrap_ci_vec<T, F>(
    clusters: &[T],
    stat_fn: F,
    reps: usize,
    seed: u64,
    level: f64,
) -> Result<Vec<BootstrapCi>>
where
    F: Fn(&[&T]) -> Vec<f64>,
{
    check_params(clusters.len(), reps, level)?;
    let all: Vec<&T> = clusters.iter().collect();
    let estimate = stat_fn(&all);
    let k = estimate.len();
    let mut per_component: Vec<Vec<f64>> = vec![Vec::with_capacity(reps); k];
    let mut mismatch = None;
    for_each_resample(clusters, reps, seed, |s| {
        let v = stat_fn(s);
        if v.len() != k {
            mismatch.get_or_insert(v.len());
            return;
        }
        for (slot, x) in per_component.iter_mut().zip(v) {
            slot.push(x);
        }
    });
    if let Some(len) = mismatch {
        return Err(AnalysisError::LengthMismatch {
            left: "statistic estimate",
            left_len: k,
            right: "statistic replicate",
            right_len: len,
        });
    }
    estimate
        .into_iter()
        .zip(per_component)
        .map(|(e, reps_k)| interval_from(e, reps_k, reps, level, "statistic component"))
        .collect()
}

/// Percentile cluster-bootstrap CI of each phase's accuracy ([`phase_accuracy`]).
///
/// # Errors
/// As [`bootstrap_ci_vec`] (a phase without any observation has no valid replicate).
pub fn phase_accuracy_ci(
    clusters: &[PhaseCluster],
    reps: usize,
    seed: u64,
    level: f64,
) -> Result<Vec<BootstrapCi>> {
    let p = check_clusters(clusters)?;
    bootstrap_ci_vec(
        clusters,
        |s| {
            let mut acc = phase_accuracy(s.iter().copied());
            acc.resize(p, f64::NAN);
            acc
        },
        reps,
        seed,
        level,
    )
}

/// The phase gap: how much retrieval accuracy depends on the source phase.
///
/// With per-phase accuracies `acc[r]` ([`phase_accuracy`], phases without
/// observations ignored):
///
/// ```text
/// gap_pp = 100 * (max_r acc[r] - min_r acc[r])
/// ```
///
/// Two intervals are reported, both from the same cluster resamples:
///
/// * `ci_lo_pp..ci_hi_pp` (**use this one**; it is what `phase_gap_ci95` means):
///   a selection-adjusted simultaneous interval for the population gap. With
///   `d*_r = acc*_r - acc[r]` the centred replicate accuracies, let `c` be the
///   `level` quantile of `max_r d*_r - min_r d*_r` (the largest centred pairwise
///   contrast). If every pairwise contrast is within `c` of its population value,
///   so is the maximum, hence `[max(0, gap - c), min(100, gap + c)]` (in pp).
///   Its coverage holds whichever phases are truly best and worst, including a
///   true gap of 0: on data without a phase effect it includes 0 in about `level`
///   of the data sets.
/// * `fixed_pair_lo_pp..fixed_pair_hi_pp`: the plain percentile interval of
///   `acc*[best] - acc*[worst]` with `best`/`worst` fixed at the phases observed best
///   and worst. Narrower and conventional, but it ignores that the pair was chosen
///   because it looked extreme: under no true effect it excludes 0 in most data
///   sets (about 60% at 8 phases). Report it only next to the adjusted one.
///
/// `mean_accuracy` is the unweighted mean of the per-phase accuracies, with a
/// percentile interval. Ties for best/worst go to the lowest phase index.
///
/// # Errors
/// Empty `clusters`, clusters with different numbers of phases, fewer than two
/// phases with observations, or bad `reps`/`level`.
pub fn phase_gap(
    clusters: &[PhaseCluster],
    reps: usize,
    seed: u64,
    level: f64,
) -> Result<PhaseGap> {
    let p = check_clusters(clusters)?;
    check_params(clusters.len(), reps, level)?;
    let accuracy = phase_accuracy(clusters);
    let mut n = vec![0u64; p];
    for c in clusters {
        for (slot, k) in n.iter_mut().zip(&c.counts) {
            *slot += k;
        }
    }
    let observed: Vec<usize> = (0..p).filter(|&r| n[r] > 0).collect();
    if observed.len() < 2 {
        return Err(AnalysisError::TooFewPhases {
            what: "phase gap",
            needed: 2,
            found: observed.len(),
        });
    }
    let (best, worst) = best_and_worst(&accuracy, &observed);
    let gap = accuracy[best] - accuracy[worst];
    let mean = observed.iter().map(|&r| accuracy[r]).sum::<f64>() / observed.len() as f64;
    let GapReplicates {
        mut max_contrast,
        fixed_pair,
        means,
    } = gap_replicates(clusters, reps, seed, &accuracy, &observed, (best, worst));

    let valid_reps = max_contrast.iter().filter(|v| v.is_finite()).count();
    max_contrast.retain(|v| v.is_finite());
    if max_contrast.is_empty() {
        return Err(AnalysisError::NoValidReplicates {
            what: "phase gap",
            reps,
        });
    }
    max_contrast.sort_by(f64::total_cmp);
    let c = percentile_sorted(&max_contrast, level);
    let fixed = interval_from(gap, fixed_pair, reps, level, "phase gap (fixed pair)")?;
    let mean_ci = interval_from(mean, means, reps, level, "mean accuracy")?;

    Ok(PhaseGap {
        accuracy,
        n,
        mean_accuracy: mean,
        mean_ci: (mean_ci.lo, mean_ci.hi),
        best_phase: best,
        worst_phase: worst,
        gap_pp: 100.0 * gap,
        ci_lo_pp: 100.0 * (gap - c).max(0.0),
        ci_hi_pp: 100.0 * (gap + c).min(1.0),
        fixed_pair_lo_pp: 100.0 * fixed.lo,
        fixed_pair_hi_pp: 100.0 * fixed.hi,
        level,
        reps,
        valid_reps,
        n_clusters: clusters.len(),
    })
}

/// The observed phases with the highest and the lowest accuracy (ties: the lowest
/// phase index).
fn best_and_worst(accuracy: &[f64], observed: &[usize]) -> (usize, usize) {
    let (mut best, mut worst) = (observed[0], observed[0]);
    for &r in observed {
        if accuracy[r] > accuracy[best] {
            best = r;
        }
        if accuracy[r] < accuracy[worst] {
            worst = r;
        }
    }
    (best, worst)
}

/// Per cluster resample of [`phase_gap`]: the largest centred contrast and the mean
/// accuracy over the `observed` phases (NaN when the resample lost one of them), and
/// the fixed pair's gap.
struct GapReplicates {
    max_contrast: Vec<f64>,
    fixed_pair: Vec<f64>,
    means: Vec<f64>,
}

/// The [`GapReplicates`] of `reps` resamples, centred on the observed per-phase
/// `accuracy`, with the fixed pair `(best, worst)`.
fn gap_replicates(
    clusters: &[PhaseCluster],
    reps: usize,
    seed: u64,
    accuracy: &[f64],
    observed: &[usize],
    (best, worst): (usize, usize),
) -> GapReplicates {
    let mut max_contrast = Vec::with_capacity(reps);
    let mut fixed_pair = Vec::with_capacity(reps);
    let mut means = Vec::with_capacity(reps);
    for_each_resample(clusters, reps, seed, |s| {
        let acc = phase_accuracy(s.iter().copied());
        let centred: Vec<f64> = observed.iter().map(|&r| acc[r] - accuracy[r]).collect();
        if centred.iter().any(|d| !d.is_finite()) {
            // A resample that lost a phase: the contrasts are undefined.
            max_contrast.push(f64::NAN);
            means.push(f64::NAN);
        } else {
            let hi = centred.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lo = centred.iter().copied().fold(f64::INFINITY, f64::min);
            max_contrast.push(hi - lo);
            means.push(observed.iter().map(|&r| acc[r]).sum::<f64>() / observed.len() as f64);
        }
        fixed_pair.push(acc[best] - acc[worst]);
    });
    GapReplicates {
        max_contrast,
        fixed_pair,
        means,
    }
}

/// The number of phases shared by all clusters.
fn check_clusters(clusters: &[PhaseCluster]) -> Result<usize> {
    let first = clusters
        .first()
        .ok_or(AnalysisError::Empty { what: "clusters" })?;
    let p = first.num_phases();
    if let Some((i, c)) = clusters
        .iter()
        .enumerate()
        .find(|(_, c)| c.num_phases() != p)
    {
        return Err(AnalysisError::InvalidParameter {
            name: "clusters",
            reason: format!(
                "cluster {i} has {} phases, cluster 0 has {p}",
                c.num_phases()
            ),
        });
    }
    Ok(p)
}

/// The result of [`phase_gap`]. Accuracies are fractions, gaps percentage points.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseGap {
    /// Accuracy per phase (length `P`; `NaN` for a phase without observations).
    pub accuracy: Vec<f64>,
    /// Observations per phase (length `P`).
    pub n: Vec<u64>,
    /// Unweighted mean of the per-phase accuracies.
    pub mean_accuracy: f64,
    /// Percentile bootstrap interval of `mean_accuracy`.
    pub mean_ci: (f64, f64),
    /// Phase with the highest accuracy.
    pub best_phase: usize,
    /// Phase with the lowest accuracy.
    pub worst_phase: usize,
    /// `100 * (acc[best] - acc[worst])`.
    pub gap_pp: f64,
    /// Selection-adjusted lower bound (pp, >= 0).
    pub ci_lo_pp: f64,
    /// Selection-adjusted upper bound (pp, <= 100).
    pub ci_hi_pp: f64,
    /// Fixed-pair percentile lower bound (pp; may be negative).
    pub fixed_pair_lo_pp: f64,
    /// Fixed-pair percentile upper bound (pp).
    pub fixed_pair_hi_pp: f64,
    /// Confidence level.
    pub level: f64,
    /// Replicates drawn.
    pub reps: usize,
    /// Replicates in which every observed phase kept an observation.
    pub valid_reps: usize,
    /// Number of clusters (logical examples).
    pub n_clusters: usize,
}

impl PhaseGap {
    /// The selection-adjusted interval as `[lo, hi]` (pp), the `phase_gap_ci95` of
    /// `summary.json`.
    pub fn ci_pp(&self) -> [f64; 2] {
        [self.ci_lo_pp, self.ci_hi_pp]
    }

    /// Whether the selection-adjusted interval excludes a zero gap.
    pub fn significant(&self) -> bool {
        self.ci_lo_pp > 0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic synthetic clusters: per-example difficulty plus an additive
    /// phase effect `effect[r]`; outcomes are Bernoulli.
    fn synthetic(n: usize, effect: &[f64], seed: u64) -> Vec<PhaseCluster> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let base: f64 = 0.35 + 0.5 * rng.random::<f64>();
                let correct: Vec<bool> = effect
                    .iter()
                    .map(|e| rng.random::<f64>() < (base + e).clamp(0.0, 1.0))
                    .collect();
                PhaseCluster::from_correct(&correct)
            })
            .collect()
    }

    #[test]
    fn percentile_known_values() {
        let v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 1.0), Some(4.0));
        assert_eq!(percentile(&v, 0.5), Some(2.5));
        assert_eq!(percentile(&v, 0.25), Some(1.75));
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&v, 1.5), None);
    }

    #[test]
    fn phase_accuracy_pools_counts() {
        let a = PhaseCluster::from_correct(&[true, false, true]);
        let b = PhaseCluster::from_correct(&[true, false, false]);
        let c = PhaseCluster::from_observations(3, [(0, 0.0), (0, 1.0)]).unwrap();
        let acc = phase_accuracy(&[a, b, c]);
        assert_eq!(acc[0], 3.0 / 4.0);
        assert_eq!(acc[1], 0.0);
        assert_eq!(acc[2], 0.5);
        let missing = PhaseCluster::from_values(&[1.0, f64::NAN]);
        let acc = phase_accuracy([&missing]);
        assert_eq!(acc[0], 1.0);
        assert!(acc[1].is_nan());
    }

    #[test]
    fn observe_validates() {
        let mut c = PhaseCluster::new(2);
        assert!(matches!(
            c.observe(2, 1.0),
            Err(AnalysisError::PhaseOutOfRange { phase: 2, .. })
        ));
        assert!(c.observe(0, f64::NAN).is_err());
    }

    #[test]
    fn shifted_rotates_phases() {
        let c = PhaseCluster::from_values(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(c.shifted(1).sums(), &[4.0, 1.0, 2.0, 3.0]);
        assert_eq!(c.shifted(-1).sums(), &[2.0, 3.0, 4.0, 1.0]);
        assert_eq!(c.shifted(4), c);
    }

    /// Two clusters, gap statistic acc[0] - acc[1]: resamples {A,A}, {A,B}, {B,B}
    /// have probabilities 1/4, 1/2, 1/4 and statistics 1, 0.5, 0.
    #[test]
    fn hand_computed_two_cluster_distribution() {
        let clusters = vec![
            PhaseCluster::from_correct(&[true, false]),
            PhaseCluster::from_correct(&[false, false]),
        ];
        let stat = |s: &[&PhaseCluster]| {
            let a = phase_accuracy(s.iter().copied());
            a[0] - a[1]
        };
        let reps = 4000;
        let r = bootstrap_replicates(&clusters, stat, reps, 7);
        let frac = |x: f64| r.iter().filter(|&&v| v == x).count() as f64 / reps as f64;
        assert!((frac(1.0) - 0.25).abs() < 0.03, "{}", frac(1.0));
        assert!((frac(0.5) - 0.5).abs() < 0.03, "{}", frac(0.5));
        assert!((frac(0.0) - 0.25).abs() < 0.03, "{}", frac(0.0));
        let ci = bootstrap_ci(&clusters, stat, reps, 7, 0.95).unwrap();
        assert_eq!((ci.estimate, ci.lo, ci.hi), (0.5, 0.0, 1.0));
        // An 80% interval: quantiles 0.1 and 0.9 fall inside the 0 and 1 masses.
        let ci80 = bootstrap_ci(&clusters, stat, reps, 7, 0.8).unwrap();
        assert_eq!((ci80.lo, ci80.hi), (0.0, 1.0));
        // A 40% interval (quantiles 0.3, 0.7) is the middle mass.
        let ci40 = bootstrap_ci(&clusters, stat, reps, 7, 0.4).unwrap();
        assert_eq!((ci40.lo, ci40.hi), (0.5, 0.5));
    }

    #[test]
    fn deterministic_under_seed() {
        let clusters = synthetic(60, &[0.0, 0.1, -0.1, 0.0], 1);
        let a = phase_gap(&clusters, 300, 42, 0.95).unwrap();
        let b = phase_gap(&clusters, 300, 42, 0.95).unwrap();
        assert_eq!(a, b);
        let c = phase_gap(&clusters, 300, 43, 0.95).unwrap();
        assert_eq!(a.gap_pp, c.gap_pp);
        assert_ne!((a.ci_lo_pp, a.ci_hi_pp), (c.ci_lo_pp, c.ci_hi_pp));
        let first = |s: &[&PhaseCluster]| phase_accuracy(s.iter().copied())[0];
        let r1 = bootstrap_replicates(&clusters, first, 50, 9);
        assert_eq!(r1, bootstrap_replicates(&clusters, first, 50, 9));
        assert_ne!(r1, bootstrap_replicates(&clusters, first, 50, 10));
    }

    #[test]
    fn point_estimates_by_hand() {
        // Phase accuracies 3/4, 1/4, 2/4 -> best 0, worst 1, gap 50 pp, mean 0.5.
        let clusters: Vec<_> = [
            [true, false, true],
            [true, false, true],
            [true, true, false],
            [false, false, false],
        ]
        .iter()
        .map(|c| PhaseCluster::from_correct(c))
        .collect();
        let g = phase_gap(&clusters, 200, 1, 0.95).unwrap();
        assert_eq!(g.accuracy, vec![0.75, 0.25, 0.5]);
        assert_eq!((g.best_phase, g.worst_phase), (0, 1));
        assert!((g.gap_pp - 50.0).abs() < 1e-12);
        assert!((g.mean_accuracy - 0.5).abs() < 1e-12);
        assert_eq!(g.n, vec![4, 4, 4]);
        assert!(g.ci_lo_pp <= g.gap_pp && g.gap_pp <= g.ci_hi_pp);
        assert!(g.mean_ci.0 <= 0.5 && 0.5 <= g.mean_ci.1);
    }

    #[test]
    fn ci_contains_estimate() {
        for seed in 0..5 {
            let clusters = synthetic(80, &[0.0, 0.05, 0.1, -0.05, 0.0, 0.0], seed);
            let g = phase_gap(&clusters, 400, seed, 0.95).unwrap();
            assert!(g.ci_lo_pp <= g.gap_pp && g.gap_pp <= g.ci_hi_pp, "{g:?}");
            assert!(g.fixed_pair_lo_pp <= g.gap_pp && g.gap_pp <= g.fixed_pair_hi_pp);
            let accs = phase_accuracy_ci(&clusters, 400, seed, 0.95).unwrap();
            for ci in &accs {
                assert!(ci.contains(ci.estimate), "{ci:?}");
                assert_eq!(ci.valid_reps, 400);
            }
        }
    }

    #[test]
    fn zero_true_gap_ci_usually_includes_zero() {
        let datasets = 40;
        let mut includes = 0;
        for seed in 0..datasets {
            let clusters = synthetic(128, &[0.0; 8], 1000 + seed);
            let g = phase_gap(&clusters, 400, seed, 0.95).unwrap();
            assert!(g.gap_pp > 0.0);
            includes += usize::from(g.ci_lo_pp == 0.0);
        }
        // Nominal 95%; allow sampling slack.
        assert!(
            includes >= 34,
            "CI included 0 in only {includes}/{datasets}"
        );
    }

    #[test]
    fn real_gap_is_detected() {
        let effect: Vec<f64> = (0..8)
            .map(|r| if r % 4 < 2 { 0.15 } else { -0.15 })
            .collect();
        let mut detected = 0;
        for seed in 0..10 {
            let clusters = synthetic(256, &effect, 2000 + seed);
            let g = phase_gap(&clusters, 400, seed, 0.95).unwrap();
            detected += usize::from(g.significant());
            assert!(g.best_phase % 4 < 2 && g.worst_phase % 4 >= 2, "{g:?}");
        }
        assert!(detected >= 9, "detected {detected}/10");
    }

    #[test]
    fn errors() {
        assert!(matches!(
            phase_gap(&[], 10, 0, 0.95),
            Err(AnalysisError::Empty { .. })
        ));
        let one = vec![PhaseCluster::from_values(&[1.0, f64::NAN])];
        assert!(matches!(
            phase_gap(&one, 10, 0, 0.95),
            Err(AnalysisError::TooFewPhases { found: 1, .. })
        ));
        let mixed = vec![PhaseCluster::new(2), PhaseCluster::new(3)];
        assert!(phase_gap(&mixed, 10, 0, 0.95).is_err());
        let ok = vec![PhaseCluster::from_correct(&[true, false])];
        assert!(phase_gap(&ok, 0, 0, 0.95).is_err());
        assert!(phase_gap(&ok, 10, 0, 1.0).is_err());
        assert!(matches!(
            bootstrap_ci(&ok, |_| f64::NAN, 10, 0, 0.95),
            Err(AnalysisError::NoValidReplicates { .. })
        ));
        assert!(matches!(
            bootstrap_ci_vec(
                &[1, 2, 3],
                |s| vec![0.0; s.iter().map(|x| **x).sum::<i32>() as usize],
                20,
                0,
                0.9
            ),
            Err(AnalysisError::LengthMismatch { .. })
        ));
    }

    #[test]
    fn generic_bootstrap_of_mean() {
        // Mean of 0..100 as plain numbers: CI around 49.5 with width ~ 2*1.96*29/10.
        let xs: Vec<f64> = (0..100).map(f64::from).collect();
        let mean = |s: &[&f64]| s.iter().copied().sum::<f64>() / s.len() as f64;
        let ci = bootstrap_ci(&xs, mean, 2000, 3, 0.95).unwrap();
        assert_eq!(ci.estimate, 49.5);
        assert!(ci.contains(49.5));
        let width = ci.hi - ci.lo;
        assert!((width - 11.3).abs() < 1.5, "width {width}");
    }
}

/// One run's (a training seed's) estimate of a statistic with its own 95% interval,
/// for [`runs_mean_ci`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunEstimate {
    /// The run's point estimate.
    pub estimate: f64,
    /// Its 95% interval (e.g. a phase sweep's cluster-bootstrap CI).
    pub ci95: (f64, f64),
}

/// Two-level bootstrap CI of the mean of a statistic over runs (training seeds), each
/// measured with its own sampling noise.
///
/// Level 1 is a cluster bootstrap with the run as the cluster (`runs.len()` draws with
/// replacement, [`bootstrap_replicates`]); level 2 draws, for every run drawn, a value
/// from that run's sampling distribution, approximated as a normal centred on its
/// estimate with standard deviation `h / Z95`, where `h` is the wider half of its 95%
/// interval (`max(estimate - lo, hi - estimate)`: an interval clipped at a bound, such
/// as a phase gap's at 0 or 100 pp, keeps its unclipped half-width). Draws are clamped
/// into `bounds` (`(0, 1)` for accuracies, `(0, 100)` for gaps in pp). The statistic is
/// the mean of the drawn values; the interval is the percentile interval at `level`,
/// around the mean of the runs' estimates. Reproducible for a given `seed`.
///
/// With few runs (2 or 3 seeds) level 1 sees little of the spread between seeds: the
/// interval is for the mean over seeds like these, and is narrower than a t interval.
///
/// # Errors
/// Empty `runs`, a non-finite estimate, `reps == 0`, `level` outside `(0, 1)`.
pub fn runs_mean_ci(
    runs: &[RunEstimate],
    bounds: (f64, f64),
    reps: usize,
    seed: u64,
    level: f64,
) -> Result<BootstrapCi> {
    check_params(runs.len(), reps, level)?;
    if let Some(r) = runs.iter().find(|r| !r.estimate.is_finite()) {
        return Err(AnalysisError::InvalidParameter {
            name: "runs",
            reason: format!("a run's estimate is not finite ({})", r.estimate),
        });
    }
    let sd = |r: &RunEstimate| {
        let (lo, hi) = r.ci95;
        let h = [r.estimate - lo, hi - r.estimate]
            .into_iter()
            .filter(|v| v.is_finite())
            .fold(0.0f64, f64::max);
        h / super::intervals::Z95
    };
    let estimate = runs.iter().map(|r| r.estimate).sum::<f64>() / runs.len() as f64;
    // The within-run draws use their own stream, so the run resamples are those of
    // every other cluster bootstrap with this seed.
    let rng = std::cell::RefCell::new(ChaCha8Rng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15));
    let replicates = bootstrap_replicates(
        runs,
        |s: &[&RunEstimate]| {
            let mut rng = rng.borrow_mut();
            let total: f64 = s
                .iter()
                .map(|r| {
                    let z = standard_normal(&mut rng);
                    (r.estimate + z * sd(r)).clamp(bounds.0, bounds.1)
                })
                .sum();
            total / s.len() as f64
        },
        reps,
        seed,
    );
    interval_from(estimate, replicates, reps, level, "mean over runs")
}

/// A standard normal draw (Box-Muller).
fn standard_normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>(); // (0, 1]
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}
