//! The block selector of the `select` overlay: Quest's min / max bound (or the mean key)
//! per block, the top-k blocks per query (shared by the layer's heads), expanded to the
//! raw tokens the query then reads as entries.

use std::fmt;

use burn::tensor::{Bool, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::hooks::{HookPoint, HookRun, Site};
use crate::model::attention::EntrySelector;
use crate::model::kv_state::Queries;
use crate::model::layers::int_tensor;
use crate::model::topk::topk_mask;

/// How a block is scored against a query.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockScore {
    /// Quest's upper bound `sum_d max(q_d min_d, q_d max_d)` over the block's keys.
    #[default]
    MinMax,
    /// The query against the block's mean key.
    Mean,
}

impl fmt::Display for BlockScore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BlockScore::MinMax => "min-max bound",
            BlockScore::Mean => "mean key",
        })
    }
}

/// The block grid of a prompt of `total` tokens: blocks of `block` tokens with
/// boundaries at `offset + i * block` (tokens before `offset` form block 0).
#[derive(Debug, Clone, Copy)]
pub struct Grid {
    /// Tokens per block.
    pub block: usize,
    /// `(block - offset) mod block`: token `j` is in block `(j + shift) / block`.
    pub shift: usize,
    /// Blocks.
    pub n: usize,
}

impl Grid {
    /// The grid of `total` tokens.
    pub fn new(block: usize, offset: usize, total: usize) -> Self {
        let shift = (block - offset % block) % block;
        Grid {
            block,
            shift,
            n: (total + shift).div_ceil(block),
        }
    }

    /// The block of token `j`.
    pub fn of(&self, j: usize) -> usize {
        (j + self.shift) / self.block
    }

    /// The first token of block `b`.
    pub fn start(&self, b: usize) -> usize {
        (b * self.block).saturating_sub(self.shift)
    }

    /// `t` (tokens of the grid on axis 1) padded with `fill` before its first token
    /// (`shift`) and after its last, to `n * block` rows on axis 1: a `[.., n, block,
    /// ..]` reshape then groups the blocks.
    pub fn pad<const D: usize>(&self, t: Tensor<D>, fill: f32) -> Tensor<D> {
        let dims = t.dims();
        let device = t.device();
        let tail = self.n * self.block - dims[1] - self.shift;
        let filled = |len: usize| {
            let mut shape = dims;
            shape[1] = len;
            Tensor::<D>::full(shape, fill, &device)
        };
        let mut parts = Vec::with_capacity(3);
        if self.shift > 0 {
            parts.push(filled(self.shift));
        }
        parts.push(t);
        if tail > 0 {
            parts.push(filled(tail));
        }
        Tensor::cat(parts, 1)
    }
}

/// `[b, i1 - i0, width]` host mask of the queries `i0..i1` of rows whose first query
/// positions are `first`: `f(p, j)` for query position `p` and column `j`.
pub(super) fn host_mask(
    first: &[usize],
    (i0, i1): (usize, usize),
    width: usize,
    device: &burn::tensor::Device,
    f: impl Fn(usize, usize) -> bool,
) -> Tensor<3, Bool> {
    let mut v = Vec::with_capacity(first.len() * (i1 - i0) * width);
    for &f0 in first {
        for i in i0..i1 {
            v.extend((0..width).map(|j| f(f0 + i, j)));
        }
    }
    Tensor::from_data(TensorData::new(v, [first.len(), i1 - i0, width]), device)
}

/// One layer's selector for one forward.
pub struct BlockSelector {
    layer: usize,
    /// `[b, kvh, lq * g, dh]` rotated queries, grouped by KV head.
    q: Tensor<4>,
    /// `[b, kvh, dh, n_blocks]` per-block bounds: (max, min) or (mean, unused).
    bounds: (Tensor<4>, Option<Tensor<4>>),
    grid: Grid,
    top_k: usize,
    window: usize,
    sinks: usize,
    /// Query heads per KV head.
    g: usize,
    /// Each row's first query position.
    first: Vec<usize>,
}

impl BlockSelector {
    /// The selector of layer `layer` for rotated queries `q: [b, lq, nh, dh]` at
    /// `queries` and rotated keys `k: [b, total, kvh, dh]` of every position.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        queries: &Queries,
        (block, offset, top_k, window, sinks): (usize, usize, usize, usize, usize),
        score: BlockScore,
    ) -> Self {
        let [b, lq, nh, dh] = q.dims();
        let [_, total, kvh, _] = k.dims();
        let g = nh / kvh.max(1);
        let grid = Grid::new(block, offset, total);
        let q = q
            .reshape([b, lq, kvh, g, dh])
            .swap_dims(1, 2)
            .reshape([b, kvh, lq * g, dh]);
        let padded = |fill: f32| {
            grid.pad(k.clone(), fill)
                .reshape([b, grid.n, block, kvh, dh])
        };
        // [b, n, 1, kvh, dh] -> [b, kvh, dh, n]
        let arrange = |t: Tensor<5>| t.reshape([b, grid.n, kvh, dh]).permute([0, 2, 3, 1]);
        let bounds = match score {
            BlockScore::MinMax => (
                arrange(padded(-1.0e30).max_dim(2)),
                Some(arrange(padded(1.0e30).min_dim(2))),
            ),
            BlockScore::Mean => {
                let counts: Vec<f32> = (0..grid.n)
                    .map(|i| {
                        let end = ((i + 1) * block).saturating_sub(grid.shift).min(total);
                        (end - grid.start(i)).max(1) as f32
                    })
                    .collect();
                let counts = Tensor::<1>::from_data(TensorData::new(counts, [grid.n]), &k.device())
                    .reshape([1, 1, 1, grid.n]);
                (arrange(padded(0.0).sum_dim(2)) / counts, None)
            }
        };
        BlockSelector {
            layer,
            q,
            bounds,
            grid,
            top_k,
            window,
            sinks,
            g,
            first: (0..queries.rows()).map(|r| queries.first(r)).collect(),
        }
    }

    /// `[b, bq, n_blocks]` scores of queries `i0..i1`: the maximum over query heads.
    fn scores(&self, i0: usize, i1: usize) -> Tensor<3> {
        let [b, kvh, _, _] = self.q.dims();
        let (bq, g, n) = (i1 - i0, self.g, self.grid.n);
        let q = self.q.clone().slice_dim(2, i0 * g..i1 * g);
        let s = match &self.bounds {
            (max, Some(min)) => {
                q.clone().clamp_min(0.0).matmul(max.clone()) + q.clamp_max(0.0).matmul(min.clone())
            }
            (mean, None) => q.matmul(mean.clone()),
        };
        s.reshape([b, kvh * bq, g, n])
            .max_dim(2)
            .reshape([b, kvh, bq, n])
            .max_dim(1)
            .reshape([b, bq, n])
    }
}

impl EntrySelector for BlockSelector {
    fn k(&self) -> usize {
        self.top_k * self.grid.block + self.sinks
    }

    fn cost_per_entry(&self) -> usize {
        1
    }

    fn select(
        &mut self,
        i0: usize,
        i1: usize,
        n_vis: usize,
        hooks: &mut HookRun,
    ) -> Result<Tensor<3, Bool>> {
        let grid = self.grid;
        let w = self.window;
        // Blocks holding a token before the query's window are candidates.
        let candidate = host_mask(&self.first, (i0, i1), grid.n, &self.q.device(), |p, blk| {
            p >= w && grid.start(blk) <= p - w
        });
        let scores = hooks.apply(
            HookPoint::block(self.layer, Site::IndexerScores),
            self.scores(i0, i1),
        )?;
        let masked = scores.mask_fill(candidate.clone().bool_not(), f32::NEG_INFINITY);
        let kept = topk_mask(masked, self.top_k.min(grid.n)).bool_and(candidate.clone());
        // 1.0 = kept; an intervention may keep any candidate block.
        let point = HookPoint::block(self.layer, Site::IndexerSelected);
        let kept = hooks.apply_mask(point, kept, Some(candidate))?;
        // Token j: in a kept block (or a sink) and before the query's window.
        let blocks: Vec<usize> = (0..n_vis).map(|j| grid.of(j)).collect();
        let per_token = kept
            .float()
            .select(2, int_tensor(&blocks, &self.q.device()))
            .greater_elem(0.5);
        let sinks = self.sinks;
        let outside = host_mask(&self.first, (i0, i1), n_vis, &self.q.device(), |p, j| {
            j + w <= p
        });
        let sink = host_mask(&self.first, (i0, i1), n_vis, &self.q.device(), |p, j| {
            j < sinks && j + w <= p
        });
        Ok(per_token.bool_and(outside).bool_or(sink))
    }
}
