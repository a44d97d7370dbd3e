//! `path-patching`: sender head -> receiver head through the receiver's query, key or
//! value input, per source phase (TransformerLens / Wang et al. style).
//!
//! For every phase group r (clean prompts and their corrupted partners, as in
//! patch-heads) and every sender head s (a query head's `hook_z`):
//!
//! 1. **Sender forward**: the receiving prompts run from the sender's layer with the
//!    sender's `hook_z` at `positions` taken from the partner prompt and EVERY other
//!    `hook_z` and every `hook_mlp_out` from that layer on frozen to the receiving
//!    prompt's own base values. The receivers' inputs `hook_q` / `hook_k` / `hook_v` of
//!    the later layers then differ from the base run only by the sender's direct path
//!    through the residual stream; they are captured.
//! 2. **Receiver forward**: for every receiver head and path (q: a query head's slice of
//!    `hook_q`; k, v: a KV head's slice of `hook_k` / `hook_v`), the receiving prompts run
//!    from the receiver's layer with only that slice replaced by its capture from step 1;
//!    everything else is computed normally. Metric: the patch-heads NLD.
//!
//! Both steps run in the patching routine every kind shares: a path is a cell whose
//! [`Edit::FromStage`] replaces the receiver's slice from the sender's [`Stage`] (step
//! 1, one stage per sender, shared by all its receivers). Step 1 runs one forward per
//! chunk of senders of a layer (rows = senders x prompts), step 2 one per chunk of cells
//! of a receiver layer; both as suffix forwards when the sender is patched at given
//! positions (`answer`, `{ final = k }`); resume per chunk; the naive oracle
//! ([`crate::runner::patching::run_cell_naive`]) runs a path as two plain forwards.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::analysis::effects::nld_of_sums;
use crate::analysis::{Est, accuracy_clusters, per_phase};
use crate::error::Result;
use crate::hooks::{HookPoint, Site};
use crate::model::LanguageModel;
use crate::output::{HeadKind, HeatmapSpec, LongRow, heatmap};

use super::super::exec::{Group, GroupResult, run_cells};
use super::super::experiment::{Experiment, Selection};
use super::super::heads::{Direction, nld_clusters};
use super::super::patching::{Cell, Edit, Fill, Outcome, Positions, Prompts, Stage};
use super::super::progress::Progress;
use super::super::report::{Figures, push, sym_range};
use super::super::rows::baseline_rows;
use super::{Ctx, Kind, KindOutput, base_obs, empty_list};
use crate::tasks::prompts::{PromptMeta, paired_prompts};

/// The receiver's input a path runs through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PathInput {
    /// The receiver query head's `hook_q`.
    Q,
    /// The receiver KV head's `hook_k`.
    K,
    /// The receiver KV head's `hook_v`.
    V,
}

impl PathInput {
    /// `q`, `k`, `v`.
    pub fn name(self) -> &'static str {
        match self {
            PathInput::Q => "q",
            PathInput::K => "k",
            PathInput::V => "v",
        }
    }

    fn site(self) -> Site {
        match self {
            PathInput::Q => Site::AttnQ,
            PathInput::K => Site::AttnK,
            PathInput::V => Site::AttnV,
        }
    }
}

/// `[path]` (path-patching).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PathPatching {
    /// Layers of the sender heads. Default all.
    pub sender_layers: Selection,
    /// Sender query heads. Default all.
    pub sender_heads: Selection,
    /// Layers of the receiver heads (only those after a sender's layer pair up).
    /// Default all.
    pub receiver_layers: Selection,
    /// Receiver query heads (q path). Default all.
    pub receiver_heads: Selection,
    /// Receiver KV heads (k and v paths). Default all.
    pub receiver_kv_heads: Selection,
    /// Default all three.
    pub paths: Vec<PathInput>,
    /// Default denoising only.
    pub directions: Vec<Direction>,
    /// Positions where the sender is patched. Default all (so that the sender's effect
    /// on the keys and values at the needle's positions counts).
    pub positions: Positions,
}

impl Default for PathPatching {
    fn default() -> Self {
        PathPatching {
            sender_layers: Selection::All,
            sender_heads: Selection::All,
            receiver_layers: Selection::All,
            receiver_heads: Selection::All,
            receiver_kv_heads: Selection::All,
            paths: vec![PathInput::Q, PathInput::K, PathInput::V],
            directions: vec![Direction::Denoise],
            positions: Positions::All,
        }
    }
}

/// The metric of the path from any sender to receiver `(layer, head)` through `input`:
/// `path_nld_denoise_q_L3H1`, `path_nld_denoise_v_L3KV0`.
pub fn path_metric(d: Direction, input: PathInput, layer: usize, head: usize) -> String {
    let h = match input {
        PathInput::Q => format!("H{head}"),
        _ => format!("KV{head}"),
    };
    format!("path_{}_{}_L{layer}{h}", d.metric(), input.name())
}

impl Kind for PathPatching {
    fn name(&self) -> &'static str {
        "path-patching"
    }

    fn section(&self) -> &'static str {
        "path"
    }

    fn default_n_logical(&self) -> usize {
        16
    }

    fn check(&self, exp: &Experiment) -> Result<()> {
        empty_list(exp, "path", "paths", self.paths.is_empty())?;
        empty_list(exp, "path", "directions", self.directions.is_empty())
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
        draw(f)
    }
}

/// A sender query head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sender {
    pub layer: usize,
    pub head: usize,
}

/// A receiver: a query head (q) or a KV head (k, v) of a later layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Receiver {
    pub layer: usize,
    pub head: usize,
    pub input: PathInput,
}

/// One path cell: sender index, receiver, direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathCell {
    pub sender: usize,
    pub receiver: Receiver,
    pub direction: Direction,
}

fn resolve(exp: &Experiment, key: &str, sel: &Selection, n: usize) -> Result<Vec<usize>> {
    sel.resolve(n, key).map_err(|e| exp.err("path", key, e))
}

/// The stage every path of sender `s` replaces from: `s`'s `hook_z` at `positions`
/// from the partner prompt, every `hook_z` (the sender's layer's included: its other
/// heads) and every `hook_mlp_out` from `s`'s layer through layer `last` (the last
/// receiver layer) frozen to the prompt's own base values. One stage for all the
/// sender's receivers, so that they share its forwards.
fn sender_stage(s: Sender, positions: &Positions, last: usize) -> Stage {
    let mut freeze = Vec::new();
    for l in s.layer..=last {
        freeze.push(HookPoint::block(l, Site::AttnZ));
        freeze.push(HookPoint::block(l, Site::MlpOut));
    }
    Stage {
        point: HookPoint::block(s.layer, Site::AttnZ),
        heads: Some(vec![s.head]),
        positions: positions.clone(),
        fill: Fill::Source,
        freeze,
    }
}

/// The patching routine's cells of `cells` on a batch of `n` clean then `n` corrupted
/// prompts, in order: per path, the receiver's input slice (q: a query head of
/// `hook_q`; k, v: a KV head of `hook_k` / `hook_v`; every position) replaced from its
/// sender's stage ([`sender_stage`]) over the receiving prompts of its direction.
pub fn path_routine_cells(
    senders: &[Sender],
    cells: &[PathCell],
    positions: &Positions,
    n: usize,
) -> Vec<Cell> {
    let last = cells.iter().map(|c| c.receiver.layer).max().unwrap_or(0);
    let stages: Vec<Arc<Stage>> = senders
        .iter()
        .map(|&s| Arc::new(sender_stage(s, positions, last)))
        .collect();
    cells
        .iter()
        .map(|c| Cell {
            edit: Edit::FromStage {
                stage: stages[c.sender].clone(),
                point: HookPoint::block(c.receiver.layer, c.receiver.input.site()),
                heads: Some(vec![c.receiver.head]),
            },
            prompts: c.direction.receivers(n),
        })
        .collect()
}

/// Evaluate path cells on one prompt batch (clean `0..n`, corrupted partners `n..2n`)
/// through the patching routine, without a store. Returns the base outcomes (every
/// prompt) and, per cell, one outcome per receiving prompt (the corrupted prompts for
/// denoising, the clean ones for noising).
pub fn path_group(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    senders: &[Sender],
    cells: &[PathCell],
    positions: &Positions,
    max_rows: usize,
    progress: &mut Progress,
) -> Result<(Vec<Outcome>, Vec<Vec<Outcome>>)> {
    let routine = path_routine_cells(senders, cells, positions, prompts.n() / 2);
    let r = run_cells(model, prompts, &routine, max_rows, progress)?;
    Ok((r.base, r.cells))
}

/// The senders and the path cells of a run: per direction, sender, later receiver layer,
/// receiver input and receiver head.
struct Paths {
    senders: Vec<Sender>,
    cells: Vec<PathCell>,
}

/// The senders and cells the settings select; an error when no receiver layer comes
/// after a sender layer.
fn select_paths(cfg: &PathPatching, ctx: &Ctx) -> Result<Paths> {
    let exp = ctx.exp;
    let nl = ctx.info.n_layers();
    let s_layers = resolve(exp, "sender_layers", &cfg.sender_layers, nl)?;
    let r_layers = resolve(exp, "receiver_layers", &cfg.receiver_layers, nl)?;
    let mut senders = Vec::new();
    for &l in &s_layers {
        for h in resolve(
            exp,
            "sender_heads",
            &cfg.sender_heads,
            ctx.info.layers[l].n_heads,
        )? {
            senders.push(Sender { layer: l, head: h });
        }
    }
    let mut cells = Vec::new();
    for &d in &cfg.directions {
        for (si, s) in senders.iter().enumerate() {
            for &lr in r_layers.iter().filter(|&&l| l > s.layer) {
                let spec = &ctx.info.layers[lr];
                for &input in &cfg.paths {
                    let (key, sel, n) = match input {
                        PathInput::Q => ("receiver_heads", &cfg.receiver_heads, spec.n_heads),
                        _ => ("receiver_kv_heads", &cfg.receiver_kv_heads, spec.n_kv_heads),
                    };
                    for h in resolve(exp, key, sel, n)? {
                        cells.push(PathCell {
                            sender: si,
                            receiver: Receiver {
                                layer: lr,
                                head: h,
                                input,
                            },
                            direction: d,
                        });
                    }
                }
            }
        }
    }
    if cells.is_empty() {
        return Err(exp.err(
            "path",
            "receiver_layers",
            "no receiver layer comes after a sender layer: no path to patch",
        ));
    }
    Ok(Paths { senders, cells })
}

/// Every phase group's prompt metadata and outcomes, through the patching routine
/// (resume per chunk of cells).
fn path_groups(
    cfg: &PathPatching,
    ctx: &mut Ctx,
    paths: &Paths,
) -> Result<(Vec<Vec<PromptMeta>>, Vec<GroupResult>)> {
    let set = ctx.eval_set()?;
    let assign = if ctx.task.prompt.assign {
        ctx.task.space.assign().len()
    } else {
        0
    };
    let mut metas = Vec::new();
    let mut groups = Vec::new();
    for &r in &ctx.task.phases {
        let ex = ctx.examples(&set, r);
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
            cells: path_routine_cells(&paths.senders, &paths.cells, &cfg.positions, ex.len()),
        });
        metas.push(meta);
    }
    let results = ctx.execute(&format!("{} path-patching", ctx.mref.name), &groups)?;
    Ok((metas, results))
}

/// Clean and corrupted accuracy rows, from the base outcomes of every group.
fn baseline(ctx: &Ctx, metas: &[Vec<PromptMeta>], results: &[GroupResult]) -> Vec<LongRow> {
    let mut acc = Vec::new();
    let mut acc_corrupt = Vec::new();
    for (meta, res) in metas.iter().zip(results) {
        acc.extend(base_obs(meta, res));
        let n = meta.len() / 2;
        for (i, m) in meta.iter().take(n).enumerate() {
            acc_corrupt.push((m.logical, m.phase, res.base[n + i].correct));
        }
    }
    let (p, phases) = (ctx.p(), &ctx.task.phases);
    let (reps, seed) = (ctx.reps(), ctx.seed());
    let rc = &ctx.rows;
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
    rows
}

/// The NLD rows of every path cell (at the sender head, per phase and pooled).
fn cell_rows(
    ctx: &Ctx,
    paths: &Paths,
    metas: &[Vec<PromptMeta>],
    results: &[GroupResult],
) -> Vec<LongRow> {
    let (p, phases) = (ctx.p(), &ctx.task.phases);
    let (reps, seed) = (ctx.reps(), ctx.seed());
    let mut rows = Vec::new();
    for (ci, cell) in paths.cells.iter().enumerate() {
        let c = nld_clusters(metas, results, ci, cell.direction, p);
        let (per, pooled) = per_phase(&c, nld_of_sums, reps, seed);
        let s = paths.senders[cell.sender];
        let metric = path_metric(
            cell.direction,
            cell.receiver.input,
            cell.receiver.layer,
            cell.receiver.head,
        );
        let at = Some((s.layer as u32, Some((s.head as u32, HeadKind::Query))));
        rows.extend(ctx.rows.phase_rows(&metric, at, phases, &per, pooled));
    }
    rows
}

fn run(cfg: &PathPatching, ctx: &mut Ctx) -> Result<KindOutput> {
    let paths = select_paths(cfg, ctx)?;
    let (metas, results) = path_groups(cfg, ctx, &paths)?;
    let mut rows = baseline(ctx, &metas, &results);
    rows.extend(cell_rows(ctx, &paths, &metas, &results));
    rows.push(ctx.rows.row(
        "path_cells",
        Est {
            value: paths.cells.len() as f64,
            ci: None,
            n: ctx.task.phases.len() as u64,
        },
    ));
    Ok(KindOutput {
        tables: vec![("paths".into(), rows)],
    })
}

/// metric -> (sender layer, head) -> phase (None: pooled) -> value.
type PathValues = BTreeMap<String, BTreeMap<(u32, u32), BTreeMap<Option<u32>, f64>>>;

/// Figures: per receiver input with the strongest feed, a sender x phase heatmap; a
/// table of the strongest paths.
fn draw(f: &mut Figures) -> Result<()> {
    let (d, m) = (f.data, f.model.clone());
    let m = m.as_str();
    f.report
        .section("Path patching: sender head -> receiver head (q / k / v)");
    f.report.paragraph(
        "Each row is a sender query head whose hook_z is patched from the partner prompt, with every other \
         head's hook_z and every MLP output frozen to the receiving prompt's own values, so that the receivers' \
         query/key/value inputs change only through the sender's direct path; then only the receiver head's \
         hook_q (query heads) or hook_k / hook_v (KV heads) is replaced by that value in an otherwise normal run. \
         Metric: the patch-heads NLD (denoising: 1 = the path alone restores the clean answer). Metric names: \
         path_nld_<direction>_<q|k|v>_L<layer>H<head> (KV heads: KV<head>); the sender is in the layer/head columns.",
    );
    // metric -> (sender label, phase) -> value
    let mut by_metric: PathValues = BTreeMap::new();
    for r in d
        .rows
        .iter()
        .filter(|r| r.model == m && r.metric.starts_with("path_nld_"))
    {
        if let (Some(l), Some(h)) = (r.layer, r.head) {
            by_metric
                .entry(r.metric.clone())
                .or_default()
                .entry((l, h))
                .or_default()
                .insert(r.phase, r.value);
        }
    }
    strongest_heatmaps(f, &by_metric)?;
    strongest_paths(f, &by_metric);
    Ok(())
}

/// Sender x phase heatmaps of the six receivers with the largest pooled |NLD|.
fn strongest_heatmaps(f: &mut Figures, by_metric: &PathValues) -> Result<()> {
    let (m, phases, dir) = (f.model.clone(), f.phases.clone(), f.dir);
    let mut strength: Vec<(f64, String)> = by_metric
        .iter()
        .map(|(k, v)| {
            let s = v
                .values()
                .filter_map(|p| p.get(&None))
                .filter(|x| x.is_finite())
                .fold(0.0f64, |a, x| a.max(x.abs()));
            (s, k.clone())
        })
        .collect();
    strength.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    for (_, metric) in strength.iter().take(6) {
        let senders = &by_metric[metric];
        let mut cols: Vec<Option<u32>> = phases.iter().map(|&p| Some(p)).collect();
        cols.push(None);
        let matrix: Vec<Vec<f64>> = senders
            .values()
            .map(|v| {
                cols.iter()
                    .map(|c| v.get(c).copied().unwrap_or(f64::NAN))
                    .collect()
            })
            .collect();
        let spec = HeatmapSpec {
            range: sym_range(matrix.iter().flatten().copied()),
            matrix,
            row_labels: senders.keys().map(|(l, h)| format!("L{l}H{h}")).collect(),
            col_labels: cols
                .iter()
                .map(|c| c.map_or("all".to_string(), |p| p.to_string()))
                .collect(),
            title: format!("{m}: {metric} per sender x source phase"),
            x_label: "source phase".into(),
            y_label: "sender head".into(),
            colorbar_label: "normalised logit difference".into(),
            diverging: true,
            annotate: true,
            size: None,
        };
        let fig = heatmap(dir.join(metric), &spec)?;
        push(
            &mut f.files,
            &mut f.report,
            &format!("{metric}: per sender head x source phase"),
            fig,
        );
    }
    Ok(())
}

/// The strongest paths (pooled), with their per-phase values.
fn strongest_paths(f: &mut Figures, by_metric: &PathValues) {
    let phases = &f.phases;
    let mut edges: Vec<(f64, Vec<String>)> = Vec::new();
    for (metric, senders) in by_metric {
        let receiver = metric.trim_start_matches("path_");
        for ((l, h), v) in senders {
            let pooled = v.get(&None).copied().unwrap_or(f64::NAN);
            if !pooled.is_finite() {
                continue;
            }
            let per: Vec<String> = phases
                .iter()
                .map(|p| v.get(&Some(*p)).map_or("n/a".into(), |x| format!("{x:.2}")))
                .collect();
            edges.push((
                pooled,
                vec![
                    format!("L{l}H{h}"),
                    receiver.to_string(),
                    format!("{pooled:.3}"),
                    per.join(" "),
                ],
            ));
        }
    }
    edges.sort_by(|a, b| b.0.abs().total_cmp(&a.0.abs()));
    if !edges.is_empty() {
        f.report.table(
            format!("Strongest paths (|NLD| pooled over phases; per phase {phases:?})"),
            vec![
                "sender".into(),
                "receiver (direction_input_layer.head)".into(),
                "NLD all".into(),
                "NLD per phase".into(),
            ],
            edges.into_iter().take(12).map(|e| e.1).collect(),
        );
    }
}
