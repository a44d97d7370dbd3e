//! The naive oracle: one cell the slow, obvious way (a full forward per cell with the
//! hooks' own actions), the reference the batched routine is tested against.

use super::*;

pub(super) fn group_mean_act(act: &Act, members: &[usize]) -> Result<Act> {
    Ok(match act.rank() {
        2 => Act::new(group_mean::<2>(act, members)?),
        3 => Act::new(group_mean::<3>(act, members)?),
        4 => Act::new(group_mean::<4>(act, members)?),
        5 => Act::new(group_mean::<5>(act, members)?),
        6 => Act::new(group_mean::<6>(act, members)?),
        r => {
            return Err(Error::Other(format!(
                "rank {r} activations are not supported"
            )));
        }
    })
}

/// The buckets of [`run_cell_naive`]: rows (indices into `rows`) that share their
/// resolved positions and, for means, their group share one intervention.
pub(super) fn naive_buckets(
    prompts: &Prompts,
    rows: &[usize],
    positions: &Positions,
    fill: Fill,
) -> BTreeMap<(Option<Vec<usize>>, usize), Vec<usize>> {
    let mut buckets: BTreeMap<(Option<Vec<usize>>, usize), Vec<usize>> = BTreeMap::new();
    for (i, &p) in rows.iter().enumerate() {
        let g = if fill == Fill::Mean {
            prompts.group[p]
        } else {
            0
        };
        buckets
            .entry((positions.resolve(&prompts.targets[p].positions), g))
            .or_default()
            .push(i);
    }
    buckets
}

/// The hooks' own action for `fill` at `point` over `rows` (`group`: the bucket's
/// group, for means).
pub(super) fn naive_action(
    fill: Fill,
    point: &HookPoint,
    group: usize,
    prompts: &Prompts,
    base: &Base,
    rows: &[usize],
) -> Result<Action> {
    Ok(match fill {
        Fill::Zero => Action::Zero,
        Fill::Source => Action::Resample {
            source: base.cache.clone(),
            perm: rows
                .iter()
                .map(|&p| prompts.partner(p))
                .collect::<Result<_>>()?,
        },
        Fill::Resample => {
            let resample = prompts.resample_partner();
            Action::Resample {
                source: base.cache.clone(),
                perm: rows.iter().map(|&p| resample[p]).collect(),
            }
        }
        Fill::Mean => {
            let members: Vec<usize> = (0..prompts.n())
                .filter(|&p| prompts.group[p] == group)
                .collect();
            Action::Mean(group_mean_act(act_at(&base.cache, point)?, &members)?)
        }
    })
}

/// Evaluate one cell with a full forward of its prompts and the hooks' own actions
/// (the unbatched reference; `base` must hold the activations the fill reads).
pub fn run_cell_naive(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    base: &Base,
    cell: &Cell,
) -> Result<Vec<Outcome>> {
    let device = model.device();
    let rows = &cell.prompts;
    let mut spec = HookSpec::new();
    match &cell.edit {
        Edit::Replace {
            point,
            heads,
            positions,
            fill,
        } => {
            // Rows with the same positions (and group, for means) share one intervention.
            for ((pos, g), members) in naive_buckets(prompts, rows, positions, *fill) {
                let scope = Scope {
                    batch: Some(members),
                    heads: heads.clone(),
                    positions: pos,
                    ..Scope::all()
                };
                let action = naive_action(*fill, point, g, prompts, base, rows)?;
                spec = spec.intervene_point(*point, action, scope);
            }
        }
        edit => spec = intervene_transform(spec, edit, &Scope::all()),
    }
    let out = model.forward(prompts.tokens_of(rows, &device), &spec)?;
    let targets: Vec<&Target> = rows.iter().map(|&p| &prompts.targets[p]).collect();
    readout(out.logits, &targets)
}
