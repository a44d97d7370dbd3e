//! `ablate-heads`: ablate one head at a time (zero, per-phase mean, resample) and
//! measure the relative change of top-1 accuracy per phase,
//! `100 * (acc_ablated - acc_clean) / acc_clean`.

use serde::{Deserialize, Serialize};

use crate::analysis::relative_change_pct;
use crate::analysis::{Clusters, accuracy_clusters, per_phase};
use crate::error::Result;
use crate::output::{HeadKind, LongRow};

use super::super::exec::Group;
use super::super::experiment::{Experiment, Selection};
use super::super::patching::{Cell, Edit, Fill, Positions};
use super::super::prompts::clean_prompts;
use super::super::report::{
    Figures, cell_map, head_axes, head_phase_map, layer_head_heatmap, push, ranked_table, ranking,
    spec_index_heatmap, sym_range,
};
use super::super::rows::{baseline_rows, specialization_rows};
use super::super::setup;
use super::{Ctx, Kind, KindOutput, base_obs, empty_list, head_cells, no_source};

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
        let all: Vec<usize> = (0..prompts.n()).collect();
        let mut cells = Vec::new();
        for &m in &cfg.methods {
            for h in &heads {
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

/// This kind's figures and report section, from its tables alone.
fn draw(cfg: &AblateHeads, f: &mut Figures) -> Result<()> {
    let (d, m, phases, dir) = (f.data, f.model.as_str(), &f.phases[..], f.dir);
    let (report, files) = (&mut f.report, &mut f.files);
    let methods = cfg.methods.clone();
    report.section("Head ablations");
    report.paragraph(
        "Relative change of top-1 accuracy, 100 x (ablated - clean) / clean, per source phase, when one \
         head's hook_z is replaced by zero, by its per-phase-group mean, or by its value on another prompt \
         of the same group (resample). KV-head rows ablate every query head that reads the KV head.",
    );
    for (i, meth) in methods.iter().enumerate() {
        let metric = format!("rel_change_pct_{}", meth.name());
        if !d.has(m, &metric) {
            continue;
        }
        if let Some(f) = head_phase_map(
            &dir.join(format!("{metric}_map")),
            d,
            m,
            &metric,
            phases,
            format!(
                "{m}: {} ablation, relative change per head x phase",
                meth.name()
            ),
            "relative change of accuracy (%)",
        )? {
            push(
                files,
                report,
                &format!(
                    "{} ablation: relative change (%) per head x phase",
                    meth.name()
                ),
                f,
            );
        }
        if i == 0 {
            let cells = cell_map(d, m, &metric, HeadKind::Query);
            let (layers, heads) = head_axes(d, m, &metric, HeadKind::Query);
            let range = sym_range(cells.values().copied());
            if !layers.is_empty() {
                for &p in phases {
                    let f = layer_head_heatmap(
                        &dir.join(format!("{metric}_phase{p}")),
                        &cells,
                        &layers,
                        &heads,
                        Some(p),
                        format!("{m}: {} ablation, phase {p}", meth.name()),
                        "relative change of accuracy (%)",
                        range,
                        "H",
                        true,
                    )?;
                    push(
                        files,
                        report,
                        &format!("{} ablation per layer x query head, phase {p}", meth.name()),
                        f,
                    );
                }
            }
        }
    }
    if let Some(first) = methods.first() {
        let metric = format!("rel_change_pct_{}", first.name());
        report.section("Phase specialization");
        report.paragraph(format!(
            "Specialization index S = 1 - (exp(H) - 1) / (P - 1) of each head's accuracy drop profile \
             (minus the relative change under {} ablation).",
            first.name()
        ));
        if let Some(f) = spec_index_heatmap(
            &dir.join("specialization_index"),
            d,
            m,
            format!("{m}: specialization index per head"),
        )? {
            push(files, report, "Specialization index per layer x head", f);
        }
        ranked_table(
            report,
            "Most phase-specialized heads",
            &ranking(d, m, &metric, phases, |v| -v),
        );
    }
    Ok(())
}
