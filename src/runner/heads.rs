//! Head cells, patching directions and the NLD clusters of a patching cell: what the
//! patching kinds (patch-heads, attribution patching, path patching) share below them.

use serde::{Deserialize, Serialize};

use crate::analysis::Clusters;
use crate::hooks::{HookPoint, Site};
use crate::output::HeadKind;

use super::exec::GroupResult;
use super::patching::{Cell, Edit, Fill, Positions};
use crate::tasks::prompts::PromptMeta;

/// A head cell: `(layer, head, kind)` and the query heads its edit covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadCell {
    pub layer: usize,
    pub head: usize,
    pub kind: HeadKind,
    /// Query heads of hook_z the edit touches: the head itself, or for a KV head every
    /// query head that reads it (`h / (n_heads / n_kv_heads) == kv`).
    pub query_heads: Vec<usize>,
}

impl HeadCell {
    /// The `blocks.{layer}.attn.hook_z` point.
    pub fn point(&self) -> HookPoint {
        HookPoint::block(self.layer, Site::AttnZ)
    }
}

/// Direction of activation patching.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Clean activation into the corrupted run (does the component suffice?).
    Denoise,
    /// Corrupted activation into the clean run (is the component necessary?).
    Noise,
}

impl Direction {
    /// The metric name of the direction's normalised logit difference.
    pub fn metric(self) -> &'static str {
        match self {
            Direction::Denoise => "nld_denoise",
            Direction::Noise => "nld_noise",
        }
    }

    /// The receiving rows of a group of `n` clean then `n` corrupted prompts: the
    /// corrupted half when denoising, the clean half when noising.
    pub fn receivers(self, n: usize) -> Vec<usize> {
        match self {
            Direction::Denoise => (n..2 * n).collect(),
            Direction::Noise => (0..n).collect(),
        }
    }
}

/// Per direction, one patch of each head's output at `positions` from the partner
/// prompt into the receiving half of a group of `n` pairs (also the exact cells that
/// attribution patching validates against).
pub fn head_patch_cells(
    directions: &[Direction],
    heads: &[HeadCell],
    positions: &Positions,
    n: usize,
) -> Vec<Cell> {
    let mut cells = Vec::new();
    for d in directions {
        let receivers = d.receivers(n);
        for h in heads {
            cells.push(Cell {
                edit: Edit::Replace {
                    point: h.point(),
                    heads: Some(h.query_heads.clone()),
                    positions: positions.clone(),
                    fill: Fill::Source,
                },
                prompts: receivers.clone(),
            });
        }
    }
    cells
}

/// Clusters of `(LD_patched, LD_clean, LD_corrupted)` of cell `ci` over every group of
/// `n` clean then `n` corrupted prompts, in the clean orientation (a denoising cell's
/// rows are the corrupted prompts: their LD is flipped), for the NLD of direction `d`
/// ([`crate::analysis::effects::nld_of_sums`]).
pub fn nld_clusters(
    metas: &[Vec<PromptMeta>],
    results: &[GroupResult],
    ci: usize,
    d: Direction,
    p: usize,
) -> Clusters<3> {
    let sign = match d {
        Direction::Denoise => -1.0,
        Direction::Noise => 1.0,
    };
    let mut c = Clusters::<3>::new(p);
    for (meta, res) in metas.iter().zip(results) {
        let n = meta.len() / 2;
        for (i, o) in res.cells[ci].iter().enumerate() {
            c.add(
                meta[i].logical,
                meta[i].phase,
                [
                    sign * o.ld as f64,
                    res.base[i].ld as f64,
                    -res.base[n + i].ld as f64,
                ],
            );
        }
    }
    c
}
