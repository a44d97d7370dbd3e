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

use crate::analysis::effects::nld_of_sums;
use crate::analysis::{Clusters, accuracy_clusters, per_phase};
use crate::error::Result;
use crate::output::{HeadKind, Headline, LongRow};
use crate::tasks::KvEvalSet;

use super::super::exec::{Group, GroupResult};
use super::super::experiment::{Experiment, Selection};
pub use super::super::heads::Direction;
use super::super::heads::{head_patch_cells, nld_clusters};
use super::super::patching::{Cell, Positions};
use super::super::report::{
    CellMap, ColourScale, Figures, HeadGrid, cell_map, head_axes, head_phase_map,
    layer_head_heatmap, layer_kv_phase_map, ranked_table, ranking, spec_index_heatmap, sym_range,
};
use super::super::rows::{RowCtx, baseline_rows, specialization_rows};
use super::super::setup;
use super::super::text_pairs::text_group_pairs;
use super::{Ctx, HeadCell, Kind, KindOutput, base_obs, empty_list, head_cells};
use crate::tasks::prompts::{PromptMeta, paired_prompts};

fn both_kinds() -> Vec<HeadKind> {
    vec![HeadKind::Query, HeadKind::Kv]
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

/// The cells of one group of `n` clean then `n` corrupted prompts: per direction, one
/// patch per head into the receiving half (the corrupted prompts when denoising, the
/// clean ones when noising).
fn patch_cells(cfg: &PatchHeads, heads: &[HeadCell], n: usize) -> Vec<Cell> {
    head_patch_cells(&cfg.directions, heads, &cfg.positions, n)
}

/// One group of paired (clean, corrupted) prompts per phase with its cells, and the
/// prompts' metas.
fn patch_groups(
    cfg: &PatchHeads,
    ctx: &Ctx,
    set: &KvEvalSet,
    heads: &[HeadCell],
) -> Result<(Vec<Group>, Vec<Vec<PromptMeta>>)> {
    let assign = if ctx.task.prompt.assign {
        ctx.task.space.assign().len()
    } else {
        0
    };
    let mut groups = Vec::new();
    let mut metas = Vec::new();
    for &r in &ctx.task.phases {
        let ex = ctx.examples(set, r);
        let (prompts, meta) = paired_prompts(
            &ex,
            &ctx.task.space,
            assign,
            ctx.task.prompt.key_len,
            ctx.task.seed,
        )?;
        groups.push(Group {
            key: format!("p{r}"),
            prompts,
            cells: patch_cells(cfg, heads, ex.len()),
        });
        metas.push(meta);
    }
    Ok((groups, metas))
}

/// The groups of a text task (`[task] kind = "passkey" | "needle"`): per phase, the
/// clean prompts and their partners with another value (`runner::text_pairs`), under
/// `[task] protocol`, with this kind's cells.
fn text_groups(
    cfg: &PatchHeads,
    ctx: &mut Ctx,
    heads: &[HeadCell],
) -> Result<(Vec<Group>, Vec<Vec<PromptMeta>>)> {
    let set = ctx
        .task
        .text_set(ctx.exp, ctx.task.protocol)?
        .expect("text_groups runs on text tasks");
    ctx.preflight(set.prompt_len)?;
    note_evict_prefix(ctx);
    let tok = ctx
        .task
        .space
        .tokenizer()
        .expect("text_set checked the tokenizer");
    let mut groups = Vec::new();
    let mut metas = Vec::new();
    for &r in &ctx.task.phases {
        let (prompts, meta) = text_group_pairs(tok, &set, r, ctx.task.n_logical, |e| {
            setup::text_error(ctx.exp, e)
        })?;
        groups.push(Group {
            key: format!("p{r}"),
            cells: patch_cells(cfg, heads, meta.len() / 2),
            prompts,
        });
        metas.push(meta);
    }
    Ok((groups, metas))
}

/// A note when an `evict` overlay meets prefix padding: the rows of a phase group end
/// at different positions (the pads after the value), so the observation window,
/// counted from each row's end, moves between rows (in-sequence padding puts nothing
/// after the value).
fn note_evict_prefix(ctx: &mut Ctx) {
    let evict = matches!(
        ctx.exp.file.model.compression,
        Some(crate::model::compression::Overlay::Evict { .. })
    );
    if evict && ctx.task.protocol == crate::tasks::Protocol::PrefixPadding {
        let w = "evict overlay under prefix padding: a phase group's prompts are cut after its last read position, so rows whose value comes earlier keep pads after it and their observation window moves; use protocol = \"in_sequence_padding\"".to_string();
        if ctx.opts.progress != crate::runner::ProgressMode::Hidden {
            eprintln!("warning: {w}");
        }
        ctx.notes.push(w);
    }
}

/// The evaluated groups of a run (metas and results of each group) and what their
/// rows need: the row context, phases, bootstrap settings.
struct Outcomes<'a> {
    metas: &'a [Vec<PromptMeta>],
    results: &'a [GroupResult],
    rc: &'a RowCtx,
    phases: &'a [u32],
    p: usize,
    reps: usize,
    seed: u64,
}

impl Outcomes<'_> {
    /// Baselines: clean and corrupted accuracy, and both logit differences (clean
    /// orientation).
    fn baselines(&self) -> Vec<LongRow> {
        let (p, phases, reps, seed, rc) = (self.p, self.phases, self.reps, self.seed, self.rc);
        let mut acc = Vec::new();
        let mut acc_corrupt = Vec::new();
        let mut ld_clean = Clusters::<1>::new(p);
        let mut ld_corrupt = Clusters::<1>::new(p);
        for (meta, res) in self.metas.iter().zip(self.results) {
            acc.extend(base_obs(meta, res));
            let n = meta.len() / 2;
            for (i, m) in meta.iter().take(n).enumerate() {
                acc_corrupt.push((m.logical, m.phase, res.base[n + i].correct));
                ld_clean.add(m.logical, m.phase, [res.base[i].ld as f64]);
                ld_corrupt.add(m.logical, m.phase, [-res.base[n + i].ld as f64]);
            }
        }
        let mut rows: Vec<LongRow> =
            baseline_rows(rc, "", &accuracy_clusters(p, acc), phases, reps, seed);
        rows.extend(baseline_rows(
            rc,
            "_corrupted",
            &accuracy_clusters(p, acc_corrupt),
            phases,
            reps,
            seed,
        ));
        for (metric, c) in [
            ("logit_diff_clean", &ld_clean),
            ("logit_diff_corrupted", &ld_corrupt),
        ] {
            let (per, pooled) = per_phase(c, |s, n| s[0] / n as f64, reps, seed);
            rows.extend(rc.phase_rows(metric, None, phases, &per, pooled));
        }
        rows
    }

    /// The rows of head `h` (cell `ci`) under direction `d`: its NLD per phase and, for
    /// the `first` direction, its specialization.
    fn head_rows(&self, d: Direction, first: bool, h: &HeadCell, ci: usize) -> Vec<LongRow> {
        let (phases, rc) = (self.phases, self.rc);
        let c = nld_clusters(self.metas, self.results, ci, d, self.p);
        let (per, pooled) = per_phase(&c, nld_of_sums, self.reps, self.seed);
        let at = Some((h.layer as u32, Some((h.head as u32, h.kind))));
        let mut rows = rc.phase_rows(d.metric(), at, phases, &per, pooled);
        if first {
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
                rc,
                h.layer as u32,
                h.head as u32,
                h.kind,
                phases,
                &effect,
            ));
        }
        rows
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
    let (groups, metas) = if ctx.task.text.is_some() {
        text_groups(cfg, ctx, &heads)?
    } else {
        let set = ctx.eval_set()?;
        patch_groups(cfg, ctx, &set, &heads)?
    };
    let results = ctx.execute(&format!("{} patch-heads", ctx.mref.name), &groups)?;
    let phases = ctx.task.phases.clone();
    let rc = ctx.rows.clone();
    let out = Outcomes {
        metas: &metas,
        results: &results,
        rc: &rc,
        phases: &phases,
        p: ctx.p(),
        reps: ctx.reps(),
        seed: ctx.seed(),
    };
    let mut rows = out.baselines();
    // Cells: per direction and head, clusters of (LD_patched, LD_clean, LD_corrupted).
    for (di, d) in cfg.directions.iter().enumerate() {
        for (hi, h) in heads.iter().enumerate() {
            rows.extend(out.head_rows(*d, di == 0, h, di * heads.len() + hi));
        }
    }
    Ok(KindOutput {
        tables: vec![("heads".into(), rows)],
    })
}

/// This kind's figures and report section, from its tables alone.
fn draw(cfg: &PatchHeads, f: &mut Figures) -> Result<()> {
    f.report.section("Activation patching of hook_z");
    f.report.paragraph(
        "Normalised logit difference NLD = (LD_patched - LD_corrupted) / (LD_clean - LD_corrupted), \
         LD = logit(clean answer) - logit(corrupted answer) at the read position, summed over the \
         prompts of each source phase. Denoising patches the clean activation into the corrupted run \
         (1 = the head alone restores the clean answer); noising patches the corrupted activation \
         into the clean run (0 = the head alone destroys it). KV-head cells patch every query head \
         that reads the KV head.",
    );
    for (di, &dir) in cfg.directions.iter().enumerate() {
        if f.data.has(&f.model, dir.metric()) {
            direction_figures(f, dir, di == 0)?;
        }
    }
    if let Some(second) = cfg.directions.get(1) {
        f.report.paragraph(format!(
            "Per-phase heatmaps of {} are in this folder as {}_phase<r>.png / .svg.",
            second.metric(),
            second.metric()
        ));
    }
    if let Some(&first) = cfg.directions.first()
        && f.data.has(&f.model, first.metric())
    {
        specialization_section(f, first)?;
    }
    Ok(())
}

/// The strongest query head of `cells` over all phases, as a headline.
fn strongest_query_head(cells: &CellMap, metric: &str) -> Option<Headline> {
    let (best, v) = cells
        .iter()
        .filter(|((_, _, p), v)| p.is_none() && v.is_finite())
        .max_by(|a, b| a.1.total_cmp(b.1))?;
    Some(
        Headline::new(
            format!("Strongest query head ({metric}, all phases)"),
            format!("L{}.H{}", best.0, best.1),
        )
        .with_detail(format!("NLD {v:.3}")),
    )
}

/// The figures of one direction's NLD: the strongest query head, layer x query head
/// heatmaps per source phase (embedded for the `first` direction, else only written)
/// and pooled, and the layer x KV head x phase map.
fn direction_figures(f: &mut Figures, dir: Direction, first: bool) -> Result<()> {
    let (d, m) = (f.data, f.model.clone());
    let metric = dir.metric();
    let cells = cell_map(d, &m, metric, HeadKind::Query);
    let (layers, heads) = head_axes(d, &m, metric, HeadKind::Query);
    if let Some(h) = strongest_query_head(&cells, metric) {
        f.report.headline(h);
    }
    if !layers.is_empty() {
        query_head_heatmaps(f, metric, &cells, &layers, &heads, first)?;
    }
    if let Some(fig) = layer_kv_phase_map(
        &f.dir.join(format!("{metric}_kv")),
        d,
        &m,
        metric,
        &f.phases,
        format!("{m}: {metric} per layer x KV head x source phase"),
        "normalised logit difference",
    )? {
        f.push(&format!("{metric} per layer x KV head x source phase"), fig);
    }
    Ok(())
}

/// Layer x query head heatmaps of `metric` per source phase (embedded when `embed`,
/// else only written: the report stays readable) and pooled over phases, on one
/// colour range.
fn query_head_heatmaps(
    f: &mut Figures,
    metric: &str,
    cells: &CellMap,
    layers: &[u32],
    heads: &[u32],
    embed: bool,
) -> Result<()> {
    let m = f.model.clone();
    let range = sym_range(cells.values().copied());
    for p in f.phases.clone() {
        let fig = layer_head_heatmap(
            &f.dir.join(format!("{metric}_phase{p}")),
            &HeadGrid {
                cells,
                layers,
                heads,
                head_label: "H",
            },
            Some(p),
            format!("{m}: {metric}, source phase {p}"),
            &ColourScale {
                label: "normalised logit difference",
                range,
                diverging: true,
            },
        )?;
        if embed {
            f.push(
                &format!("{metric} per layer x query head, source phase {p}"),
                fig,
            );
        } else {
            // Written, not embedded: the report stays readable.
            f.files.push(fig.png);
            f.files.push(fig.svg);
        }
    }
    let fig = layer_head_heatmap(
        &f.dir.join(format!("{metric}_all_phases")),
        &HeadGrid {
            cells,
            layers,
            heads,
            head_label: "H",
        },
        None,
        format!("{m}: {metric}, all phases pooled"),
        &ColourScale {
            label: "normalised logit difference",
            range,
            diverging: true,
        },
    )?;
    f.push(&format!("{metric} per layer x query head, all phases"), fig);
    Ok(())
}

/// "Phase specialization" from the first direction's effect: the head x phase map,
/// the specialization index and the most specialized heads.
fn specialization_section(f: &mut Figures, first: Direction) -> Result<()> {
    let (d, m, dir) = (f.data, f.model.clone(), f.dir);
    f.report.section("Phase specialization");
    f.report.paragraph(format!(
        "Specialization index of a head: S = 1 - (exp(H) - 1) / (P - 1) of its normalised positive \
         effect profile over phases (effect = {}); S = 1: all of the effect on one phase, S = 0: spread evenly.",
        match first {
            Direction::Denoise => "the denoising NLD",
            Direction::Noise => "1 - the noising NLD",
        }
    ));
    if let Some(fig) = head_phase_map(
        &dir.join("specialization_map"),
        d,
        &m,
        first.metric(),
        &f.phases,
        format!("{m}: {} per head x source phase", first.metric()),
        "normalised logit difference",
    )? {
        f.push("Head x phase specialization map", fig);
    }
    if let Some(fig) = spec_index_heatmap(
        &dir.join("specialization_index"),
        d,
        &m,
        format!("{m}: specialization index per head"),
    )? {
        f.push("Specialization index per layer x head", fig);
    }
    let ranked = match first {
        Direction::Denoise => ranking(d, &m, first.metric(), &f.phases, |v| v),
        Direction::Noise => ranking(d, &m, first.metric(), &f.phases, |v| 1.0 - v),
    };
    ranked_table(&mut f.report, "Most phase-specialized heads", &ranked);
    Ok(())
}
