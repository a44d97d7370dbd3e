//! Gate-profile statistics of softmax-gated pooling.
//!
//! A compressor pools each window of `W` tokens into one KV entry with weights
//! `a[w][r]` (softmax over offsets `r` in `0..W`, so `sum_r a[w][r] = 1`). Over
//! `N` windows:
//!
//! ```text
//! E[a][r]      = (1/N) sum_w a[w][r]                     mean gate
//! g(r)         = E[a][r] / (1/W) = W * E[a][r]            1 = uniform share
//! exp(H(E[a])) = exp(-sum_r E[a][r] ln E[a][r])           offsets used on average
//! E[exp(H(a))] = (1/N) sum_w exp(-sum_r a[w][r] ln a[w][r])   offsets used per window
//! ```
//!
//! Both effective numbers lie in `[1, W]`. `exp(H(E[a])) >= E[exp(H(a))]` up to
//! rounding when windows differ; a large gap between them means that each window
//! is sharp but different windows prefer different offsets.

use super::{AnalysisError, Result};

/// Tolerance on `|sum_r a[w][r] - 1|` accepted by [`gate_stats`].
pub const GATE_SUM_TOLERANCE: f64 = 1e-3;

/// `exp(H(p))` of a probability vector, with `0 ln 0 = 0`: the effective number
/// of outcomes (1 for one-hot, `len` for uniform). The caller normalises `p`.
pub fn exp_entropy(p: &[f64]) -> f64 {
    let h: f64 = p.iter().filter(|&&x| x > 0.0).map(|&x| -x * x.ln()).sum();
    h.exp()
}

/// Statistics of one gate (one layer, KV head, key or value gate).
#[derive(Debug, Clone, PartialEq)]
pub struct GateStats {
    /// Window length `W` (number of offsets).
    pub window: usize,
    /// Number of windows `N` averaged over.
    pub num_windows: usize,
    /// Mean gate `E[a][r]` (length `W`, sums to 1).
    pub mean_weights: Vec<f64>,
    /// `g(r) = W * E[a][r]` (length `W`).
    pub g: Vec<f64>,
    /// `exp(H(E[a]))`.
    pub exp_entropy_of_mean: f64,
    /// `E[exp(H(a))]`.
    pub mean_exp_entropy: f64,
}

/// Gate statistics from weights `a` stored row-major with shape `[N, W]`
/// (`a[w * window + r]` is the weight of offset `r` in window `w`).
///
/// # Errors
/// `window == 0`, a length that is not a multiple of `window`, no windows, or a
/// window whose weights are negative, non-finite or do not sum to 1 within
/// [`GATE_SUM_TOLERANCE`] (the error names the window).
pub fn gate_stats(weights: &[f64], window: usize) -> Result<GateStats> {
    if window == 0 {
        return Err(AnalysisError::InvalidParameter {
            name: "window",
            reason: "must be at least 1".into(),
        });
    }
    if !weights.len().is_multiple_of(window) {
        return Err(AnalysisError::InvalidParameter {
            name: "weights",
            reason: format!(
                "length {} is not a multiple of the window {window}",
                weights.len()
            ),
        });
    }
    let n = weights.len() / window;
    if n == 0 {
        return Err(AnalysisError::Empty { what: "weights" });
    }
    let mut mean = vec![0.0; window];
    let mut sum_exp_h = 0.0;
    for (w, row) in weights.chunks_exact(window).enumerate() {
        if let Some(r) = row.iter().position(|x| !x.is_finite() || *x < 0.0) {
            return Err(AnalysisError::InvalidGateWeights {
                window: w,
                reason: format!("weight at offset {r} is {}", row[r]),
            });
        }
        let total: f64 = row.iter().sum();
        if (total - 1.0).abs() > GATE_SUM_TOLERANCE {
            return Err(AnalysisError::InvalidGateWeights {
                window: w,
                reason: format!("weights sum to {total}, expected 1"),
            });
        }
        for (m, x) in mean.iter_mut().zip(row) {
            *m += x;
        }
        sum_exp_h += exp_entropy(row);
    }
    mean.iter_mut().for_each(|m| *m /= n as f64);
    Ok(GateStats {
        window,
        num_windows: n,
        g: mean.iter().map(|m| m * window as f64).collect(),
        exp_entropy_of_mean: exp_entropy(&mean),
        mean_exp_entropy: sum_exp_h / n as f64,
        mean_weights: mean,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn exp_entropy_known_values() {
        assert!(close(exp_entropy(&[1.0, 0.0, 0.0]), 1.0));
        assert!(close(exp_entropy(&[0.25; 4]), 4.0));
        assert!(close(exp_entropy(&[0.5, 0.5, 0.0]), 2.0));
    }

    #[test]
    fn sharp_windows_preferring_different_offsets() {
        // Two one-hot windows on different offsets (W = 4): the mean gate is
        // (1/2, 1/2, 0, 0): g = (2, 2, 0, 0), exp(H(E[a])) = 2, E[exp(H(a))] = 1.
        let a = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0];
        let s = gate_stats(&a, 4).unwrap();
        assert_eq!(s.num_windows, 2);
        assert_eq!(s.mean_weights, vec![0.5, 0.5, 0.0, 0.0]);
        assert_eq!(s.g, vec![2.0, 2.0, 0.0, 0.0]);
        assert!(close(s.exp_entropy_of_mean, 2.0));
        assert!(close(s.mean_exp_entropy, 1.0));
    }

    #[test]
    fn uniform_gate() {
        let a = vec![0.125; 8 * 3];
        let s = gate_stats(&a, 8).unwrap();
        assert!(s.g.iter().all(|g| close(*g, 1.0)));
        assert!(close(s.exp_entropy_of_mean, 8.0));
        assert!(close(s.mean_exp_entropy, 8.0));
    }

    #[test]
    fn errors_name_the_window() {
        let err = gate_stats(&[0.5, 0.5, 0.7, 0.7], 2).unwrap_err();
        assert!(matches!(
            err,
            AnalysisError::InvalidGateWeights { window: 1, .. }
        ));
        assert!(err.to_string().contains("window 1"), "{err}");
        assert!(gate_stats(&[1.5, -0.5], 2).is_err());
        assert!(gate_stats(&[0.5, 0.5, 1.0], 2).is_err());
        assert!(gate_stats(&[], 2).is_err());
        assert!(gate_stats(&[1.0], 0).is_err());
    }
}
