//! The chunk selector of the `evict` overlay (ChunkKV-style eviction at prefill): the
//! last `observe` tokens of the prefill (the sequence but its last `decode` tokens) are
//! the observation window; their attention
//! over the earlier tokens, summed over query heads and observation queries and then
//! within each chunk, scores the chunks; the best `keep` fraction of them stays in the
//! cache for every query from the observation window on, the rest is gone. Queries
//! before the window (the prefill itself) see every earlier token.
//!
//! Hook points (per layer, once per forward: the eviction is one decision per
//! sequence): `attn.indexer.hook_scores` `[batch, chunk]`, each chunk's attention mass
//! from the observation window, and `attn.indexer.hook_selected` `[batch, chunk]`, 1.0
//! for the kept chunks. Chunks tile the tokens before the window (`chunk` tokens each,
//! boundaries at `offset + i * chunk`; a chunk reaching into the window counts only its
//! tokens before it). Changing the scores changes which chunks the top-`keep` keeps;
//! changing the kept mask (values > 0.5 kept, any number) changes which chunks every
//! query from the window on reads.

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Tensor, TensorData};

use super::select::{Grid, host_mask};
use crate::error::Result;
use crate::hooks::{HookPoint, HookRun, Site};
use crate::model::attention::EntrySelector;
use crate::model::kv_state::Queries;
use crate::model::topk::topk_mask;

/// The geometry of an `evict` overlay.
#[derive(Debug, Clone, Copy)]
pub struct Eviction {
    /// Tokens per chunk.
    pub chunk: usize,
    /// Where the chunk grid starts.
    pub offset: usize,
    /// The fraction of chunks kept (`0 < keep <= 1`).
    pub keep: f64,
    /// Observation-window tokens (the sequence's last ones).
    pub observe: usize,
    /// Leading tokens always kept.
    pub sinks: usize,
    /// Trailing tokens decoded after the prefill (not in the observation window).
    pub decode: usize,
}

/// One layer's selector for one forward.
pub struct ChunkSelector {
    /// `[b, n_chunks]`: the kept chunks (before the window).
    kept: Tensor<2, Bool>,
    grid: Grid,
    /// The first observation position (`total - decode - observe`, at least 0).
    t0: usize,
    sinks: usize,
    total: usize,
    first: Vec<usize>,
}

impl ChunkSelector {
    /// The selector of layer `layer` for rotated queries `q_all: [b, total, nh, dh]` of
    /// EVERY position (a suffix forward passes the base run's queries where it does not
    /// recompute) and rotated keys `k: [b, total, kvh, dh]`, attention scale `scale`.
    /// The chunk scores go through `attn.indexer.hook_scores` and the kept chunks
    /// through `attn.indexer.hook_selected` (both `[b, n_chunks]`).
    pub fn new(
        layer: usize,
        (q_all, k): (Tensor<4>, Tensor<4>),
        queries: &Queries,
        e: Eviction,
        scale: f64,
        hooks: &mut HookRun,
    ) -> Result<Self> {
        let [b, total, _, _] = q_all.dims();
        // The prefill ends at `end`; the window is its last `observe` tokens.
        let end = total.saturating_sub(e.decode);
        let t0 = end.saturating_sub(e.observe);
        let grid = Grid::new(e.chunk, e.offset, t0.max(1));
        let device = k.device();
        let scores = if t0 == 0 {
            Tensor::<2>::zeros([b, grid.n], &device)
        } else {
            chunk_scores(q_all, k, (t0, end), grid, scale)
        };
        let scores = hooks.apply(HookPoint::block(layer, Site::IndexerScores), scores)?;
        let kept = if t0 == 0 {
            scores.zeros_like().greater_elem(0.5)
        } else {
            let n = ((e.keep * grid.n as f64).ceil() as usize).clamp(1, grid.n);
            topk_mask(scores, n)
        };
        // 1.0 = kept; an intervention may keep any number of chunks.
        let kept = hooks.apply_mask(HookPoint::block(layer, Site::IndexerSelected), kept, None)?;
        Ok(ChunkSelector {
            kept,
            grid,
            t0,
            sinks: e.sinks,
            total,
            first: (0..queries.rows()).map(|r| queries.first(r)).collect(),
        })
    }
}

/// `[b, n_chunks]`: the attention mass the observation queries `t0..end` of rotated
/// `q_all: [b, total, nh, dh]` put on each chunk of `grid` (its tokens before `t0`), a
/// softmax over the keys `k: [b, total, kvh, dh]` each query sees, summed over query
/// heads, observation queries and the chunk's tokens.
fn chunk_scores(
    q_all: Tensor<4>,
    k: Tensor<4>,
    (t0, end): (usize, usize),
    grid: Grid,
    scale: f64,
) -> Tensor<2> {
    let [b, total, nh, dh] = q_all.dims();
    let kvh = k.dims()[2];
    let g = nh / kvh.max(1);
    let obs = end - t0;
    let device = k.device();
    // [b, kvh, obs * g, dh] x [b, kvh, dh, total] -> scores of the window's queries.
    let q = q_all
        .slice_dim(1, t0..end)
        .reshape([b, obs, kvh, g, dh])
        .swap_dims(1, 2)
        .reshape([b, kvh, obs * g, dh]);
    let kt = k.permute([0, 2, 3, 1]);
    let s = q
        .matmul(kt)
        .mul_scalar(scale)
        .reshape([b, kvh, obs, g, total]);
    // Causal: observation query t0 + i sees keys 0..=t0 + i.
    let vis: Vec<bool> = (0..obs)
        .flat_map(|i| (0..total).map(move |j| j <= t0 + i))
        .collect();
    let vis = Tensor::<1, Bool>::from_data(TensorData::new(vis, [obs * total]), &device)
        .reshape([1, 1, obs, 1, total]);
    let p = softmax(s.mask_fill(vis.bool_not(), f32::NEG_INFINITY), 4);
    // Attention mass on each token before the window: [b, t0].
    let mass = p
        .slice_dim(4, 0..t0)
        .sum_dim(3)
        .sum_dim(2)
        .sum_dim(1)
        .reshape([b, t0]);
    grid.pad(mass, 0.0)
        .reshape([b, grid.n, grid.block])
        .sum_dim(2)
        .reshape([b, grid.n])
}

impl EntrySelector for ChunkSelector {
    fn k(&self) -> usize {
        self.total
    }

    fn cost_per_entry(&self) -> usize {
        1
    }

    fn select(
        &mut self,
        i0: usize,
        i1: usize,
        n_vis: usize,
        _hooks: &mut HookRun,
    ) -> Result<Tensor<3, Bool>> {
        let (b, bq) = (self.first.len(), i1 - i0);
        let device = self.kept.device();
        // Token j < t0 of a kept chunk, as a [b, 1, n_vis] row.
        let chunks: Vec<usize> = (0..n_vis)
            .map(|j| self.grid.of(j.min(self.t0.max(1) - 1)))
            .collect();
        let idx = crate::model::layers::int_tensor(&chunks, &device);
        let kept_tok = self
            .kept
            .clone()
            .float()
            .select(1, idx)
            .greater_elem(0.5)
            .reshape([b, 1, n_vis]);
        let (t0, sinks) = (self.t0, self.sinks);
        // Prefill queries, the window itself and the sinks are never evicted.
        let span = (i0, i1);
        let always = host_mask(&self.first, span, n_vis, &device, |p, j| {
            j <= p && (p < t0 || j >= t0 || j < sinks)
        });
        let evictable = host_mask(&self.first, span, n_vis, &device, |p, j| {
            j <= p && p >= t0 && j < t0
        });
        Ok(always.bool_or(evictable.bool_and(kept_tok.expand([b, bq, n_vis]))))
    }
}
