//! Phase-specialization index of a head.
//!
//! Input: a head's *effect profile* `e[r]` over `P` phases, oriented so that
//! larger means "the head carries more of the retrieval at phase r" (for
//! denoising patching the normalised logit difference; for knockout or ablation
//! the accuracy *drop*, i.e. minus the relative change).
//!
//! ```text
//! e+[r]  = max(e[r], 0)                      (only helpful effects count)
//! p[r]   = e+[r] / sum_s e+[s]               (a distribution over phases)
//! H      = -sum_r p[r] ln p[r]               (0 ln 0 = 0)
//! N_eff  = exp(H)                            in [1, P]: effective number of phases
//! S      = 1 - (N_eff - 1) / (P - 1)         in [0, 1]
//! ```
//!
//! `S = 1` means all of the head's effect is on a single phase, `S = 0` means it
//! is spread uniformly over all phases. Edge cases: a profile with no positive
//! effect (all zero or negative) has no distribution, so `N_eff` and `S` are
//! `None` (such heads are never ranked); `P < 2` is an error (specialization
//! over one phase is meaningless). The index ignores the effect's magnitude,
//! which is reported separately as `total_effect` so that a tiny but
//! concentrated effect can be filtered out ([`rank_specialized`]'s
//! `min_total_effect`).

use super::{AnalysisError, Result, ensure_finite};

/// Entropy-based specialization of one effect profile.
#[derive(Debug, Clone, PartialEq)]
pub struct Specialization {
    /// Number of phases `P`.
    pub num_phases: usize,
    /// `sum_r max(e[r], 0)`.
    pub total_effect: f64,
    /// The normalised positive profile `p[r]` (all zeros when there is no positive effect).
    pub distribution: Vec<f64>,
    /// Effective number of phases `exp(H)`, `None` without positive effect.
    pub effective_phases: Option<f64>,
    /// Specialization score `1 - (exp(H) - 1) / (P - 1)`, `None` without positive effect.
    pub score: Option<f64>,
    /// Phase with the largest effect (lowest index on ties), `None` without positive effect.
    pub peak_phase: Option<usize>,
}

/// Specialization of the effect profile `effect` (length `P >= 2`, finite).
///
/// # Errors
/// `P < 2` or a non-finite effect.
pub fn specialization(effect: &[f64]) -> Result<Specialization> {
    let p = effect.len();
    if p < 2 {
        return Err(AnalysisError::InvalidParameter {
            name: "effect",
            reason: format!("specialization needs at least 2 phases, got {p}"),
        });
    }
    ensure_finite("effect", effect)?;
    let positive: Vec<f64> = effect.iter().map(|e| e.max(0.0)).collect();
    let total: f64 = positive.iter().sum();
    if total <= 0.0 {
        return Ok(Specialization {
            num_phases: p,
            total_effect: 0.0,
            distribution: vec![0.0; p],
            effective_phases: None,
            score: None,
            peak_phase: None,
        });
    }
    let distribution: Vec<f64> = positive.iter().map(|e| e / total).collect();
    let n_eff = super::gates::exp_entropy(&distribution);
    // Clamp rounding noise so that S stays in [0, 1].
    let score = (1.0 - (n_eff - 1.0) / (p as f64 - 1.0)).clamp(0.0, 1.0);
    let peak = (0..p).fold(0, |best, r| {
        if positive[r] > positive[best] {
            r
        } else {
            best
        }
    });
    Ok(Specialization {
        num_phases: p,
        total_effect: total,
        distribution,
        effective_phases: Some(n_eff),
        score: Some(score),
        peak_phase: Some(peak),
    })
}

/// A head in a specialization ranking.
#[derive(Debug, Clone, PartialEq)]
pub struct RankedHead<K> {
    /// The caller's identifier of the head (e.g. `(layer, head)`).
    pub key: K,
    /// Its specialization.
    pub specialization: Specialization,
}

/// The `k` most specialized heads: heads with a positive effect of at least
/// `min_total_effect` (sum of the positive part), sorted by score descending,
/// ties broken by larger `total_effect`, then by input order.
///
/// # Errors
/// As [`specialization`] for any profile (the error names no head; profiles are
/// validated in input order).
pub fn rank_specialized<K: Clone>(
    profiles: &[(K, Vec<f64>)],
    k: usize,
    min_total_effect: f64,
) -> Result<Vec<RankedHead<K>>> {
    let mut ranked = Vec::new();
    for (key, effect) in profiles {
        let s = specialization(effect)?;
        if s.score.is_some() && s.total_effect >= min_total_effect {
            ranked.push(RankedHead {
                key: key.clone(),
                specialization: s,
            });
        }
    }
    // Stable sort keeps input order among exact ties.
    ranked.sort_by(|a, b| {
        let (sa, sb) = (&a.specialization, &b.specialization);
        sb.score
            .unwrap_or(0.0)
            .total_cmp(&sa.score.unwrap_or(0.0))
            .then(sb.total_effect.total_cmp(&sa.total_effect))
    });
    ranked.truncate(k);
    Ok(ranked)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn one_hot_and_uniform() {
        let s = specialization(&[0.0, 0.7, 0.0, 0.0]).unwrap();
        assert_eq!(s.score, Some(1.0));
        assert_eq!(s.effective_phases, Some(1.0));
        assert_eq!(s.peak_phase, Some(1));
        let u = specialization(&[0.2; 4]).unwrap();
        assert!(close(u.effective_phases.unwrap(), 4.0));
        assert!(close(u.score.unwrap(), 0.0));
    }

    #[test]
    fn two_equal_phases_known_value() {
        // p = (1/2, 1/2, 0, 0, 0): H = ln 2, N_eff = 2, S = 1 - 1/4 = 0.75.
        let s = specialization(&[1.0, 1.0, 0.0, -3.0, 0.0]).unwrap();
        assert!(close(s.effective_phases.unwrap(), 2.0));
        assert!(close(s.score.unwrap(), 0.75));
        assert!(close(s.total_effect, 2.0));
        assert_eq!(s.distribution, vec![0.5, 0.5, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn no_positive_effect() {
        for e in [[0.0, 0.0, 0.0], [-1.0, -0.5, 0.0]] {
            let s = specialization(&e).unwrap();
            assert_eq!(
                (s.score, s.effective_phases, s.peak_phase),
                (None, None, None)
            );
            assert_eq!(s.total_effect, 0.0);
        }
        assert!(specialization(&[1.0]).is_err());
        assert!(specialization(&[1.0, f64::INFINITY]).is_err());
    }

    #[test]
    fn ranking() {
        let profiles = vec![
            ((0, 0), vec![0.25, 0.25, 0.25, 0.25]), // S = 0
            ((0, 1), vec![0.0, 0.0, 0.9, 0.0]),     // S = 1, big
            ((1, 0), vec![0.5, 0.5, 0.0, 0.0]),     // S = 2/3
            ((1, 1), vec![0.0, 0.01, 0.0, 0.0]),    // S = 1, tiny
            ((2, 0), vec![0.0, 0.0, 0.0, 0.0]),     // no effect
            ((2, 1), vec![0.0, 0.0, 0.0, 0.5]),     // S = 1, mid
        ];
        let top = rank_specialized(&profiles, 3, 0.0).unwrap();
        let keys: Vec<_> = top.iter().map(|h| h.key).collect();
        assert_eq!(keys, vec![(0, 1), (2, 1), (1, 1)]);
        let filtered = rank_specialized(&profiles, 10, 0.1).unwrap();
        let keys: Vec<_> = filtered.iter().map(|h| h.key).collect();
        assert_eq!(keys, vec![(0, 1), (2, 1), (1, 0), (0, 0)]);
        assert!(close(filtered[2].specialization.score.unwrap(), 2.0 / 3.0));
    }
}
