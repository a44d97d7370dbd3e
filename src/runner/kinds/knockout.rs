//! `knockout`: the paper's Figure 3 and the layer-output replacement.
//!
//! - KV-head knockout: remove one KV head of one layer (its whole contribution: the
//!   `hook_z` of every query head that reads it, zeroed by default), relative change
//!   of accuracy per phase: a layer x KV head x phase map.
//! - Layer-output replacement: replace a whole layer's attention output
//!   (`blocks.{l}.hook_attn_out`) over the last `band` query positions (up to the read
//!   position) by its per-phase-group mean (default) or zero; relative change per
//!   layer x phase.

use crate::error::Result;
use crate::hooks::{HookPoint, Site};
use crate::output::LongRow;

use super::super::aggregate::{accuracy_clusters, baseline_rows, per_phase, specialization_rows};
use super::super::config::{HeadKindSel, KnockoutConfig, Selection};
use super::super::exec::Group;
use super::super::patching::{Cell, Edit, Positions};
use super::super::prompts::clean_prompts;
use super::super::setup;
use super::ablate::{acc, change_clusters, rel};
use super::{Ctx, KindOutput, base_obs, fill_of, head_cells};

pub fn run(ctx: &mut Ctx) -> Result<KindOutput> {
    let cfg: KnockoutConfig = ctx.exp.file.knockout.clone().unwrap_or_default();
    let layers = setup::layers(ctx.exp, "knockout", &cfg.layers, &ctx.info, false)?;
    let heads = head_cells(
        ctx,
        "knockout",
        &layers,
        &[HeadKindSel::Kv],
        &Selection::All,
        &cfg.kv_heads,
    )?;
    let set = ctx.eval_set()?;
    if cfg.layer_output && cfg.band > set.prompt_len {
        return Err(ctx.exp.err(
            "knockout",
            "band",
            format!(
                "{} positions, but prompts have {}",
                cfg.band, set.prompt_len
            ),
        ));
    }
    let p = ctx.p();
    let mut groups = Vec::new();
    let mut metas = Vec::new();
    for &r in &ctx.task.phases {
        let ex = ctx.examples(&set, r);
        let (prompts, meta) = clean_prompts(&ex, |_| 0);
        let all: Vec<usize> = (0..prompts.n()).collect();
        let mut cells: Vec<Cell> = heads
            .iter()
            .map(|h| Cell {
                edit: Edit::Replace {
                    point: h.point(),
                    heads: Some(h.query_heads.clone()),
                    positions: cfg.positions.clone(),
                    fill: fill_of(cfg.method),
                },
                prompts: all.clone(),
            })
            .collect();
        if cfg.layer_output {
            for &l in &layers {
                cells.push(Cell {
                    edit: Edit::Replace {
                        point: HookPoint::block(l, Site::AttnOut),
                        heads: None,
                        positions: Positions::Final(cfg.band),
                        fill: fill_of(cfg.layer_output_fill),
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
    let results = ctx.execute(&format!("{} knockout", ctx.mref.name), &groups)?;
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
    for (ci, h) in heads.iter().enumerate() {
        let c = change_clusters(p, &metas, &results, ci);
        let at = Some((h.layer as u32, Some((h.head as u32, h.kind))));
        let (per, pooled) = per_phase(&c, rel, reps, seed);
        rows.extend(rc.phase_rows("rel_change_pct", at, &phases, &per, pooled));
        let (pa, pp) = per_phase(&c, acc, reps, seed);
        rows.extend(rc.phase_rows("accuracy_knockout", at, &phases, &pa, pp));
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
    if cfg.layer_output {
        for (li, &l) in layers.iter().enumerate() {
            let c = change_clusters(p, &metas, &results, heads.len() + li);
            let at = Some((l as u32, None));
            let (per, pooled) = per_phase(&c, rel, reps, seed);
            rows.extend(rc.phase_rows("layer_out_rel_change_pct", at, &phases, &per, pooled));
            let (pa, pp) = per_phase(&c, acc, reps, seed);
            rows.extend(rc.phase_rows("accuracy_layer_out", at, &phases, &pa, pp));
        }
    }
    Ok(KindOutput {
        tables: vec![("heads".into(), rows)],
    })
}
