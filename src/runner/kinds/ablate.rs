//! `ablate-heads`: ablate one head at a time (zero, per-phase mean, resample) and
//! measure the relative change of top-1 accuracy per phase,
//! `100 * (acc_ablated - acc_clean) / acc_clean`.

use crate::analysis::relative_change_pct;
use crate::error::Result;
use crate::output::LongRow;

use super::super::aggregate::{
    Clusters, accuracy_clusters, baseline_rows, per_phase, specialization_rows,
};
use super::super::config::AblateConfig;
use super::super::exec::Group;
use super::super::patching::{Cell, Edit};
use super::super::prompts::clean_prompts;
use super::super::setup;
use super::{Ctx, KindOutput, base_obs, fill_of, head_cells};

/// Clusters of `(correct_ablated, correct_clean)` for cell `ci` over all groups.
pub(super) fn change_clusters(
    p: usize,
    metas: &[Vec<super::super::prompts::PromptMeta>],
    results: &[super::super::exec::GroupResult],
    ci: usize,
) -> Clusters<2> {
    let mut c = Clusters::<2>::new(p);
    for (meta, res) in metas.iter().zip(results) {
        for (i, o) in res.cells[ci].iter().enumerate() {
            let m = &meta[i];
            c.add(
                m.logical,
                m.phase,
                [
                    f64::from(u8::from(o.correct)),
                    f64::from(u8::from(res.base[i].correct)),
                ],
            );
        }
    }
    c
}

/// Relative change (%) of the summed outcomes.
pub(super) fn rel(s: &[f64; 2], _n: u64) -> f64 {
    relative_change_pct(s[0], s[1]).unwrap_or(f64::NAN)
}

/// Accuracy of the ablated run.
pub(super) fn acc(s: &[f64; 2], n: u64) -> f64 {
    s[0] / n as f64
}

pub fn run(ctx: &mut Ctx) -> Result<KindOutput> {
    let cfg: AblateConfig = ctx.exp.file.ablate.clone().unwrap_or_default();
    let layers = setup::layers(ctx.exp, "ablate", &cfg.layers, &ctx.info, false)?;
    let heads = head_cells(
        ctx,
        "ablate",
        &layers,
        &cfg.head_kinds,
        &cfg.heads,
        &cfg.kv_heads,
    )?;
    let set = ctx.eval_set()?;
    let p = ctx.p();
    let mut groups = Vec::new();
    let mut metas = Vec::new();
    for &r in &ctx.task.phases {
        let ex = ctx.examples(&set, r);
        let (prompts, meta) = clean_prompts(&ex, |_| 0);
        let all: Vec<usize> = (0..prompts.n()).collect();
        let mut cells = Vec::new();
        for &m in &cfg.methods {
            for h in &heads {
                cells.push(Cell {
                    edit: Edit::Replace {
                        point: h.point(),
                        heads: Some(h.query_heads.clone()),
                        positions: cfg.positions.clone(),
                        fill: fill_of(m),
                    },
                    prompts: all.clone(),
                });
            }
        }
        groups.push(Group {
            key: format!("p{r}"),
            prompts,
            cells,
        });
        metas.push(meta);
    }
    let results = ctx.execute(&format!("{} ablate-heads", ctx.mref.name), &groups)?;
    let phases = ctx.task.phases.clone();
    let (reps, seed) = (ctx.reps(), ctx.seed());
    let rc = ctx.rows.clone();
    let base: Vec<_> = metas
        .iter()
        .zip(&results)
        .flat_map(|(m, r)| base_obs(m, r).collect::<Vec<_>>())
        .collect();
    let mut rows: Vec<LongRow> =
        baseline_rows(&rc, "", &accuracy_clusters(p, base), &phases, reps, seed);
    for (mi, m) in cfg.methods.iter().enumerate() {
        for (hi, h) in heads.iter().enumerate() {
            let c = change_clusters(p, &metas, &results, mi * heads.len() + hi);
            let at = Some((h.layer as u32, Some((h.head as u32, h.kind))));
            let (per, pooled) = per_phase(&c, rel, reps, seed);
            rows.extend(rc.phase_rows(
                &format!("rel_change_pct_{}", m.name()),
                at,
                &phases,
                &per,
                pooled,
            ));
            let (pa, pp) = per_phase(&c, acc, reps, seed);
            rows.extend(rc.phase_rows(&format!("accuracy_{}", m.name()), at, &phases, &pa, pp));
            if mi == 0 {
                // Specialization of the first method's damage (minus the relative change).
                let effect: Vec<f64> = phases.iter().map(|&r| -per[r as usize].value).collect();
                rows.extend(specialization_rows(
                    &rc,
                    h.layer as u32,
                    h.head as u32,
                    h.kind,
                    &phases,
                    &effect,
                ));
            }
        }
    }
    Ok(KindOutput {
        tables: vec![("heads".into(), rows)],
    })
}
