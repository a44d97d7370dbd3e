//! `patch-heads`: activation patching of `hook_z` per layer x head x source phase.
//!
//! For every phase group r: the clean prompts and their corrupted versions (the
//! target binding's value replaced) run once together; every cell then patches one
//! head's `hook_z` (a query head, or all query heads of a KV head) at the chosen
//! positions from the partner prompt: clean into corrupted (denoising) or corrupted
//! into clean (noising). Metric: the normalised logit difference
//!
//! ```text
//! NLD(r) = (LD_patched - LD_corrupted) / (LD_clean - LD_corrupted),
//! LD = logit(clean answer) - logit(corrupted answer) at the read position,
//! ```
//!
//! each LD summed over the prompts of group r (a ratio of means, not a mean of
//! per-prompt ratios, which explode when one prompt's clean and corrupted LDs are
//! close); 0 = the corrupted behaviour, 1 = the clean behaviour.

use crate::analysis::normalized_logit_diff;
use crate::error::Result;
use crate::output::LongRow;

use super::super::aggregate::{
    Clusters, accuracy_clusters, baseline_rows, per_phase, specialization_rows,
};
use super::super::config::{Direction, PatchConfig};
use super::super::exec::Group;
use super::super::patching::{Cell, Edit, Fill};
use super::super::prompts::paired_prompts;
use super::super::setup;
use super::{Ctx, KindOutput, base_obs, head_cells};

pub fn run(ctx: &mut Ctx) -> Result<KindOutput> {
    let cfg: PatchConfig = ctx.exp.file.patch.clone().unwrap_or_default();
    let layers = setup::layers(ctx.exp, "patch", &cfg.layers, &ctx.info, false)?;
    let heads = head_cells(
        ctx,
        "patch",
        &layers,
        &cfg.head_kinds,
        &cfg.heads,
        &cfg.kv_heads,
    )?;
    let set = ctx.eval_set()?;
    let p = ctx.p();
    let assign = if ctx.task.prompt.assign {
        ctx.task.space.assign().len()
    } else {
        0
    };
    let mut groups = Vec::new();
    let mut metas = Vec::new();
    for &r in &ctx.task.phases {
        let ex = ctx.examples(&set, r);
        let n = ex.len();
        let (prompts, meta) = paired_prompts(
            &ex,
            &ctx.task.space,
            assign,
            ctx.task.prompt.key_len,
            ctx.task.seed,
        )?;
        let mut cells = Vec::new();
        for d in &cfg.directions {
            let receivers: Vec<usize> = match d {
                Direction::Denoise => (n..2 * n).collect(),
                Direction::Noise => (0..n).collect(),
            };
            for h in &heads {
                cells.push(Cell {
                    edit: Edit::Replace {
                        point: h.point(),
                        heads: Some(h.query_heads.clone()),
                        positions: cfg.positions.clone(),
                        fill: Fill::Source,
                    },
                    prompts: receivers.clone(),
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
    let results = ctx.execute(&format!("{} patch-heads", ctx.mref.name), &groups)?;

    // Baselines: clean and corrupted accuracy, LDs (clean orientation).
    let mut acc = Vec::new();
    let mut acc_corrupt = Vec::new();
    let mut ld_clean = Clusters::<1>::new(p);
    let mut ld_corrupt = Clusters::<1>::new(p);
    for (meta, res) in metas.iter().zip(&results) {
        acc.extend(base_obs(meta, res));
        let n = meta.len() / 2;
        for (i, m) in meta.iter().take(n).enumerate() {
            acc_corrupt.push((m.logical, m.phase, res.base[n + i].correct));
            ld_clean.add(m.logical, m.phase, [res.base[i].ld as f64]);
            ld_corrupt.add(m.logical, m.phase, [-res.base[n + i].ld as f64]);
        }
    }
    let phases = ctx.task.phases.clone();
    let (reps, seed) = (ctx.reps(), ctx.seed());
    let rc = ctx.rows.clone();
    let mut rows: Vec<LongRow> =
        baseline_rows(&rc, "", &accuracy_clusters(p, acc), &phases, reps, seed);
    rows.extend(baseline_rows(
        &rc,
        "_corrupted",
        &accuracy_clusters(p, acc_corrupt),
        &phases,
        reps,
        seed,
    ));
    for (metric, c) in [
        ("logit_diff_clean", &ld_clean),
        ("logit_diff_corrupted", &ld_corrupt),
    ] {
        let (per, pooled) = per_phase(c, |s, n| s[0] / n as f64, reps, seed);
        rows.extend(rc.phase_rows(metric, None, &phases, &per, pooled));
    }

    // Cells: per direction and head, clusters of (LD_patched, LD_clean, LD_corrupted).
    let nld = |s: &[f64; 3], n: u64| {
        let k = n as f64;
        normalized_logit_diff(s[0] / k, s[1] / k, s[2] / k).unwrap_or(f64::NAN)
    };
    for (di, d) in cfg.directions.iter().enumerate() {
        for (hi, h) in heads.iter().enumerate() {
            let ci = di * heads.len() + hi;
            let mut c = Clusters::<3>::new(p);
            for (meta, res) in metas.iter().zip(&results) {
                let n = meta.len() / 2;
                for (j, o) in res.cells[ci].iter().enumerate() {
                    // Denoising rows are corrupted prompts: flip their LD to the clean orientation.
                    let (i, sign) = match d {
                        Direction::Denoise => (j, -1.0),
                        Direction::Noise => (j, 1.0),
                    };
                    let m = &meta[i];
                    c.add(
                        m.logical,
                        m.phase,
                        [
                            sign * o.ld as f64,
                            res.base[i].ld as f64,
                            -res.base[n + i].ld as f64,
                        ],
                    );
                }
            }
            let (per, pooled) = per_phase(&c, nld, reps, seed);
            let at = Some((h.layer as u32, Some((h.head as u32, h.kind))));
            rows.extend(rc.phase_rows(d.metric(), at, &phases, &per, pooled));
            if di == 0 {
                // Specialization from the first direction's effect: NLD for denoising,
                // 1 - NLD (the damage) for noising.
                let effect: Vec<f64> = phases
                    .iter()
                    .map(|&r| match d {
                        Direction::Denoise => per[r as usize].value,
                        Direction::Noise => 1.0 - per[r as usize].value,
                    })
                    .collect();
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
