//! `long-context`: the phase-matched retrieval task at haystack lengths far beyond the
//! organisms' training prompts. The prompt's bindings are spread through filler (pads, or
//! filler atoms the models never saw), the needle binding sits at each requested depth,
//! and every example is rendered at every phase, under each padding protocol
//! ([`crate::tasks::HaystackConfig`], docs/prompt_format.md section 7). One final query
//! per prompt: the paper's headline measure.
//!
//! Writes, per model, `notebooks-data/<experiment>/<model>/long_context.arrow` (schema
//! `long_context/v1`: accuracy with Wilson intervals per protocol x length x depth x
//! phase) and its Parquet copy, and long rows `accuracy_<protocol>_len<L>`,
//! `mean_accuracy_...`, `phase_gap_pp_...`, `best_phase_...`, `worst_phase_...` (over
//! depths; clusters = logical examples) for the experiment's `long_context` table.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::analysis::accuracy_clusters;
use crate::error::Result;
use crate::output::figure::{HeatmapSpec, heatmap};
use crate::output::table::{ColumnData, Table};
use crate::output::{PhaseAccuracyRow, write_parquet_copy};
use crate::tasks::{HaystackConfig, HaystackExample, HaystackFiller, KvExample, Protocol};

use super::super::exec::Group;
use super::super::experiment::Experiment;
use super::super::report::Figures;
use super::super::rows::baseline_rows;
use super::{Ctx, Kind, KindOutput};
use crate::tasks::prompts::clean_prompts;

/// Schema id of the per-cell table.
pub const LONG_CONTEXT_SCHEMA_ID: &str = "long_context/v1";

/// `[long_context]` (long-context).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LongContext {
    /// Prompt lengths in tokens (padding and filler included). Default 256, 1024, 4096.
    pub lengths: Vec<usize>,
    /// Needle depths, fractions of the haystack in 0..=1. Default 0.1, 0.5, 0.9.
    pub depths: Vec<f64>,
    /// What fills the haystack: `pad` (the pad token, what the organisms saw between
    /// bindings) or `atoms` (filler atoms). Default `pad`.
    pub filler: HaystackFiller,
    /// Protocols to evaluate. Default both.
    pub protocols: Vec<Protocol>,
    /// Tokens per batched forward: rows per forward = max(1, this / length). Default
    /// 16384 (about 80 MiB of activations for a d = 128 organism).
    pub tokens_per_forward: usize,
}

impl Default for LongContext {
    fn default() -> Self {
        LongContext {
            lengths: vec![256, 1024, 4096],
            depths: vec![0.1, 0.5, 0.9],
            filler: HaystackFiller::Pad,
            protocols: Protocol::ALL.to_vec(),
            tokens_per_forward: 16384,
        }
    }
}

impl Kind for LongContext {
    fn name(&self) -> &'static str {
        "long-context"
    }

    fn section(&self) -> &'static str {
        "long_context"
    }

    /// Logical examples per (length, depth) cell, each rendered at every phase.
    fn default_n_logical(&self) -> usize {
        16
    }

    fn accepts_model_glob(&self) -> bool {
        true
    }

    fn skips_untrained(&self) -> bool {
        true
    }

    /// Its haystack cells render every logical example at every phase themselves.
    fn matched_groups(&self) -> bool {
        false
    }

    fn check(&self, exp: &Experiment) -> Result<()> {
        let s = "long_context";
        if exp.file.task.protocol.is_some() {
            return Err(exp.err(
                "task",
                "protocol",
                "long-context evaluates [long_context] protocols (default both); remove this key",
            ));
        }
        if self.protocols.is_empty() {
            return Err(exp.err(s, "protocols", "give at least one protocol"));
        }
        if self.lengths.is_empty() {
            return Err(exp.err(s, "lengths", "give at least one length"));
        }
        if let Some(l) = self
            .lengths
            .iter()
            .find(|&&l| l > crate::tasks::MAX_HAYSTACK_LEN)
        {
            return Err(exp.err(
                s,
                "lengths",
                format!(
                    "{l} tokens is longer than the generator builds ({})",
                    crate::tasks::MAX_HAYSTACK_LEN
                ),
            ));
        }
        if self.depths.is_empty() || self.depths.iter().any(|d| !(0.0..=1.0).contains(d)) {
            return Err(exp.err(s, "depths", "give depths in 0..=1"));
        }
        if self.tokens_per_forward == 0 {
            return Err(exp.err(s, "tokens_per_forward", "must be at least 1"));
        }
        Ok(())
    }

    fn run(&self, ctx: &mut Ctx) -> Result<KindOutput> {
        run(self, ctx)
    }

    fn figures(&self, f: &mut Figures) -> Result<()> {
        draw(self, f)
    }

    fn report(&self, f: &mut Figures) -> Result<()> {
        self.figures(f)
    }
}

/// The haystack design of one protocol, from the experiment's task.
fn design(cfg: &LongContext, ctx: &Ctx, protocol: Protocol) -> HaystackConfig {
    let mut prompt = ctx.task.prompt.clone();
    prompt.n_queries = 1;
    prompt.max_len = None;
    HaystackConfig {
        prompt,
        lengths: cfg.lengths.clone(),
        depths: cfg.depths.clone(),
        filler: cfg.filler,
        period: ctx.task.period,
        protocol,
        n_logical: ctx.task.n_logical,
        seed: ctx.task.seed,
    }
}

/// One evaluated prompt: where it sits in the design and whether it was answered.
struct Obs {
    protocol: Protocol,
    length: usize,
    depth: f64,
    needle_depth: f64,
    logical: u64,
    phase: u32,
    correct: bool,
}

/// Check every protocol's design against the token space before any compute.
fn check_designs(cfg: &LongContext, ctx: &Ctx) -> Result<()> {
    for &proto in &cfg.protocols {
        let hc = design(cfg, ctx, proto);
        let min = hc.min_len(&ctx.task.space);
        if let Some(l) = cfg.lengths.iter().find(|&&l| l < min) {
            return Err(ctx.exp.err(
                "long_context",
                "lengths",
                format!(
                    "{l} tokens is shorter than the prompt without filler ({min} tokens: {} \
                     bindings, the query and P - 1 shift positions)",
                    hc.prompt.n_bindings
                ),
            ));
        }
        hc.validate(&ctx.task.space)
            .map_err(|e| ctx.exp.err("long_context", "filler", e))?;
    }
    Ok(())
}

fn run(cfg: &LongContext, ctx: &mut Ctx) -> Result<KindOutput> {
    check_designs(cfg, ctx)?;
    let phases = ctx.task.phases.clone();
    let max_rows = ctx.max_rows;
    let mut obs = Vec::new();
    for (li, &length) in cfg.lengths.iter().enumerate() {
        // One forward holds tokens_per_forward / length rows (at least one prompt):
        // that, not the group, is what the memory check sizes.
        ctx.max_rows = (cfg.tokens_per_forward / length).clamp(1, max_rows.max(1));
        ctx.preflight_plain(length)?;
        let mut groups = Vec::new();
        let mut cells: Vec<(Protocol, Vec<HaystackExample>)> = Vec::new();
        for &proto in &cfg.protocols {
            let hc = design(cfg, ctx, proto);
            for di in 0..cfg.depths.len() {
                let cell: Vec<HaystackExample> = hc
                    .cell(&ctx.task.space, li, di)?
                    .into_iter()
                    .filter(|h| phases.contains(&h.example.phase.residue()))
                    .collect();
                let ex: Vec<&KvExample> = cell.iter().map(|h| &h.example).collect();
                let (prompts, _) = clean_prompts(&ex, |_| 0);
                groups.push(Group {
                    key: format!("{}-{}-len{length}-depth{di}", ctx.mref.name, proto.label()),
                    prompts,
                    cells: Vec::new(),
                });
                cells.push((proto, cell));
            }
        }
        let results = ctx.execute(
            &format!("{} long-context {length} tokens", ctx.mref.name),
            &groups,
        );
        ctx.max_rows = max_rows;
        for ((proto, cell), res) in cells.iter().zip(results?) {
            for (h, o) in cell.iter().zip(&res.base) {
                obs.push(Obs {
                    protocol: *proto,
                    length,
                    depth: h.depth,
                    needle_depth: h.needle_depth,
                    logical: h.example.logical_id,
                    phase: h.example.phase.residue(),
                    correct: o.correct,
                });
            }
        }
    }
    let table = cell_table(&ctx.mref.name, &obs).with_provenance(&ctx.exp.text);
    let path = ctx.data_dir.join(&ctx.mref.name).join("long_context.arrow");
    table.write_arrow(&path)?;
    write_parquet_copy(&path)?;
    let (p, reps, seed) = (ctx.p(), ctx.reps(), ctx.seed());
    let mut rows = Vec::new();
    for &proto in &cfg.protocols {
        for &length in &cfg.lengths {
            let acc = accuracy_clusters(
                p,
                obs.iter()
                    .filter(|o| o.protocol == proto && o.length == length)
                    .map(|o| (o.logical, o.phase, o.correct)),
            );
            let suffix = format!("{}_len{length}", proto.metric_suffix());
            rows.extend(baseline_rows(&ctx.rows, &suffix, &acc, &phases, reps, seed));
        }
    }
    Ok(KindOutput {
        tables: vec![("long_context".into(), rows)],
    })
}

/// Columns of `long_context/v1`, in order.
pub const LONG_CONTEXT_COLUMNS: &[&str] = &[
    "model",
    "protocol",
    "length",
    "depth",
    "needle_depth",
    "phase",
    "n",
    "correct",
    "accuracy",
    "wilson_lo",
    "wilson_hi",
];

/// One row per (protocol, length, depth, phase): prompts, correct answers, accuracy
/// with its 95% Wilson interval, and the needle's mean realised depth.
fn cell_table(model: &str, obs: &[Obs]) -> Table {
    type Key = (&'static str, usize, u64, u32);
    // A cell's row: its accuracy, length, depth and mean needle depth.
    type CellRow = (PhaseAccuracyRow, usize, f64, f64);
    let mut cells: BTreeMap<Key, (f64, u64, u64, f64)> = BTreeMap::new();
    for o in obs {
        let key = (o.protocol.label(), o.length, o.depth.to_bits(), o.phase);
        let c = cells.entry(key).or_insert((o.depth, 0, 0, 0.0));
        c.1 += 1;
        c.2 += u64::from(o.correct);
        c.3 += o.needle_depth;
    }
    // Accuracy and its Wilson interval as in `phase_accuracy/v1`.
    let rows: Vec<CellRow> = cells
        .into_iter()
        .map(|((proto, length, _, phase), (depth, n, correct, needle))| {
            let acc = PhaseAccuracyRow::new(model, proto, phase, n, correct);
            (acc, length, depth, needle / n as f64)
        })
        .collect();
    let utf8 = |f: &dyn Fn(&PhaseAccuracyRow) -> &str| {
        ColumnData::Utf8(rows.iter().map(|r| Some(f(&r.0).to_string())).collect())
    };
    let uint =
        |f: &dyn Fn(&CellRow) -> u64| ColumnData::UInt64(rows.iter().map(|r| Some(f(r))).collect());
    let float = |f: &dyn Fn(&CellRow) -> f64| {
        ColumnData::Float64(rows.iter().map(|r| Some(f(r))).collect())
    };
    let cols = vec![
        utf8(&|a| &a.model),
        utf8(&|a| &a.protocol),
        uint(&|r| r.1 as u64),
        float(&|r| r.2),
        float(&|r| r.3),
        uint(&|r| u64::from(r.0.phase)),
        uint(&|r| r.0.n),
        uint(&|r| r.0.correct),
        float(&|r| r.0.accuracy),
        float(&|r| r.0.wilson_lo),
        float(&|r| r.0.wilson_hi),
    ];
    let mut t = Table::new("long_context")
        .with_metadata(crate::output::table::META_SCHEMA, LONG_CONTEXT_SCHEMA_ID);
    for (name, data) in LONG_CONTEXT_COLUMNS.iter().zip(cols) {
        t.add_column(*name, data)
            .expect("distinct, equally long columns");
    }
    t
}

/// One cell read back from `long_context.arrow`.
struct Cell {
    protocol: String,
    length: u64,
    depth: f64,
    phase: u64,
    n: u64,
    correct: u64,
}

fn read_cells(path: &Path) -> Result<Vec<Cell>> {
    let t = Table::read_arrow(path)?;
    let (proto, length, depth) = (
        t.utf8("protocol")?,
        t.uint64("length")?,
        t.float64("depth")?,
    );
    let (phase, n, correct) = (t.uint64("phase")?, t.uint64("n")?, t.uint64("correct")?);
    Ok((0..t.num_rows())
        .map(|i| Cell {
            protocol: proto[i].clone().unwrap_or_default(),
            length: length[i].unwrap_or(0),
            depth: depth[i].unwrap_or(f64::NAN),
            phase: phase[i].unwrap_or(0),
            n: n[i].unwrap_or(0),
            correct: correct[i].unwrap_or(0),
        })
        .collect())
}

/// Accuracy (%) of the cells matching `keep`, pooled; NaN when there are none.
fn pooled<'c>(cells: impl Iterator<Item = &'c Cell>) -> f64 {
    let (n, c) = cells.fold((0, 0), |(n, c), x| (n + x.n, c + x.correct));
    if n == 0 {
        f64::NAN
    } else {
        100.0 * c as f64 / n as f64
    }
}

/// Per model and protocol: accuracy by phase x length (over depths), the NIAH picture
/// by phase (depth x phase rows, length columns) and a table of the headline numbers
/// per length.
fn draw(_cfg: &LongContext, f: &mut Figures) -> Result<()> {
    let Some(data_dir) = f.data.tables.first().and_then(|p| p.parent()) else {
        return Ok(());
    };
    let data_dir = data_dir.to_path_buf();
    for m in f.models.clone() {
        let path = data_dir.join(&m).join("long_context.arrow");
        if !path.exists() {
            continue;
        }
        let cells = read_cells(&path)?;
        f.report.section(format!("Model `{m}`"));
        f.report.paragraph(format!(
            "Per-cell counts: `{m}/long_context.arrow` (schema `long_context/v1`: protocol x \
             length x depth x phase, accuracy with 95% Wilson intervals; docs/tables.md)."
        ));
        for proto in Protocol::ALL {
            let mine: Vec<&Cell> = cells
                .iter()
                .filter(|c| c.protocol == proto.label())
                .collect();
            if mine.is_empty() {
                continue;
            }
            draw_protocol(f, &m, proto, &mine)?;
        }
    }
    Ok(())
}

/// Which cells a heatmap row pools.
type Keep<'k> = Box<dyn Fn(&Cell) -> bool + 'k>;

/// The cells of one model and protocol, with their sorted axes.
struct Grid<'c> {
    m: &'c str,
    proto: Protocol,
    cells: &'c [&'c Cell],
    lengths: Vec<u64>,
    phases: Vec<u64>,
    depths: Vec<f64>,
}

impl<'c> Grid<'c> {
    fn new(m: &'c str, proto: Protocol, cells: &'c [&'c Cell]) -> Self {
        let sorted = |mut v: Vec<u64>| {
            v.sort_unstable();
            v.dedup();
            v
        };
        let mut depths: Vec<f64> = cells.iter().map(|c| c.depth).collect();
        depths.sort_by(f64::total_cmp);
        depths.dedup();
        Grid {
            m,
            proto,
            cells,
            lengths: sorted(cells.iter().map(|c| c.length).collect()),
            phases: sorted(cells.iter().map(|c| c.phase).collect()),
            depths,
        }
    }

    /// Pooled accuracy (%) of the cells at `length` that pass `keep`.
    fn acc(&self, length: u64, keep: impl Fn(&Cell) -> bool) -> f64 {
        pooled(
            self.cells
                .iter()
                .copied()
                .filter(|c| c.length == length && keep(c)),
        )
    }

    /// The report table: per length, accuracy and phase gap with their cluster-bootstrap
    /// CIs (long rows), best and worst phase, and accuracy by depth.
    fn headline_table(&self, f: &mut Figures) {
        let (d, m) = (f.data, self.m);
        let suffix = self.proto.metric_suffix();
        let cell = |metric: String, scale: f64| {
            d.scalar(m, &metric)
                .map(|r| match (r.ci_lo, r.ci_hi) {
                    (Some(lo), Some(hi)) => format!(
                        "{:.1} [{:.1}, {:.1}]",
                        scale * r.value,
                        scale * lo,
                        scale * hi
                    ),
                    _ => format!("{}", scale * r.value),
                })
                .unwrap_or_else(|| "-".into())
        };
        let rows = self
            .lengths
            .iter()
            .map(|&l| {
                let at = |x: &str| format!("{x}{suffix}_len{l}");
                let by_depth: Vec<String> = self
                    .depths
                    .iter()
                    .map(|&dp| format!("{:.1}", self.acc(l, |c| c.depth == dp)))
                    .collect();
                vec![
                    l.to_string(),
                    cell(at("mean_accuracy"), 100.0),
                    cell(at("phase_gap_pp"), 1.0),
                    cell(at("best_phase"), 1.0),
                    cell(at("worst_phase"), 1.0),
                    by_depth.join(" / "),
                ]
            })
            .collect();
        let depth_list: Vec<String> = self.depths.iter().map(|d| format!("{d}")).collect();
        f.report.table(
            format!(
                "{} padding: accuracy (%) and phase gap (pp) by prompt length, 95% \
                 cluster-bootstrap CIs over logical examples; last column: accuracy at needle \
                 depths {}",
                self.proto.label(),
                depth_list.join(" / ")
            ),
            [
                "length",
                "accuracy %",
                "phase gap pp",
                "best phase",
                "worst phase",
                "by depth %",
            ]
            .map(String::from)
            .to_vec(),
            rows,
        );
    }

    /// A 0-100 % heatmap of `rows` (label, keep) x lengths.
    fn heatmap(
        &self,
        f: &mut Figures,
        name: &str,
        what: &str,
        y_label: &str,
        rows: Vec<(String, Keep<'_>)>,
    ) -> Result<()> {
        let (m, proto) = (self.m, self.proto.label());
        let n_rows = rows.len() as u32;
        let (labels, keeps): (Vec<String>, Vec<_>) = rows.into_iter().unzip();
        let matrix = keeps
            .iter()
            .map(|keep| self.lengths.iter().map(|&l| self.acc(l, keep)).collect())
            .collect();
        let spec = HeatmapSpec {
            matrix,
            row_labels: labels,
            col_labels: self.lengths.iter().map(|l| l.to_string()).collect(),
            title: format!("{m}, {proto} padding: {what}"),
            x_label: "prompt length (tokens)".into(),
            y_label: y_label.into(),
            colorbar_label: "top-1 accuracy (%)".into(),
            diverging: false,
            range: Some((0.0, 100.0)),
            annotate: true,
            size: Some((
                360 + 110 * self.lengths.len() as u32,
                200 + 32 * n_rows.max(4),
            )),
        };
        let tag = proto.replace('-', "_");
        let fig = heatmap(f.dir.join(format!("long_context_{name}_{m}_{tag}")), &spec)?;
        f.push(
            &format!("{m}, {proto} padding: top-1 accuracy (%) by {what}"),
            fig,
        );
        Ok(())
    }
}

fn draw_protocol(f: &mut Figures, m: &str, proto: Protocol, cells: &[&Cell]) -> Result<()> {
    let g = Grid::new(m, proto, cells);
    g.headline_table(f);
    let by_phase = g
        .phases
        .iter()
        .map(|&r| {
            let keep: Keep = Box::new(move |c: &Cell| c.phase == r);
            (format!("phase {r}"), keep)
        })
        .collect();
    g.heatmap(
        f,
        "phase",
        "phase x prompt length, pooled over needle depths",
        "phase of the needle key",
        by_phase,
    )?;
    let mut niah = Vec::new();
    for &dp in &g.depths {
        for &r in &g.phases {
            let keep: Keep = Box::new(move |c: &Cell| c.phase == r && c.depth == dp);
            niah.push((format!("depth {dp}, phase {r}"), keep));
        }
    }
    g.heatmap(
        f,
        "niah",
        "needle depth x phase (rows) and prompt length (columns): the needle-in-a-haystack picture by phase",
        "needle depth, phase",
        niah,
    )
}
