//! `knockout`: the paper's Figure 3 and the layer-output replacement.
//!
//! - KV-head knockout: remove one KV head of one layer (its whole contribution: the
//!   `hook_z` of every query head that reads it, zeroed by default), relative change
//!   of accuracy per phase: a layer x KV head x phase map.
//! - Layer-output replacement: replace a whole layer's attention output
//!   (`blocks.{l}.hook_attn_out`) over the last `band` query positions (up to the read
//!   position) by its per-phase-group mean (default) or zero; relative change per
//!   layer x phase.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::analysis::effects::{rate_of_sums, rel_change_of_sums};
use crate::analysis::{accuracy_clusters, per_phase};
use crate::error::Result;
use crate::hooks::{HookPoint, Site};
use crate::output::{HeadKind, Headline, HeatmapSpec, LongRow, Report, heatmap};

use super::super::exec::Group;
use super::super::experiment::{Experiment, Selection};
use super::super::patching::{Cell, Edit, Fill, Positions};
use super::super::report::{
    ExperimentData, Figures, cell_map, layer_kv_phase_map, push, ranked_table, ranking,
    spec_index_heatmap,
};
use super::super::rows::{baseline_rows, change_clusters, specialization_rows};
use super::super::setup;
use super::{Ctx, HeadCell, Kind, KindOutput, base_obs, head_cells, no_source};
use crate::tasks::prompts::clean_prompts;

/// `[knockout]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Knockout {
    pub layers: Selection,
    pub kv_heads: Selection,
    /// How a KV head is removed. Default zero.
    pub method: Fill,
    /// Positions of the KV-head knockout. Default all.
    pub positions: Positions,
    /// Also replace each whole layer's attention output over the final band.
    pub layer_output: bool,
    /// Final query positions of the layer-output replacement. Default 8.
    pub band: usize,
    /// What replaces the layer output: mean (per phase group, default) or zero.
    pub layer_output_fill: Fill,
}

impl Default for Knockout {
    fn default() -> Self {
        Knockout {
            layers: Selection::All,
            kv_heads: Selection::All,
            method: Fill::Zero,
            positions: Positions::All,
            layer_output: true,
            band: 8,
            layer_output_fill: Fill::Mean,
        }
    }
}

impl Kind for Knockout {
    fn name(&self) -> &'static str {
        "knockout"
    }

    fn section(&self) -> &'static str {
        "knockout"
    }

    fn default_n_logical(&self) -> usize {
        64
    }

    fn check(&self, exp: &Experiment) -> Result<()> {
        no_source(exp, "knockout", "method", &[self.method])?;
        no_source(
            exp,
            "knockout",
            "layer_output_fill",
            &[self.layer_output_fill],
        )?;
        if self.layer_output && self.band == 0 {
            return Err(exp.err("knockout", "band", "must be at least 1"));
        }
        Ok(())
    }

    fn run(&self, ctx: &mut Ctx) -> Result<KindOutput> {
        run(self, ctx)
    }

    fn figures(&self, f: &mut Figures) -> Result<()> {
        draw(self, f)
    }
}

/// The layer-output band must fit in the prompts.
fn check_band(cfg: &Knockout, ctx: &Ctx, prompt_len: usize) -> Result<()> {
    if cfg.layer_output && cfg.band > prompt_len {
        return Err(ctx.exp.err(
            "knockout",
            "band",
            format!("{} positions, but prompts have {}", cfg.band, prompt_len),
        ));
    }
    Ok(())
}

/// The cells of one group of `n` prompts: one knockout per KV head, then (with
/// `layer_output`) one attention-output replacement per layer, each over every prompt.
fn knockout_cells(cfg: &Knockout, heads: &[HeadCell], layers: &[usize], n: usize) -> Vec<Cell> {
    let all: Vec<usize> = (0..n).collect();
    let mut cells: Vec<Cell> = heads
        .iter()
        .map(|h| Cell {
            edit: Edit::Replace {
                point: h.point(),
                heads: Some(h.query_heads.clone()),
                positions: cfg.positions.clone(),
                fill: cfg.method,
            },
            prompts: all.clone(),
        })
        .collect();
    if cfg.layer_output {
        for &l in layers {
            cells.push(Cell {
                edit: Edit::Replace {
                    point: HookPoint::block(l, Site::AttnOut),
                    heads: None,
                    positions: Positions::Final(cfg.band),
                    fill: cfg.layer_output_fill,
                },
                prompts: all.clone(),
            });
        }
    }
    cells
}

fn run(cfg: &Knockout, ctx: &mut Ctx) -> Result<KindOutput> {
    let layers = setup::layers(ctx.exp, "knockout", &cfg.layers, &ctx.info, false)?;
    let heads = head_cells(
        ctx,
        "knockout",
        &layers,
        &[HeadKind::Kv],
        &Selection::All,
        &cfg.kv_heads,
    )?;
    let set = ctx.eval_set()?;
    check_band(cfg, ctx, set.prompt_len)?;
    let p = ctx.p();
    let mut groups = Vec::new();
    let mut metas = Vec::new();
    for &r in &ctx.task.phases {
        let ex = ctx.examples(&set, r);
        let (prompts, meta) = clean_prompts(&ex, |_| 0);
        let cells = knockout_cells(cfg, &heads, &layers, prompts.n());
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
        let (per, pooled) = per_phase(&c, rel_change_of_sums, reps, seed);
        rows.extend(rc.phase_rows("rel_change_pct", at, &phases, &per, pooled));
        let (pa, pp) = per_phase(&c, rate_of_sums, reps, seed);
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
            let (per, pooled) = per_phase(&c, rel_change_of_sums, reps, seed);
            rows.extend(rc.phase_rows("layer_out_rel_change_pct", at, &phases, &per, pooled));
            let (pa, pp) = per_phase(&c, rate_of_sums, reps, seed);
            rows.extend(rc.phase_rows("accuracy_layer_out", at, &phases, &pa, pp));
        }
    }
    Ok(KindOutput {
        tables: vec![("heads".into(), rows)],
    })
}

/// This kind's figures and report section, from its tables alone.
fn draw(_cfg: &Knockout, f: &mut Figures) -> Result<()> {
    let (d, m, phases, dir) = (f.data, f.model.as_str(), &f.phases[..], f.dir);
    let (report, files) = (&mut f.report, &mut f.files);
    report.section("KV-head knockout");
    report.paragraph(
        "Relative change of top-1 accuracy, 100 x (knockout - clean) / clean, when one KV head of one \
         layer is removed (every query head reading it), per source phase.",
    );
    if let Some(h) = most_damaging(d, m) {
        report.headline(h);
    }
    if let Some(f) = layer_kv_phase_map(
        &dir.join("knockout_kv"),
        d,
        m,
        "rel_change_pct",
        phases,
        format!("{m}: KV-head knockout, relative change per layer x KV head x phase"),
        "relative change of accuracy (%)",
    )? {
        push(
            files,
            report,
            "KV-head knockout (the paper's Figure 3 layout)",
            f,
        );
    }
    layer_output_figure(d, m, phases, dir, report, files)?;
    report.section("Phase specialization");
    if let Some(f) = spec_index_heatmap(
        &dir.join("specialization_index"),
        d,
        m,
        format!("{m}: specialization index per KV head"),
    )? {
        push(
            files,
            report,
            "Specialization index of the knockout damage per layer x KV head",
            f,
        );
    }
    ranked_table(
        report,
        "Most phase-specialized KV heads",
        &ranking(d, m, "rel_change_pct", phases, |v| -v),
    );
    Ok(())
}

/// The headline of the most damaging KV-head knockout over all phases, if any.
fn most_damaging(d: &ExperimentData, m: &str) -> Option<Headline> {
    let cells = cell_map(d, m, "rel_change_pct", HeadKind::Kv);
    let (k, v) = cells
        .iter()
        .filter(|((_, _, p), v)| p.is_none() && v.is_finite())
        .min_by(|a, b| a.1.total_cmp(b.1))?;
    Some(
        Headline::new(
            "Most damaging KV-head knockout (all phases)",
            format!("L{}.KV{}", k.0, k.1),
        )
        .with_detail(format!("{v:.1}% relative change")),
    )
}

/// The layer x phase heatmap of the layer-output replacement and its report section
/// (nothing when the tables have no `layer_out_rel_change_pct` rows).
fn layer_output_figure(
    d: &ExperimentData,
    m: &str,
    phases: &[u32],
    dir: &Path,
    report: &mut Report,
    files: &mut Vec<PathBuf>,
) -> Result<()> {
    let rows: Vec<&LongRow> = d
        .find(m, "layer_out_rel_change_pct")
        .filter(|r| r.head.is_none() && r.layer.is_some())
        .collect();
    if rows.is_empty() {
        return Ok(());
    }
    let layers: BTreeSet<u32> = rows.iter().filter_map(|r| r.layer).collect();
    let layers: Vec<u32> = layers.into_iter().collect();
    let matrix = layers
        .iter()
        .map(|&l| {
            phases
                .iter()
                .map(|&p| {
                    rows.iter()
                        .find(|r| r.layer == Some(l) && r.phase == Some(p))
                        .map_or(f64::NAN, |r| r.value)
                })
                .collect()
        })
        .collect();
    let spec = HeatmapSpec {
        matrix,
        row_labels: layers.iter().map(|l| format!("L{l}")).collect(),
        col_labels: phases.iter().map(|p| p.to_string()).collect(),
        title: format!("{m}: attention-output replacement over the final positions"),
        x_label: "source phase (t_K mod P)".into(),
        y_label: "layer".into(),
        colorbar_label: "relative change of accuracy (%)".into(),
        diverging: true,
        range: None,
        annotate: true,
        size: None,
    };
    report.section("Layer-output replacement");
    let f = heatmap(dir.join("layer_output"), &spec)?;
    push(
        files,
        report,
        "Whole-layer attention-output replacement over a band of final query positions",
        f,
    );
    Ok(())
}
