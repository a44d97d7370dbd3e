//! THE top-k rule of every model (the lightning indexer, the MoE router, any other
//! selection): keep the `k` largest scores along the last axis and, among equal
//! scores, the lower index wins (what a stable descending sort keeps).
//!
//! Backends' own `topk` / `sort` break ties arbitrarily (burn-flex uses an unstable
//! sort, LibTorch's CPU `topk` depends on the row length), so a set chosen by them can
//! change with the length of the sequence, the batch or the backend: with the indexer's
//! scores, sums of ReLUs that tie at exactly 0 all the time, that made a position's
//! logits depend on later tokens. Here only the k-th largest VALUE comes from the
//! backend's `topk` (the same whichever tied entries it picked); which entries are kept
//! is decided by elementwise comparisons and a cumulative sum, identically everywhere.
//! Equality is IEEE equality (`-0.0 == 0.0`); NaN scores are never selected.

use burn::tensor::{Bool, Int, Tensor};

/// `[.., n]` -> `[.., n]`: true for the `min(k, n)` entries kept along the last axis
/// (the largest scores; among ties, the lower indices). Entries that must never be kept
/// (e.g. entries a query cannot see) should be `-inf` and, when fewer than `k` finite
/// entries exist, masked out by the caller.
pub fn topk_mask<const D: usize>(scores: Tensor<D>, k: usize) -> Tensor<D, Bool> {
    let dims = scores.dims();
    let n = dims[D - 1];
    if k >= n {
        return scores.clone().equal(scores); // everything but NaN
    }
    if k == 0 {
        return scores.zeros_like().greater_elem(1.0);
    }
    let scores = scores.detach();
    let kth = scores
        .clone()
        .topk(k, D - 1)
        .slice_dim(D - 1, k - 1..k)
        .expand(dims);
    let greater = scores.clone().greater(kth.clone());
    let room = greater
        .clone()
        .int()
        .sum_dim(D - 1)
        .neg()
        .add_scalar(k as i64)
        .expand(dims);
    let tied = scores.equal(kth);
    let tie_rank = tied.clone().int().cumsum(D - 1); // 1-based among the tied entries
    greater.bool_or(tied.bool_and(tie_rank.lower_equal(room)))
}

/// The indices of a selection, `[.., n]` -> `[.., k]`, in ascending index order, and
/// whether each slot holds one (`false` where fewer than `k` entries are selected; the
/// index there is arbitrary and must not be read).
pub fn selected_indices<const D: usize>(
    selected: Tensor<D, Bool>,
    k: usize,
) -> (Tensor<D, Int>, Tensor<D, Bool>) {
    let dims = selected.dims();
    let n = dims[D - 1];
    let device = selected.device();
    // Selected entry i scores n - i (distinct, larger for lower i); the rest score 0.
    let rank = Tensor::<1, Int>::arange(0..n as i64, &device)
        .float()
        .neg()
        .add_scalar(n as f64);
    let mut shape = [1usize; D];
    shape[D - 1] = n;
    let key = selected.float() * rank.reshape(shape).expand(dims);
    let (vals, idx) = key.topk_with_indices(k.min(n), D - 1);
    (idx, vals.greater_elem(0.5))
}

/// The `min(k, n)` entries kept by [`topk_mask`], as indices in ascending order (all
/// slots valid when the scores are not NaN).
pub fn topk_indices<const D: usize>(scores: Tensor<D>, k: usize) -> Tensor<D, Int> {
    let k = k.min(scores.dims()[D - 1]);
    selected_indices(topk_mask(scores, k), k).0
}

/// The relative gap under which a top-k boundary counts as decided by float rounding:
/// the k-th and (k+1)-th largest scores differ by at most this times the row's largest
/// |score| (the rule of the real-width fixture's `near_boundary`, generate.py). At real
/// width the indexer's scores are sums of thousands of f32 products, and another
/// backend's or library's order of summation moves them by about this much.
pub const NEAR_BOUNDARY_REL: f64 = 1e-6;

/// Whether keeping the `k` largest of `scores` (one query's candidates: the closed
/// entries) is decided within float rounding: `None` when nothing is decided (no more
/// than `k` candidates), else whether the k-th and (k+1)-th largest differ by at most
/// [`NEAR_BOUNDARY_REL`] x the largest |score|. Non-finite scores are ignored.
pub fn near_boundary(scores: &[f32], k: usize) -> Option<bool> {
    let mut s: Vec<f64> = scores
        .iter()
        .filter(|x| x.is_finite())
        .map(|&x| f64::from(x))
        .collect();
    if k == 0 || s.len() <= k {
        return None;
    }
    s.sort_by(|a, b| b.total_cmp(a));
    let scale = s.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    Some((s[k - 1] - s[k]) / scale <= NEAR_BOUNDARY_REL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_boundary_within_rounding_is_near_and_a_clear_one_is_not() {
        // k = 2 of 4: the 2nd and 3rd largest are 1.0 and 1.0 + 1e-7 (a few f32 ulps).
        assert_eq!(near_boundary(&[3.0, 1.0, 1.000_000_1, -2.0], 2), Some(true));
        assert_eq!(near_boundary(&[3.0, 1.0, 0.9, -2.0], 2), Some(false));
        // Exact ties at the boundary (ReLU sums at 0) are near.
        assert_eq!(near_boundary(&[0.0, 0.0, 0.0, 5.0], 2), Some(true));
        // Nothing decided: no more candidates than k.
        assert_eq!(near_boundary(&[1.0, 2.0], 2), None);
        assert_eq!(near_boundary(&[1.0, f32::NEG_INFINITY, 2.0], 2), None);
    }

    use burn::tensor::TensorData;

    fn dev() -> burn::tensor::Device {
        crate::device::DeviceSpec::Cpu.device().expect("cpu")
    }

    fn mask_of(values: Vec<f32>, n: usize, k: usize) -> Vec<bool> {
        let rows = values.len() / n;
        let t = Tensor::<2>::from_data(TensorData::new(values, [rows, n]), &dev());
        topk_mask(t, k)
            .into_data()
            .try_to_vec::<bool>()
            .expect("bool data")
    }

    /// The naive rule: sort (score desc, index asc), keep the first k.
    fn naive(values: &[f32], k: usize) -> Vec<bool> {
        let mut order: Vec<usize> = (0..values.len()).collect();
        order.sort_by(|&a, &b| values[b].partial_cmp(&values[a]).unwrap().then(a.cmp(&b)));
        let mut out = vec![false; values.len()];
        for &i in order.iter().take(k) {
            out[i] = true;
        }
        out
    }

    #[test]
    fn among_ties_the_lower_index_wins() {
        let v = vec![0.0, 1.0, 0.0, 0.0, 2.0, 0.0];
        assert_eq!(
            mask_of(v, 6, 3),
            vec![true, true, false, false, true, false]
        );
    }

    #[test]
    fn negative_zero_ties_with_zero() {
        let v = vec![-0.0, 0.0, -0.0, 0.0];
        assert_eq!(mask_of(v, 4, 2), vec![true, true, false, false]);
    }

    #[test]
    fn selection_matches_the_stable_sort_on_many_tied_rows() {
        // Values from a tiny set, so that most rows tie at the k-th value.
        let n = 37;
        let mut values = Vec::new();
        let mut x: u64 = 12345;
        for _ in 0..(50 * n) {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            values.push(((x >> 60) % 4) as f32 - 1.0);
        }
        for k in [1, 2, 5, 17, 36, 37] {
            let got = mask_of(values.clone(), n, k);
            for r in 0..50 {
                let row = &values[r * n..(r + 1) * n];
                assert_eq!(
                    &got[r * n..(r + 1) * n],
                    naive(row, k).as_slice(),
                    "k {k} row {r}"
                );
            }
        }
    }

    #[test]
    fn the_kept_set_does_not_depend_on_entries_after_it() {
        // Row prefixes of growing length: the choice among the first 8 entries is the
        // same whatever follows, as long as later entries are not larger.
        let base = [0.5f32, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0];
        let want = mask_of(base.to_vec(), 8, 4);
        for extra in [0usize, 1, 9, 200] {
            let mut v = base.to_vec();
            v.extend(std::iter::repeat_n(f32::NEG_INFINITY, extra));
            let got = mask_of(v, 8 + extra, 4);
            assert_eq!(&got[..8], want.as_slice(), "{extra} entries after");
        }
    }

    #[test]
    fn indices_come_in_ascending_order_with_validity() {
        let sel = Tensor::<2, Bool>::from_data(
            TensorData::new(vec![false, true, false, true, true, false], [1, 6]),
            &dev(),
        );
        let (idx, valid) = selected_indices(sel, 4);
        let idx: Vec<i64> = idx
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .expect("ints");
        let valid: Vec<bool> = valid.into_data().try_to_vec::<bool>().expect("bools");
        assert_eq!(&idx[..3], &[1, 3, 4]);
        assert_eq!(valid, vec![true, true, true, false]);
    }
}
