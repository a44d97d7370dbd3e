//! `ablate-heads`: ablate one head at a time (zero, per-phase mean, resample) and
//! measure the relative change of top-1 accuracy per phase,
//! `100 * (acc_ablated - acc_clean) / acc_clean`.

use serde::{Deserialize, Serialize};

use crate::analysis::effects::{rate_of_sums, rel_change_of_sums};
use crate::analysis::{accuracy_clusters, per_phase};
use crate::error::Result;
use crate::output::{HeadKind, LongRow};

use super::super::exec::Group;
use super::super::experiment::{Experiment, Selection};
use super::super::patching::{Cell, Edit, Fill, Positions};
use super::super::report::{
    ColourScale, Figures, HeadGrid, cell_map, head_axes, head_phase_map, layer_head_heatmap,
    ranked_table, ranking, spec_index_heatmap, sym_range,
};
use super::super::rows::{baseline_rows, change_clusters, specialization_rows};
use super::super::setup;
use super::{Ctx, HeadCell, Kind, KindOutput, base_obs, empty_list, head_cells, no_source};
use crate::tasks::prompts::clean_prompts;

fn both_kinds() -> Vec<HeadKind> {
    vec![HeadKind::Query, HeadKind::Kv]
}

/// `[ablate]` (ablate-heads).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AblateHeads {
    pub layers: Selection,
    pub heads: Selection,
    pub kv_heads: Selection,
    pub head_kinds: Vec<HeadKind>,
    /// Default zero, mean, resample.
    pub methods: Vec<Fill>,
    pub positions: Positions,
}

impl Default for AblateHeads {
    fn default() -> Self {
        AblateHeads {
            layers: Selection::All,
            heads: Selection::All,
            kv_heads: Selection::All,
            head_kinds: both_kinds(),
            methods: vec![Fill::Zero, Fill::Mean, Fill::Resample],
            positions: Positions::All,
        }
    }
}

impl Kind for AblateHeads {
    fn name(&self) -> &'static str {
        "ablate-heads"
    }

    fn section(&self) -> &'static str {
        "ablate"
    }

    fn default_n_logical(&self) -> usize {
        64
    }

    fn check(&self, exp: &Experiment) -> Result<()> {
        empty_list(exp, "ablate", "head_kinds", self.head_kinds.is_empty())?;
        empty_list(exp, "ablate", "methods", self.methods.is_empty())?;
        no_source(exp, "ablate", "methods", &self.methods)
    }

    fn run(&self, ctx: &mut Ctx) -> Result<KindOutput> {
        run(self, ctx)
    }

    fn figures(&self, f: &mut Figures) -> Result<()> {
        draw(self, f)
    }
}

/// The cells of one group of `n` prompts: per method, one ablation per head, each over
/// every prompt.
fn ablate_cells(cfg: &AblateHeads, heads: &[HeadCell], n: usize) -> Vec<Cell> {
    let all: Vec<usize> = (0..n).collect();
    let mut cells = Vec::new();
    for &m in &cfg.methods {
        for h in heads {
            cells.push(Cell {
                edit: Edit::Replace {
                    point: h.point(),
                    heads: Some(h.query_heads.clone()),
                    positions: cfg.positions.clone(),
                    fill: m,
                },
                prompts: all.clone(),
            });
        }
    }
    cells
}

fn run(cfg: &AblateHeads, ctx: &mut Ctx) -> Result<KindOutput> {
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
        let cells = ablate_cells(cfg, &heads, prompts.n());
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
            let (per, pooled) = per_phase(&c, rel_change_of_sums, reps, seed);
            rows.extend(rc.phase_rows(
                &format!("rel_change_pct_{}", m.name()),
                at,
                &phases,
                &per,
                pooled,
            ));
            let (pa, pp) = per_phase(&c, rate_of_sums, reps, seed);
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

/// This kind's figures and report section, from its tables alone.
fn draw(cfg: &AblateHeads, f: &mut Figures) -> Result<()> {
    f.report.section("Head ablations");
    f.report.paragraph(
        "Relative change of top-1 accuracy, 100 x (ablated - clean) / clean, per source phase, when one \
         head's hook_z is replaced by zero, by its per-phase-group mean, or by its value on another prompt \
         of the same group (resample). KV-head rows ablate every query head that reads the KV head.",
    );
    for (i, &meth) in cfg.methods.iter().enumerate() {
        let metric = format!("rel_change_pct_{}", meth.name());
        if !f.data.has(&f.model, &metric) {
            continue;
        }
        head_phase_figure(f, meth, &metric)?;
        if i == 0 {
            query_head_figures(f, meth, &metric)?;
        }
    }
    if let Some(&first) = cfg.methods.first() {
        specialization_section(f, first)?;
    }
    Ok(())
}

/// The head x phase map of one method's relative change.
fn head_phase_figure(f: &mut Figures, meth: Fill, metric: &str) -> Result<()> {
    let (d, m, dir) = (f.data, f.model.clone(), f.dir);
    if let Some(fig) = head_phase_map(
        &dir.join(format!("{metric}_map")),
        d,
        &m,
        metric,
        &f.phases,
        format!(
            "{m}: {} ablation, relative change per head x phase",
            meth.name()
        ),
        "relative change of accuracy (%)",
    )? {
        f.push(
            &format!(
                "{} ablation: relative change (%) per head x phase",
                meth.name()
            ),
            fig,
        );
    }
    Ok(())
}

/// One layer x query head heatmap of a method's relative change per phase (one
/// colour range for all).
fn query_head_figures(f: &mut Figures, meth: Fill, metric: &str) -> Result<()> {
    let (d, m, dir) = (f.data, f.model.clone(), f.dir);
    let cells = cell_map(d, &m, metric, HeadKind::Query);
    let (layers, heads) = head_axes(d, &m, metric, HeadKind::Query);
    let range = sym_range(cells.values().copied());
    if layers.is_empty() {
        return Ok(());
    }
    for p in f.phases.clone() {
        let fig = layer_head_heatmap(
            &dir.join(format!("{metric}_phase{p}")),
            &HeadGrid {
                cells: &cells,
                layers: &layers,
                heads: &heads,
                head_label: "H",
            },
            Some(p),
            format!("{m}: {} ablation, phase {p}", meth.name()),
            &ColourScale {
                label: "relative change of accuracy (%)",
                range,
                diverging: true,
            },
        )?;
        f.push(
            &format!("{} ablation per layer x query head, phase {p}", meth.name()),
            fig,
        );
    }
    Ok(())
}

/// "Phase specialization": the specialization index of the first method's damage and
/// the most specialized heads.
fn specialization_section(f: &mut Figures, first: Fill) -> Result<()> {
    let (d, m, dir) = (f.data, f.model.clone(), f.dir);
    let metric = format!("rel_change_pct_{}", first.name());
    f.report.section("Phase specialization");
    f.report.paragraph(format!(
        "Specialization index S = 1 - (exp(H) - 1) / (P - 1) of each head's accuracy drop profile \
         (minus the relative change under {} ablation).",
        first.name()
    ));
    if let Some(fig) = spec_index_heatmap(
        &dir.join("specialization_index"),
        d,
        &m,
        format!("{m}: specialization index per head"),
    )? {
        f.push("Specialization index per layer x head", fig);
    }
    ranked_table(
        &mut f.report,
        "Most phase-specialized heads",
        &ranking(d, &m, &metric, &f.phases, |v| -v),
    );
    Ok(())
}
