//! The lightning indexer of CSA layers: scores every closed compressed entry for every
//! query, `score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) / sqrt(index_head_dim)`,
//! and keeps the top `index_topk` closed entries ([`crate::model::topk`]: among equal
//! scores the lower entry index wins). Its keys come from its own overlapping
//! compressor at `index_head_dim` (same rate and layout as the layer's CSA compressor);
//! its queries from the attention's low-rank query residual `q_res`; its head weights
//! `w = weights_proj(x) / sqrt(index_n_heads)` from the attention input.

use burn::module::Module;
use burn::tensor::activation::relu;
use burn::tensor::{Bool, Int, Tensor, TensorData};

use super::compressor::Pooler;
use super::rope;
use crate::error::Result;
use crate::hooks::{HookPoint, HookRun, Site};
use crate::model::layers::{Linear, RopeTables};
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

/// Geometry shared by the CSA layers of one forward pass.
pub struct CsaGeometry {
    /// Number of closed entries of the whole sequence.
    pub n_entries: usize,
    /// `[1, t, 1]`: `(t + 1) / m`, the number of closed entries query t may see.
    pub closed: Tensor<3, Int>,
    /// `[1, t, n]`: entry s closed for query t.
    pub closed_mask: Tensor<3, Bool>,
    /// RoPE tables at the window starts.
    pub starts: RopeTables,
}

impl Indexer {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        vb: &Vb,
        d_model: usize,
        q_lora_rank: usize,
        n_heads: usize,
        head_dim: usize,
        rate: usize,
        topk: usize,
        eps: f64,
    ) -> Result<Self> {
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

    /// The entries each query keeps: `[b, t, n]` (true = selected; always closed).
    /// `x` is the attention input, `q_res` the normalised low-rank query, `tokens` the
    /// compress RoPE tables at positions `0..t`.
    pub fn select(
        &self,
        layer: usize,
        x: &Tensor<3>,
        q_res: &Tensor<3>,
        tokens: &RopeTables,
        geo: &CsaGeometry,
        hooks: &mut HookRun,
    ) -> Result<Tensor<3, Bool>> {
        let windows = self
            .pooler
            .windows(x)
            .expect("the caller checked that entries exist");
        self.select_with(
            layer,
            windows,
            x,
            q_res,
            tokens,
            &geo.starts,
            &geo.closed,
            &geo.closed_mask,
            hooks,
        )
    }

    /// [`Indexer::select`] from the indexer pooler's windows of the whole sequence, for
    /// queries `x, q_res: [b, lq, *]` at the positions of the `tokens` tables
    /// ([`rope::rotate`]), with `closed: [1 or b, lq, 1]` (closed entries per query)
    /// and `closed_mask: [1 or b, lq, n]`.
    #[allow(clippy::too_many_arguments)]
    pub fn select_with(
        &self,
        layer: usize,
        (w, values): (Tensor<4>, Tensor<4>),
        x: &Tensor<3>,
        q_res: &Tensor<3>,
        tokens: &RopeTables,
        starts: &RopeTables,
        _closed: &Tensor<3, Int>,
        closed_mask: &Tensor<3, Bool>,
        hooks: &mut HookRun,
    ) -> Result<Tensor<3, Bool>> {
        let [b, t, _] = x.dims();
        let (hi, di) = (self.n_heads, self.head_dim);
        let n = w.dims()[1];
        let keys = self.pooler.pool(w, values).reshape([b, n, 1, di]);
        let keys = rope::rotate(keys, starts, false).reshape([b, n, di]);
        let q = self.q_b_proj.forward(q_res.clone()).reshape([b, t, hi, di]);
        let q = rope::rotate(q, tokens, false).reshape([b, t * hi, di]);
        let dots = relu(q.matmul(keys.swap_dims(1, 2))) * (1.0 / (di as f64).sqrt());
        let weights = self.scorer.weights_proj.forward(x.clone()) * (1.0 / (hi as f64).sqrt());
        let scores = (dots.reshape([b, t, hi, n]) * weights.reshape([b, t, hi, 1]))
            .sum_dim(2)
            .reshape([b, t, n]);
        let scores = hooks.apply(HookPoint::block(layer, Site::IndexerScores), scores)?;

        // The top-k rule of every model: among equal scores the lower index wins.
        let k = self.topk.min(n);
        let closed = closed_mask.clone().expand([b, t, n]);
        let masked = scores.mask_fill(closed.clone().bool_not(), f32::NEG_INFINITY);
        let selected = topk_mask(masked, k).bool_and(closed);
        hooks.record(HookPoint::block(layer, Site::IndexerTopk), || {
            let (idx, valid) = selected_indices(selected.clone(), k);
            idx.float().mask_fill(valid.bool_not(), -1.0)
        });
        Ok(selected)
    }
}

impl CsaGeometry {
    /// For a sequence of `t` tokens at rate `m`.
    pub fn new(t: usize, m: usize, starts: RopeTables, device: &burn::tensor::Device) -> Self {
        let n = t / m;
        let closed: Vec<i64> = (0..t).map(|q| ((q + 1) / m) as i64).collect();
        let mut mask = Vec::with_capacity(t * n);
        for q in 0..t {
            for s in 0..n {
                mask.push(s < (q + 1) / m);
            }
        }
        CsaGeometry {
            n_entries: n,
            closed: Tensor::from_data(TensorData::new(closed, [1, t, 1]), device),
            closed_mask: Tensor::from_data(TensorData::new(mask, [1, t, n]), device),
            starts,
        }
    }
}
