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

/// The hooks' own actions of a one-forward edit over `rows`, added to `spec` (a
/// replacement: one intervention per bucket of rows that share their positions and,
/// for means, their group).
fn naive_spec(
    mut spec: HookSpec,
    prompts: &Prompts,
    base: &Base,
    rows: &[usize],
    edit: &Edit,
) -> Result<HookSpec> {
    match edit {
        Edit::Replace {
            point,
            heads,
            positions,
            fill,
        } => {
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
            Ok(spec)
        }
        Edit::FromStage { .. } => Err(Error::Other(
            "a stage edit takes two forwards (run_cell_naive)".into(),
        )),
        edit => Ok(intervene_transform(spec, edit, &Scope::all())),
    }
}

/// Evaluate one cell with full forwards of its prompts and the hooks' own actions
/// (the unbatched reference; `base` must hold the activations the fill reads). A
/// [`Edit::FromStage`] takes two: the stage's (its freezes as `Resample` from each
/// prompt's own base row, then its replacement), capturing the point, and the cell's,
/// patching that capture in within the cell's heads.
pub fn run_cell_naive(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    base: &Base,
    cell: &Cell,
) -> Result<Vec<Outcome>> {
    let device = model.device();
    let rows = &cell.prompts;
    let spec = match &cell.edit {
        Edit::FromStage {
            stage,
            point,
            heads,
        } => {
            let mut first = HookSpec::new();
            for f in &stage.freeze {
                let own = Action::Resample {
                    source: base.cache.clone(),
                    perm: rows.clone(),
                };
                first = first.intervene_point(*f, own, Scope::all());
            }
            let first =
                naive_spec(first, prompts, base, rows, &stage.edit())?.capture_point(*point);
            let sent = model
                .forward(prompts.tokens_of(rows, &device), &first)?
                .cache;
            let scope = Scope {
                heads: heads.clone(),
                ..Scope::all()
            };
            HookSpec::new().intervene_point(*point, Action::Patch(Arc::new(sent)), scope)
        }
        edit => naive_spec(HookSpec::new(), prompts, base, rows, edit)?,
    };
    let out = model.forward(prompts.tokens_of(rows, &device), &spec)?;
    let targets: Vec<&Target> = rows.iter().map(|&p| &prompts.targets[p]).collect();
    readout(out.logits, &targets)
}
