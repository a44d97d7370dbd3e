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

use serde::{Deserialize, Serialize};

use crate::analysis::normalized_logit_diff;
use crate::analysis::{Clusters, accuracy_clusters, per_phase};
use crate::error::Result;
use crate::output::{HeadKind, Headline, LongRow};

use super::super::exec::Group;
use super::super::experiment::{Experiment, Selection};
use super::super::patching::{Cell, Edit, Fill, Positions};
use super::super::prompts::paired_prompts;
use super::super::report::{
    Figures, cell_map, head_axes, head_phase_map, layer_head_heatmap, layer_kv_phase_map, push,
    ranked_table, ranking, spec_index_heatmap, sym_range,
};
use super::super::rows::{baseline_rows, specialization_rows};
use super::super::setup;
use super::{Ctx, Kind, KindOutput, base_obs, empty_list, head_cells};

fn both_kinds() -> Vec<HeadKind> {
    vec![HeadKind::Query, HeadKind::Kv]
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
}

/// `[patch]` (patch-heads).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PatchHeads {
    /// Layers to sweep. Default all.
    pub layers: Selection,
    /// Query heads (for `query` cells). Default all.
    pub heads: Selection,
    /// KV heads (for `kv` cells). Default all.
    pub kv_heads: Selection,
    /// Which cells. Default both.
    pub head_kinds: Vec<HeadKind>,
    /// Default both.
    pub directions: Vec<Direction>,
    /// Query positions patched. Default all.
    pub positions: Positions,
}

impl Default for PatchHeads {
    fn default() -> Self {
        PatchHeads {
            layers: Selection::All,
            heads: Selection::All,
            kv_heads: Selection::All,
            head_kinds: both_kinds(),
            directions: vec![Direction::Denoise, Direction::Noise],
            positions: Positions::All,
        }
    }
}

impl Kind for PatchHeads {
    fn name(&self) -> &'static str {
        "patch-heads"
    }

    fn section(&self) -> &'static str {
        "patch"
    }

    fn default_n_logical(&self) -> usize {
        64
    }

    fn check(&self, exp: &Experiment) -> Result<()> {
        empty_list(exp, "patch", "head_kinds", self.head_kinds.is_empty())?;
        empty_list(exp, "patch", "directions", self.directions.is_empty())
    }

    fn accuracy_series(&self) -> Vec<(&'static str, String)> {
        vec![
            ("clean", "accuracy".to_string()),
            (
                "corrupted (answer = the replaced value)",
                "accuracy_corrupted".to_string(),
            ),
        ]
    }

    fn run(&self, ctx: &mut Ctx) -> Result<KindOutput> {
        run(self, ctx)
    }

    fn figures(&self, f: &mut Figures) -> Result<()> {
        draw(self, f)
    }
}

fn run(cfg: &PatchHeads, ctx: &mut Ctx) -> Result<KindOutput> {
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

/// This kind's figures and report section, from its tables alone.
fn draw(cfg: &PatchHeads, f: &mut Figures) -> Result<()> {
    let (d, m, phases, dir) = (f.data, f.model.as_str(), &f.phases[..], f.dir);
    let (report, files) = (&mut f.report, &mut f.files);
    let directions = cfg.directions.clone();
    report.section("Activation patching of hook_z");
    report.paragraph(
        "Normalised logit difference NLD = (LD_patched - LD_corrupted) / (LD_clean - LD_corrupted), \
         LD = logit(clean answer) - logit(corrupted answer) at the read position, summed over the \
         prompts of each source phase. Denoising patches the clean activation into the corrupted run \
         (1 = the head alone restores the clean answer); noising patches the corrupted activation \
         into the clean run (0 = the head alone destroys it). KV-head cells patch every query head \
         that reads the KV head.",
    );
    for (di, d_) in directions.iter().enumerate() {
        let metric = d_.metric();
        if !d.has(m, metric) {
            continue;
        }
        let cells = cell_map(d, m, metric, HeadKind::Query);
        let (layers, heads) = head_axes(d, m, metric, HeadKind::Query);
        if let Some((best, v)) = cells
            .iter()
            .filter(|((_, _, p), v)| p.is_none() && v.is_finite())
            .max_by(|a, b| a.1.total_cmp(b.1))
        {
            report.headline(
                Headline::new(
                    format!("Strongest query head ({metric}, all phases)"),
                    format!("L{}.H{}", best.0, best.1),
                )
                .with_detail(format!("NLD {v:.3}")),
            );
        }
        if !layers.is_empty() {
            let range = sym_range(cells.values().copied());
            for &p in phases {
                let f = layer_head_heatmap(
                    &dir.join(format!("{metric}_phase{p}")),
                    &cells,
                    &layers,
                    &heads,
                    Some(p),
                    format!("{m}: {metric}, source phase {p}"),
                    "normalised logit difference",
                    range,
                    "H",
                    true,
                )?;
                if di == 0 {
                    push(
                        files,
                        report,
                        &format!("{metric} per layer x query head, source phase {p}"),
                        f,
                    );
                } else {
                    // Written, not embedded: the report stays readable.
                    files.push(f.png);
                    files.push(f.svg);
                }
            }
            let f = layer_head_heatmap(
                &dir.join(format!("{metric}_all_phases")),
                &cells,
                &layers,
                &heads,
                None,
                format!("{m}: {metric}, all phases pooled"),
                "normalised logit difference",
                range,
                "H",
                true,
            )?;
            push(
                files,
                report,
                &format!("{metric} per layer x query head, all phases"),
                f,
            );
        }
        if let Some(f) = layer_kv_phase_map(
            &dir.join(format!("{metric}_kv")),
            d,
            m,
            metric,
            phases,
            format!("{m}: {metric} per layer x KV head x source phase"),
            "normalised logit difference",
        )? {
            push(
                files,
                report,
                &format!("{metric} per layer x KV head x source phase"),
                f,
            );
        }
    }
    if let Some(second) = directions.get(1) {
        report.paragraph(format!(
            "Per-phase heatmaps of {} are in this folder as {}_phase<r>.png / .svg.",
            second.metric(),
            second.metric()
        ));
    }
    if let Some(first) = directions.first()
        && d.has(m, first.metric())
    {
        report.section("Phase specialization");
        report.paragraph(format!(
            "Specialization index of a head: S = 1 - (exp(H) - 1) / (P - 1) of its normalised positive \
             effect profile over phases (effect = {}); S = 1: all of the effect on one phase, S = 0: spread evenly.",
            match first {
                Direction::Denoise => "the denoising NLD",
                Direction::Noise => "1 - the noising NLD",
            }
        ));
        if let Some(f) = head_phase_map(
            &dir.join("specialization_map"),
            d,
            m,
            first.metric(),
            phases,
            format!("{m}: {} per head x source phase", first.metric()),
            "normalised logit difference",
        )? {
            push(files, report, "Head x phase specialization map", f);
        }
        if let Some(f) = spec_index_heatmap(
            &dir.join("specialization_index"),
            d,
            m,
            format!("{m}: specialization index per head"),
        )? {
            push(files, report, "Specialization index per layer x head", f);
        }
        let ranked = match first {
            Direction::Denoise => ranking(d, m, first.metric(), phases, |v| v),
            Direction::Noise => ranking(d, m, first.metric(), phases, |v| 1.0 - v),
        };
        ranked_table(report, "Most phase-specialized heads", &ranked);
    }
    Ok(())
}
