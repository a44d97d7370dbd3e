//! Lightning-indexer distillation (`[train] indexer_distill`), as DeepSeek trains the
//! indexers of its sparse attention.
//!
//! The indexer's top-k passes no gradient, so without this loss a trained organism's
//! indexer keeps its initial weights, and its selection is content-blind. Under a
//! selecting top-k, that choice is where v4pro-select's weak phases come from (its
//! recipe notes). The loss, per CSA layer and query with at least one selected entry:
//!
//! `KL(p || q)`, where:
//! - `p` is the main attention's probability on each selected compressed entry, summed
//!   over heads and renormalised over the selected set. It comes from `hook_pattern`
//!   and is detached: a target.
//! - `q` is the softmax of the indexer's scores (`hook_scores`) over the same set.
//!
//! The loss averages over those queries and then over the layers. With every closed
//! entry selected (`index_topk` at least the number of entries), it is DeepSeek's dense
//! warm-up loss. With a selecting top-k, it is their sparse-stage loss over the
//! selected set. The indexer reads its inputs detached (deepseek_v4/attention.rs), so
//! this loss trains the indexer's own weights and nothing else.
//!
//! Cost: the CSA layers run as one dense block while their pattern is captured, with
//! `batch x heads x tokens x (entries + tokens)` probabilities per layer. That is fine
//! at organism prompts of ~100 tokens; at thousands it is the memory of the pattern.

use burn::tensor::Tensor;
use burn::tensor::activation::log_softmax;

use crate::error::{Error, Result};
use crate::hooks::{ActivationCache, HookPoint, HookSpec, Site};

/// The captures the loss reads, for the CSA layers `layers`.
pub fn spec(layers: &[usize]) -> HookSpec {
    HookSpec::new().capture_sites(
        layers.iter().copied(),
        &[
            Site::IndexerScores,
            Site::IndexerSelected,
            Site::AttnPattern,
        ],
    )
}

/// The distillation loss over `layers` from a forward's `cache` (captured with
/// [`spec`]): the mean over layers of the mean `KL(p || q)` over the queries that
/// selected at least one entry (0 where none did).
pub fn indexer_kl(cache: &ActivationCache, layers: &[usize]) -> Result<Tensor<1>> {
    let mut total: Option<Tensor<1>> = None;
    for &l in layers {
        let get = |site| {
            let p = HookPoint::block(l, site);
            cache.get(&p).ok_or_else(|| {
                Error::hook(p.to_string(), "not captured for the indexer distillation")
            })
        };
        let scores: Tensor<3> = get(Site::IndexerScores)?.get()?;
        let selected: Tensor<3> = get(Site::IndexerSelected)?.get::<3>()?.detach();
        let pattern: Tensor<4> = get(Site::AttnPattern)?.get::<4>()?.detach();
        let [b, t, n] = scores.dims();
        let slots = pattern.dims()[3];
        if slots < n {
            return Err(Error::Other(format!(
                "layer {l}: hook_pattern has {slots} key slots, fewer than the indexer's {n} entries"
            )));
        }
        let mask = selected.greater_elem(0.5);
        // The attention's mass on each entry, over heads, on the selected set.
        let mass = pattern
            .slice_dim(3, 0..n)
            .sum_dim(1)
            .reshape([b, t, n])
            .mask_fill(mask.clone().bool_not(), 0.0);
        let norm = mass.clone().sum_dim(2); // [b, t, 1]
        let any = norm.clone().greater_elem(0.0).float(); // queries with a target
        let p = mass / norm.clamp_min(1e-30);
        // Entries outside the set: a large finite negative score, so that 0 * log q
        // stays 0 (an infinite one would make it NaN).
        let log_q = log_softmax(scores.mask_fill(mask.bool_not(), -1e9), 2);
        let log_p = p.clone().clamp_min(1e-30).log();
        let kl_rows = (p * (log_p - log_q)).sum_dim(2) * any.clone(); // [b, t, 1]
        let count = any.sum().clamp_min(1.0);
        let layer_kl = kl_rows.sum() / count;
        total = Some(match total {
            Some(t) => t + layer_kl,
            None => layer_kl,
        });
    }
    let total =
        total.ok_or_else(|| Error::Other("indexer distillation without CSA layers".into()))?;
    Ok(total / layers.len() as f64)
}
