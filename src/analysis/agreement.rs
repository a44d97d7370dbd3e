//! Agreement between an estimate and a reference over a set of components (heads):
//! how well attribution patching ranks the heads that exact patching finds.

use super::{AnalysisError, Result, ensure_finite};

/// Ranks of `v` (1-based), ties sharing the mean of their ranks.
pub fn average_ranks(v: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[a].total_cmp(&v[b]));
    let mut ranks = vec![0.0; v.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && v[idx[j + 1]] == v[idx[i]] {
            j += 1;
        }
        // Positions i..=j share the mean rank (i + 1 + j + 1) / 2.
        let r = (i + j) as f64 / 2.0 + 1.0;
        for &k in &idx[i..=j] {
            ranks[k] = r;
        }
        i = j + 1;
    }
    ranks
}

fn pearson(a: &[f64], b: &[f64]) -> Option<f64> {
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let (mut sab, mut saa, mut sbb) = (0.0, 0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        sab += (x - ma) * (y - mb);
        saa += (x - ma) * (x - ma);
        sbb += (y - mb) * (y - mb);
    }
    if saa <= 0.0 || sbb <= 0.0 {
        return None;
    }
    Some(sab / (saa * sbb).sqrt())
}

/// Spearman rank correlation of `estimate` and `reference` (Pearson correlation of
/// their average ranks). `Ok(None)` when either is constant (the correlation is
/// undefined). Errors on length mismatch, fewer than 2 values or non-finite input.
///
/// Example: `spearman(&[1.0, 2.0, 3.0], &[10.0, 20.0, 25.0])` is `Ok(Some(1.0))`.
pub fn spearman(estimate: &[f64], reference: &[f64]) -> Result<Option<f64>> {
    check_pair(estimate, reference, 2)?;
    Ok(pearson(&average_ranks(estimate), &average_ranks(reference)))
}

/// Top-k recall: the fraction of the `k` components with the largest `|reference|`
/// that are also among the `k` with the largest `|estimate|` (ties broken by index,
/// lower first). Errors on length mismatch, empty or non-finite input, `k == 0`, and
/// on `k` not below the number of components: then both top sets hold every component
/// and the recall is 1.0 whatever the estimate (vacuous), so none is reported.
///
/// Example: `topk_recall(&[0.9, 0.1, 0.5], &[1.0, 0.0, -0.8], 2)` is `Ok(1.0)`.
pub fn topk_recall(estimate: &[f64], reference: &[f64], k: usize) -> Result<f64> {
    check_pair(estimate, reference, 1)?;
    if k == 0 {
        return Err(AnalysisError::InvalidParameter {
            name: "k",
            reason: "must be at least 1".into(),
        });
    }
    if k >= reference.len() {
        return Err(AnalysisError::InvalidParameter {
            name: "k",
            reason: format!(
                "top-{k} recall over {} components is 1.0 whatever the estimate (vacuous): k must be below the number of components",
                reference.len()
            ),
        });
    }
    let top = |v: &[f64]| -> Vec<usize> {
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_by(|&a, &b| v[b].abs().total_cmp(&v[a].abs()).then(a.cmp(&b)));
        idx.truncate(k);
        idx
    };
    let (te, tr) = (top(estimate), top(reference));
    let hits = tr.iter().filter(|i| te.contains(i)).count();
    Ok(hits as f64 / k as f64)
}

fn check_pair(a: &[f64], b: &[f64], min: usize) -> Result<()> {
    if a.len() != b.len() {
        return Err(AnalysisError::LengthMismatch {
            left: "estimate",
            left_len: a.len(),
            right: "reference",
            right_len: b.len(),
        });
    }
    if a.len() < min {
        return Err(if a.is_empty() {
            AnalysisError::Empty { what: "estimate" }
        } else {
            AnalysisError::InvalidParameter {
                name: "estimate",
                reason: format!("needs at least {min} values, found {}", a.len()),
            }
        });
    }
    ensure_finite("estimate", a)?;
    ensure_finite("reference", b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_share_ties() {
        assert_eq!(
            average_ranks(&[3.0, 1.0, 3.0, 2.0]),
            vec![3.5, 1.0, 3.5, 2.0]
        );
    }

    #[test]
    fn spearman_values() {
        assert_eq!(
            spearman(&[1.0, 2.0, 3.0], &[10.0, 20.0, 25.0]),
            Ok(Some(1.0))
        );
        let r = spearman(&[1.0, 2.0, 3.0, 4.0], &[4.0, 3.0, 2.0, 1.0])
            .unwrap()
            .unwrap();
        assert!((r + 1.0).abs() < 1e-12);
        // d = (0, 0, 1, -1): 1 - 6 * 2 / (4 * 15) = 0.8
        let r = spearman(&[1.0, 2.0, 3.0, 4.0], &[1.0, 2.0, 4.0, 3.0])
            .unwrap()
            .unwrap();
        assert!((r - 0.8).abs() < 1e-12);
        assert_eq!(spearman(&[1.0, 1.0], &[1.0, 2.0]), Ok(None));
        assert!(spearman(&[1.0], &[1.0]).is_err());
        assert!(spearman(&[1.0, f64::NAN], &[1.0, 2.0]).is_err());
        assert!(spearman(&[1.0, 2.0], &[1.0]).is_err());
    }

    #[test]
    fn recall_uses_magnitudes() {
        assert_eq!(topk_recall(&[0.9, 0.1, 0.5], &[1.0, 0.0, -0.8], 2), Ok(1.0));
        assert_eq!(topk_recall(&[0.9, 0.1, 0.5], &[0.0, 1.0, -0.8], 2), Ok(0.5));
        assert_eq!(topk_recall(&[0.9, 0.1, 0.5], &[0.0, 1.0, -0.8], 1), Ok(0.0));
        // k at or above the number of components: vacuous, refused.
        assert!(topk_recall(&[0.9, 0.1], &[1.0, 0.0], 5).is_err());
        assert!(topk_recall(&[0.9, 0.1], &[0.0, 1.0], 2).is_err());
        assert!(topk_recall(&[1.0], &[1.0], 0).is_err());
        assert!(topk_recall(&[], &[], 1).is_err());
    }
}
