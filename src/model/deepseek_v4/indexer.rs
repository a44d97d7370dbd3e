//! The lightning indexer of CSA layers: scores every closed compressed entry for every
//! query, `score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) / sqrt(index_head_dim)`,
//! and keeps the top `index_topk` closed entries (`crate::model::topk`: among equal
//! scores the lower entry index wins). Its keys come from its own overlapping
//! compressor at `index_head_dim` (same rate and layout as the layer's CSA compressor);
//! its queries from the attention's low-rank query residual `q_res`; its head weights
//! `w = weights_proj(x) / sqrt(index_n_heads)` from the attention input.

use burn::module::Module;
use burn::tensor::activation::relu;
use burn::tensor::{Bool, Tensor};

use super::config::DeepseekV4Config;
use super::pooler::Pooler;
use super::rope;
use crate::error::Result;
use crate::hooks::{HookPoint, HookRun, Site};
use crate::model::attention::EntrySelector;
use crate::model::flops::Mm;
use crate::model::kv_state::Queries;
use crate::model::layers::{Linear, RopeTables, cat_dim1, int_tensor};
use crate::model::topk::{selected_indices, topk_mask};
use crate::model::weights::Vb;

/// `scorer.weights_proj`: per-head weights of the index score.
#[derive(Module, Debug)]
pub struct Scorer {
    /// `[index_n_heads, d_model]`
    pub weights_proj: Linear,
}

/// One CSA layer's lightning indexer.
#[derive(Module, Debug)]
pub struct Indexer {
    /// Overlapping compressor at `index_head_dim` (names `kv_proj`, `gate_proj`,
    /// `position_bias`, `kv_norm` directly under `indexer`).
    pub pooler: Pooler,
    /// `[index_n_heads * index_head_dim, q_lora_rank]`
    pub q_b_proj: Linear,
    pub scorer: Scorer,
    #[module(skip)]
    pub n_heads: usize,
    #[module(skip)]
    pub head_dim: usize,
    #[module(skip)]
    pub topk: usize,
}

/// The queries an index selection scores: the head weights ([`Indexer::head_weights`]
/// of the attention input) and the low-rank query residual `q_res` (`[b, lq, *]`) at the
/// computed positions `queries`, with the compress RoPE tables there.
pub struct IndexQueries<'a> {
    /// `[b, lq, index_n_heads]`, [`Indexer::head_weights`].
    pub heads: &'a Tensor<3>,
    /// `[b, lq, q_lora_rank]`, the attention's query residual.
    pub q_res: &'a Tensor<3>,
    /// Compress RoPE tables at the computed positions.
    pub tables: &'a RopeTables,
    /// The computed positions of every row.
    pub queries: &'a Queries,
}

impl Indexer {
    /// The indexer of a CSA layer of a `c` model under `vb` (`...compressor.indexer`).
    pub fn new(vb: &Vb, c: &DeepseekV4Config) -> Result<Self> {
        let (d_model, q_lora_rank) = (c.hidden_size, c.q_lora_rank);
        let (n_heads, head_dim, topk) = (c.index_n_heads, c.index_head_dim, c.index_topk);
        let (rate, eps) = (c.csa_rate, c.rms_norm_eps);
        Ok(Indexer {
            pooler: Pooler::new(vb, d_model, head_dim, rate, true, eps)?,
            q_b_proj: Linear::new(
                &vb.pp("q_b_proj"),
                q_lora_rank,
                n_heads * head_dim,
                1.0 / (q_lora_rank as f64).sqrt(),
            )?,
            scorer: Scorer {
                weights_proj: Linear::new(
                    &vb.pp("scorer").pp("weights_proj"),
                    d_model,
                    n_heads,
                    1.0 / (d_model as f64).sqrt(),
                )?,
            },
            n_heads,
            head_dim,
            topk,
        })
    }

    /// The per-query head weights `w[t, h]` (`[b, lq, index_n_heads]`, scaled by `1 /
    /// sqrt(index_n_heads)`) from the attention input `x: [b, lq, d_model]`.
    pub fn head_weights(&self, x: &Tensor<3>) -> Tensor<3> {
        self.scorer.weights_proj.forward(x.clone()) * (1.0 / (self.n_heads as f64).sqrt())
    }

    /// The selector of layer `layer` in one forward: the index keys of every closed
    /// window (`[b, n, 1, index_head_dim]`, pooled by its [`Pooler`] and rotated at the
    /// window starts: [`Pooler::entries_through`]), scored for the queries `at`.
    pub fn selector(
        &self,
        layer: usize,
        keys: Tensor<4>,
        at: IndexQueries,
    ) -> Result<IndexSelector> {
        let IndexQueries {
            heads,
            q_res,
            tables: tokens,
            queries,
        } = at;
        let [b, t, _] = heads.dims();
        let (hi, di) = (self.n_heads, self.head_dim);
        let n = keys.dims()[1];
        let keys = keys.reshape([b, n, di]);
        let q = self.q_b_proj.forward(q_res.clone()).reshape([b, t, hi, di]);
        let q = rope::rotate(q, tokens, false);
        Ok(IndexSelector {
            layer,
            topk: self.topk.min(n),
            rate: self.pooler.rate,
            q,
            weights: heads.clone(),
            keys,
            first: (0..b).map(|r| queries.first(r)).collect(),
            picked: Vec::new(),
        })
    }
}

/// The lightning indexer of one CSA layer in one forward, as the attention core's
/// [`EntrySelector`]: `score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) /
/// sqrt(index_head_dim)` over the closed entries, and the top `index_topk` of them
/// (`crate::model::topk`).
pub struct IndexSelector {
    layer: usize,
    topk: usize,
    rate: usize,
    /// `[b, lq, hi, di]`, rotated.
    q: Tensor<4>,
    /// `[b, lq, hi]`, scaled by `1 / sqrt(hi)`.
    weights: Tensor<3>,
    /// `[b, n, di]`, rotated.
    keys: Tensor<3>,
    /// First computed position of each row.
    first: Vec<usize>,
    /// Kept indices per block (for `hook_topk`): `[b, bq, topk]`, -1 = none.
    picked: Vec<Tensor<3>>,
}

impl IndexSelector {
    /// Record `hook_topk` (the kept entries of every query) if it is captured.
    pub fn finish(self, hooks: &mut HookRun) {
        let point = HookPoint::block(self.layer, Site::IndexerTopk);
        let picked = self.picked;
        hooks.record(point, || cat_dim1(picked));
    }
}

impl EntrySelector for IndexSelector {
    fn k(&self) -> usize {
        self.topk
    }

    fn cost_per_entry(&self) -> usize {
        self.q.dims()[2]
    }

    fn select(
        &mut self,
        i0: usize,
        i1: usize,
        n_vis: usize,
        hooks: &mut HookRun,
    ) -> Result<Tensor<3, Bool>> {
        let [b, _, hi, di] = self.q.dims();
        let bq = i1 - i0;
        let q = self
            .q
            .clone()
            .slice_dim(1, i0..i1)
            .reshape([b, bq * hi, di]);
        let keys = self.keys.clone().slice_dim(1, 0..n_vis);
        let dots = relu(q.mm(keys.swap_dims(1, 2))) * (1.0 / (di as f64).sqrt());
        let w = self.weights.clone().slice_dim(1, i0..i1);
        let scores = (dots.reshape([b, bq, hi, n_vis]) * w.reshape([b, bq, hi, 1]))
            .sum_dim(2)
            .reshape([b, bq, n_vis]);
        let scores = hooks.apply(HookPoint::block(self.layer, Site::IndexerScores), scores)?;
        // Entry s is closed for the query at position p iff (s + 1) * rate <= p + 1.
        let device = scores.device();
        let pos: Vec<usize> = self.first.iter().flat_map(|&f| f + i0..f + i1).collect();
        let closes: Vec<usize> = (0..n_vis).map(|s| (s + 1) * self.rate - 1).collect();
        let shape = [b, bq, n_vis];
        let closed = int_tensor(&closes, &device)
            .reshape([1, 1, n_vis])
            .expand(shape)
            .lower_equal(int_tensor(&pos, &device).reshape([b, bq, 1]).expand(shape));
        // The top-k rule of every model: among equal scores the lower index wins.
        let k = self.topk.min(n_vis);
        let masked = scores.mask_fill(closed.clone().bool_not(), f32::NEG_INFINITY);
        let selected = topk_mask(masked, k).bool_and(closed.clone());
        if hooks
            .spec()
            .captures_point(&HookPoint::block(self.layer, Site::IndexerTopk))
        {
            let (idx, valid) = selected_indices(selected.clone(), k);
            let mut kept = idx.float().mask_fill(valid.bool_not(), -1.0);
            if k < self.topk {
                let pad = Tensor::<3>::full([b, bq, self.topk - k], -1.0, &device);
                kept = Tensor::cat(vec![kept, pad], 2);
            }
            self.picked.push(kept);
        }
        // 1.0 = kept; an intervention may keep any closed entries (never an open one).
        let point = HookPoint::block(self.layer, Site::IndexerSelected);
        hooks.apply_mask(point, selected, Some(closed))
    }
}
