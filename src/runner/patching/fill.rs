//! Fill values of a merged replacement: the partner prompt's activation, zero, the
//! group mean, another prompt of the group, at each row's heads and positions.

use super::*;

/// What a row of a merged replacement takes: a [`Fill`], its own base value (a
/// stage's freezes), or its value under a stage ([`Edit::FromStage`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum RowFill<'a> {
    Own,
    Fill(Fill),
    Stage(&'a Stage),
}

/// The replacements of a point are installed one per key, in this order: the rows'
/// own values first (freezes), fills on top; every stage fill in one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum FillKey {
    Own,
    Fill(Fill),
    Stage,
}

impl RowFill<'_> {
    pub(super) fn key(&self) -> FillKey {
        match self {
            RowFill::Own => FillKey::Own,
            RowFill::Fill(f) => FillKey::Fill(*f),
            RowFill::Stage(_) => FillKey::Stage,
        }
    }
}

/// Per row of a merged replacement: which prompt, which fill, which heads and positions.
pub(super) struct RowEdit<'a> {
    pub(super) row: usize,
    pub(super) prompt: usize,
    pub(super) fill: RowFill<'a>,
    pub(super) heads: Option<&'a [usize]>,
    pub(super) positions: Option<Vec<usize>>,
}

pub(super) fn act_at<'c>(cache: &'c ActivationCache, point: &HookPoint) -> Result<&'c Act> {
    cache.get(point).ok_or_else(|| {
        Error::hook(
            point.to_string(),
            "not captured by the base run (a bug in the runner's capture list)",
        )
    })
}

/// Token-position scopes apply to sites whose position axis counts tokens (the
/// `sites!` table's fact), not to compressed entries.
pub(super) fn positions_allowed(point: &HookPoint) -> bool {
    point.site.info().pos_counts == PosCounts::Tokens
}

/// Mean over `members` (batch rows) of `act`, keeping a batch axis of 1.
pub(super) fn group_mean<const D: usize>(act: &Act, members: &[usize]) -> Result<Tensor<D>> {
    Ok(act.select_batch(members)?.get::<D>()?.mean_dim(0))
}

/// The value a fill puts into `edits` (all of one fill), over every row of the chunk:
/// `[rows, ...]` (rows without an edit take their own activation; the per-row scope
/// decides what is replaced).
pub(super) fn fill_value<const D: usize>(
    fill: Fill,
    base: &Act,
    prompts: &Prompts,
    row_prompt: &[usize],
    edits: &[&RowEdit],
) -> Result<Tensor<D>> {
    let pick = |partner: &dyn Fn(usize) -> Result<usize>| -> Result<Tensor<D>> {
        let mut idx = row_prompt.to_vec();
        for e in edits {
            idx[e.row] = partner(e.prompt)?;
        }
        base.select_batch(&idx)?.get::<D>()
    };
    Ok(match fill {
        Fill::Zero => {
            let mut dims = [0usize; D];
            dims.copy_from_slice(base.shape());
            dims[0] = row_prompt.len();
            Tensor::zeros(dims, &base.get::<D>()?.device())
        }
        Fill::Source => pick(&|p| prompts.partner(p))?,
        Fill::Resample => {
            let partner = prompts.resample_partner();
            pick(&|p| Ok(partner[p]))?
        }
        Fill::Mean => {
            let mut groups: Vec<usize> = edits.iter().map(|e| prompts.group[e.prompt]).collect();
            groups.sort_unstable();
            groups.dedup();
            let mut means = Vec::with_capacity(groups.len());
            for g in &groups {
                let members: Vec<usize> = (0..prompts.n())
                    .filter(|&p| prompts.group[p] == *g)
                    .collect();
                means.push(group_mean::<D>(base, &members)?);
            }
            let means = Tensor::cat(means, 0);
            let sel: Vec<i64> = row_prompt
                .iter()
                .map(|&p| {
                    groups
                        .iter()
                        .position(|g| *g == prompts.group[p])
                        .unwrap_or(0) as i64
                })
                .collect();
            let n = sel.len();
            let device = means.device();
            means.select(
                0,
                Tensor::<1, Int>::from_data(TensorData::new(sel, [n]), &device),
            )
        }
    })
}

pub(super) fn fill_value_act(
    point: &HookPoint,
    fill: Fill,
    base: &Act,
    prompts: &Prompts,
    row_prompt: &[usize],
    edits: &[&RowEdit],
) -> Result<Act> {
    Ok(match base.rank() {
        2 => Act::new(fill_value::<2>(fill, base, prompts, row_prompt, edits)?),
        3 => Act::new(fill_value::<3>(fill, base, prompts, row_prompt, edits)?),
        4 => Act::new(fill_value::<4>(fill, base, prompts, row_prompt, edits)?),
        5 => Act::new(fill_value::<5>(fill, base, prompts, row_prompt, edits)?),
        6 => Act::new(fill_value::<6>(fill, base, prompts, row_prompt, edits)?),
        r => {
            return Err(Error::hook(
                point.to_string(),
                format!("activations of rank {r} are not supported by the patching routine"),
            ));
        }
    })
}

/// Position scopes of the patching routine count tokens: an edit at given positions
/// needs a point whose position axis counts tokens (the `sites!` table's fact), and
/// the positions must lie in the prompt (`len` tokens; the base run's captures may
/// hold a window of them only, `Base::window`).
pub(super) fn check_edit_positions(point: &HookPoint, len: usize, edits: &[RowEdit]) -> Result<()> {
    let info = point.site.info();
    for e in edits {
        let Some(pos) = &e.positions else { continue };
        if info.pos_axis.filter(|_| positions_allowed(point)).is_none() {
            return Err(Error::hook(
                point.to_string(),
                "positions other than \"all\" need a point indexed by token position",
            ));
        }
        if let Some(p) = pos.iter().find(|&&p| p >= len) {
            return Err(Error::hook(
                point.to_string(),
                format!("position {p} out of range 0..{len}"),
            ));
        }
    }
    Ok(())
}

/// The per-row scope of `edits`: each edited row with its heads and positions;
/// positions relative to each row's first recomputed one when the chunk runs as a
/// suffix (positions outside the suffix cannot reach the logits read and are dropped).
pub(super) fn edits_scope(edits: &[&RowEdit], suffix: Option<&Suffix>) -> Scope {
    Scope::rows(
        edits
            .iter()
            .map(|e| RowScope {
                row: e.row,
                heads: e.heads.map(<[usize]>::to_vec),
                positions: match (&e.positions, suffix) {
                    (Some(p), Some(s)) => {
                        let from = s.from[e.row];
                        Some(
                            p.iter()
                                .filter(|&&q| q >= from && q < from + s.len)
                                .map(|&q| q - from)
                                .collect(),
                        )
                    }
                    (p, _) => p.clone(),
                },
            })
            .collect(),
    )
}
