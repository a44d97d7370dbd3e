//! Statistics for phase-sensitivity experiments. Every function here is pure: it
//! takes numbers (outcomes, effects, gate weights) and returns numbers, so the
//! runner, the figure redraw and the tests all share one implementation.
//!
//! | File | What it computes (its public items are re-exported here) |
//! |---|---|
//! | `intervals` | Wilson score interval for a binomial proportion |
//! | `bootstrap` | cluster bootstrap over logical examples; per-phase accuracy; the phase gap with CIs; the mean over training seeds (two-level) |
//! | `profile` | R^2 and MAE between predicted and observed phase profiles, with bootstrap CIs |
//! | `specialization` | phase-specialization index of a head and a ranking of the most specialized heads |
//! | `effects` | normalised logit difference for patching; relative change (%) for ablations |
//! | `gates` | gate-profile statistics g(r), exp(H(E\[a\])), E\[exp(H(a))\] |
//! | `agreement` | Spearman rank correlation and top-k recall of an estimate against a reference (attribution vs exact patching) |
//! | `separable` | gate cycling's two-factor fit: the part of a phase profile the gates move and the part they do not |
//! | `retrieval` | where attention lands in the `hook_pattern` key layout (needle slots, top hit); indexer ranks |
//!
//! Conventions: a *phase* is an index `r` in `0..P`; accuracies are fractions in
//! `[0, 1]` and gaps are reported in percentage points (pp, `100 x` a difference of
//! fractions). Undefined values (for example the accuracy of a phase without
//! observations) are `f64::NAN` inside vectors and `None` for scalars.

pub(crate) mod agreement;
pub(crate) mod bootstrap;
pub(crate) mod clusters;
pub(crate) mod effects;
pub(crate) mod gates;
pub mod grid_shift;
pub(crate) mod intervals;
pub(crate) mod profile;
pub(crate) mod retrieval;
pub(crate) mod separable;
pub(crate) mod specialization;

pub use agreement::{average_ranks, spearman, topk_recall};
pub use bootstrap::{
    BootstrapCi, DEFAULT_LEVEL, DEFAULT_REPS, PhaseCluster, PhaseGap, RunEstimate, bootstrap_ci,
    bootstrap_ci_vec, bootstrap_replicates, percentile, phase_accuracy, phase_accuracy_ci,
    phase_gap, runs_mean_ci,
};
pub use clusters::{Clusters, Est, Obs, accuracy_clusters, per_phase, phase_clusters};
pub use effects::{MIN_LOGIT_DIFF_DENOM, normalized_logit_diff, relative_change_pct};
pub use gates::{GATE_SUM_TOLERANCE, GateStats, exp_entropy, gate_stats};
pub use intervals::{Z95, wilson};
pub use profile::{
    ProfileCluster, ProfileFit, concatenated_mae, concatenated_profiles, concatenated_r2, mae,
    pooled_mae, profile_fit, r_squared,
};
pub use retrieval::{EntryAlign, SlotLayout, best_rank, top_hit};
pub use separable::{SeparableFit, ShiftCluster, pooled_profiles, separable_ci, separable_fit};
pub use specialization::{RankedHead, Specialization, rank_specialized, specialization};

/// Errors of the statistics functions. Each names the offending input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AnalysisError {
    /// An input that must be non-empty was empty.
    #[error("{what} is empty")]
    Empty {
        /// Which input (for example `"clusters"`).
        what: &'static str,
    },
    /// Two inputs that must have the same length do not.
    #[error("length mismatch: {left} has {left_len} values but {right} has {right_len}")]
    LengthMismatch {
        /// Name of the first input.
        left: &'static str,
        /// Its length.
        left_len: usize,
        /// Name of the second input.
        right: &'static str,
        /// Its length.
        right_len: usize,
    },
    /// A phase index outside `0..num_phases`.
    #[error("phase {phase} is out of range for {num_phases} phases")]
    PhaseOutOfRange {
        /// The offending phase.
        phase: usize,
        /// The number of phases.
        num_phases: usize,
    },
    /// A parameter outside its valid range (confidence level, replicate count, ...).
    #[error("invalid {name}: {reason}")]
    InvalidParameter {
        /// Parameter name.
        name: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// A value that must be finite was NaN or infinite.
    #[error("{what}[{index}] is not finite ({value})")]
    NonFinite {
        /// Which input.
        what: &'static str,
        /// Position of the value.
        index: usize,
        /// The value.
        value: f64,
    },
    /// Too few phases carry observations to define the statistic.
    #[error("{what} needs at least {needed} phases with observations, found {found}")]
    TooFewPhases {
        /// Which statistic.
        what: &'static str,
        /// How many are needed.
        needed: usize,
        /// How many were present.
        found: usize,
    },
    /// Every bootstrap replicate produced a non-finite statistic.
    #[error("no bootstrap replicate of {what} was finite ({reps} replicates)")]
    NoValidReplicates {
        /// Which statistic.
        what: &'static str,
        /// Replicates drawn.
        reps: usize,
    },
    /// Gate weights that are not a probability distribution over offsets.
    #[error("gate weights of window {window}: {reason}")]
    InvalidGateWeights {
        /// Window (row) index.
        window: usize,
        /// What is wrong.
        reason: String,
    },
}

/// Result alias of this module.
pub type Result<T, E = AnalysisError> = std::result::Result<T, E>;

/// Checks that every value of `values` is finite.
pub(crate) fn ensure_finite(what: &'static str, values: &[f64]) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(AnalysisError::NonFinite {
            what,
            index,
            value: values[index],
        }),
        None => Ok(()),
    }
}
