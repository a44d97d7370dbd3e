//! Figures and the report of an experiment, drawn from its tables alone
//! (`notebooks-data/<experiment>/*.arrow`), so `phaselens figures` redraws them
//! without a model.
//!
//! | kind | figures (PNG + SVG under `reports/<experiment>/`) |
//! |---|---|
//! | every kind | `accuracy_by_phase`: clean top-1 accuracy per phase with 95% CI bands |
//! | patch-heads | `<metric>_phase<r>` layer x query-head heatmaps (one colour range), `<metric>_all_phases`, `<metric>_kv` (layer x KV head x phase), `specialization_map` (head x phase), `specialization_index` (layer x head) |
//! | ablate-heads | `rel_change_pct_<method>_map` (head x phase) per method, `<first method>_phase<r>` heatmaps, `specialization_index` |
//! | knockout | `knockout_kv` (the paper's Figure 3: layer x KV head x phase), `layer_output` (layer x phase), `specialization_index` |
//! | gate-profiles | `gate_g` (gate x offset heatmap), `gate_profile_*` bars (first 8 gates), `gate_entropy`, `gate_trajectory` (over checkpoints) |
//! | gate-cycling | `cycling_scatter` (predicted vs observed), `cycling_profiles` |
//! | phase-sweep | `accuracy_<model>` (both protocols) |

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::analysis::{RankedHead, rank_specialized};
use crate::error::{Error, Result};
use crate::output::{
    BandSeries, BarProfileSpec, FigureFiles, HeadKind, Headline, HeatmapSpec, LinePlotSpec,
    LongRow, META_EXPERIMENT_TOML, META_SCHEMA, Report, ScatterSeries, ScatterSpec, Table,
    bar_profile, heatmap, line_with_bands, ranked_heads_rows, read_long_rows,
    scatter_predicted_vs_observed,
};

use super::config::{Direction, Experiment, Kind, Method};
use super::kinds::gate_cycling::delta_suffix;
use super::{META_KIND, META_NOTES};

/// The long tables of one experiment folder.
#[derive(Debug, Clone)]
pub struct ExperimentData {
    pub name: String,
    pub kind: Kind,
    pub rows: Vec<LongRow>,
    pub toml: String,
    pub notes: Vec<String>,
    pub tables: Vec<PathBuf>,
}

impl ExperimentData {
    /// Read every long table (`*.arrow`, schema `long/v1`) directly under `dir`.
    pub fn load(dir: &Path) -> Result<Self> {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| Error::io(dir, e))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "arrow"))
            .collect();
        paths.sort();
        let mut rows = Vec::new();
        let mut toml = String::new();
        let mut notes = Vec::new();
        let mut kind = None;
        let mut tables = Vec::new();
        for p in paths {
            let t = Table::read_arrow(&p)?;
            if t.metadata().get(META_SCHEMA).map(String::as_str) != Some("long/v1") {
                continue;
            }
            rows.extend(read_long_rows(&t)?);
            if let Some(s) = t.metadata().get(META_EXPERIMENT_TOML) {
                toml = s.clone();
            }
            if let Some(s) = t.metadata().get(META_NOTES) {
                notes.extend(s.lines().filter(|l| !l.is_empty()).map(String::from));
            }
            if let Some(k) = t.metadata().get(META_KIND) {
                kind = Kind::parse(k);
            }
            tables.push(p);
        }
        if tables.is_empty() {
            return Err(Error::Other(format!(
                "{}: no long-format tables (*.arrow) to draw from; run the experiment first",
                dir.display()
            )));
        }
        let kind = kind
            .or_else(|| rows.first().and_then(|r| Kind::parse(&r.kind)))
            .ok_or_else(|| Error::Other(format!("{}: unknown experiment kind", dir.display())))?;
        notes.dedup();
        Ok(ExperimentData {
            name: dir
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
            kind,
            rows,
            toml,
            notes,
            tables,
        })
    }

    /// The experiment file stored in the tables, if it parses.
    pub fn experiment(&self) -> Option<Experiment> {
        Experiment::parse(Path::new("experiment.toml"), self.toml.clone()).ok()
    }

    /// Base models (without `@step` checkpoints), in first-seen order.
    pub fn models(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for r in &self.rows {
            if !r.model.contains('@') && !out.contains(&r.model) {
                out.push(r.model.clone());
            }
        }
        out
    }

    fn find(&self, model: &str, metric: &str) -> impl Iterator<Item = &LongRow> {
        let (model, metric) = (model.to_string(), metric.to_string());
        self.rows
            .iter()
            .filter(move |r| r.model == model && r.metric == metric)
    }

    fn has(&self, model: &str, metric: &str) -> bool {
        self.find(model, metric).next().is_some()
    }

    /// The whole-model row of `metric` (no layer, head or phase).
    fn scalar(&self, model: &str, metric: &str) -> Option<&LongRow> {
        self.find(model, metric)
            .find(|r| r.layer.is_none() && r.head.is_none() && r.phase.is_none())
    }

    /// Phases present in `metric`'s per-phase whole-model rows, sorted.
    fn phases(&self, model: &str, metric: &str) -> Vec<u32> {
        let s: BTreeSet<u32> = self.find(model, metric).filter_map(|r| r.phase).collect();
        s.into_iter().collect()
    }
}

/// Whether `dir` holds a long-format table written by the runner (other folders under
/// `notebooks-data/`, e.g. training loss curves, are not experiments).
fn has_long_table(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|r| {
        r.flatten().any(|f| {
            let p = f.path();
            p.extension().is_some_and(|x| x == "arrow")
                && Table::read_arrow(&p).is_ok_and(|t| {
                    t.metadata().get(META_SCHEMA).map(String::as_str) == Some("long/v1")
                        && t.metadata().contains_key(META_KIND)
                })
        })
    })
}

/// Draw every experiment under `data_root` (or only `only`); returns the files per experiment.
pub fn draw_all(
    data_root: &Path,
    reports_root: &Path,
    only: Option<&str>,
) -> Result<Vec<(String, Vec<PathBuf>)>> {
    let mut names: Vec<String> = match only {
        Some(n) => vec![n.to_string()],
        None => std::fs::read_dir(data_root)
            .map_err(|e| Error::io(data_root, e))?
            .flatten()
            .filter(|e| e.path().is_dir())
            .filter(|e| has_long_table(&e.path()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
    };
    names.sort();
    let mut out = Vec::new();
    for n in names {
        let dir = data_root.join(&n);
        if !dir.is_dir() {
            return Err(Error::Other(format!(
                "{}: no such experiment output (run `phaselens run` first)",
                dir.display()
            )));
        }
        let files = draw_experiment(&dir, &reports_root.join(&n))?;
        out.push((n, files));
    }
    Ok(out)
}

fn push(files: &mut Vec<PathBuf>, report: &mut Report, caption: &str, f: FigureFiles) {
    report.figure_files(caption, &f);
    files.push(f.png);
    files.push(f.svg);
}

fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:.1}%", 100.0 * x)
    } else {
        "n/a".into()
    }
}

fn ci_text(r: &LongRow, f: impl Fn(f64) -> String) -> String {
    match (r.ci_lo, r.ci_hi) {
        (Some(lo), Some(hi)) => format!("95% CI [{}, {}]", f(lo), f(hi)),
        _ => String::new(),
    }
}

/// Headline numbers from the baseline rows (`accuracy{suffix}`, `mean_accuracy{suffix}`, ...).
fn baseline_headlines(d: &ExperimentData, model: &str, suffix: &str, label: &str) -> Vec<Headline> {
    let mut out = Vec::new();
    let acc_at = |ph: f64| {
        d.find(model, &format!("accuracy{suffix}"))
            .find(|r| r.layer.is_none() && r.phase == Some(ph as u32))
            .map(|r| r.value)
    };
    if let Some(r) = d.scalar(model, &format!("mean_accuracy{suffix}")) {
        out.push(
            Headline::new(format!("{label}Mean accuracy"), pct(r.value)).with_detail(format!(
                "{}, mean over phases, {} logical examples per phase",
                ci_text(r, pct),
                r.n
            )),
        );
    }
    for (m, name) in [("best_phase", "Best phase"), ("worst_phase", "Worst phase")] {
        if let Some(r) = d.scalar(model, &format!("{m}{suffix}")) {
            out.push(
                Headline::new(format!("{label}{name}"), format!("{}", r.value as i64)).with_detail(
                    format!("accuracy {}", acc_at(r.value).map_or("n/a".into(), pct)),
                ),
            );
        }
    }
    if let Some(r) = d.scalar(model, &format!("phase_gap_pp{suffix}")) {
        out.push(
            Headline::new(format!("{label}Phase gap"), format!("{:.1} pp", r.value)).with_detail(
                format!(
                    "{} pp, selection-adjusted cluster bootstrap",
                    ci_text(r, |v| format!("{v:.1}"))
                ),
            ),
        );
    }
    out
}

fn band_series(d: &ExperimentData, model: &str, metric: &str, name: &str) -> Option<BandSeries> {
    let mut pts: Vec<(u32, f64, f64, f64)> = d
        .find(model, metric)
        .filter(|r| r.layer.is_none() && r.head.is_none())
        .filter_map(|r| {
            r.phase.map(|p| {
                (
                    p,
                    r.value,
                    r.ci_lo.unwrap_or(r.value),
                    r.ci_hi.unwrap_or(r.value),
                )
            })
        })
        .collect();
    if pts.is_empty() {
        return None;
    }
    pts.sort_by_key(|p| p.0);
    Some(BandSeries {
        name: name.to_string(),
        x: pts.iter().map(|p| f64::from(p.0)).collect(),
        y: pts.iter().map(|p| p.1).collect(),
        lo: pts.iter().map(|p| p.2).collect(),
        hi: pts.iter().map(|p| p.3).collect(),
    })
}

fn accuracy_figure(
    out: &Path,
    d: &ExperimentData,
    model: &str,
    series: &[(&str, String)],
    title: &str,
) -> Result<Option<FigureFiles>> {
    let series: Vec<BandSeries> = series
        .iter()
        .filter_map(|(name, metric)| band_series(d, model, metric, name))
        .collect();
    if series.is_empty() {
        return Ok(None);
    }
    let spec = LinePlotSpec {
        series,
        title: title.to_string(),
        x_label: "phase of the target key (t_K mod P)".into(),
        y_label: "top-1 accuracy (95% CI)".into(),
        y_range: Some((0.0, 1.0)),
        size: None,
    };
    Ok(Some(line_with_bands(out, &spec)?))
}

/// Layers and head indices present for `metric` with head kind `kind`.
fn head_axes(
    d: &ExperimentData,
    model: &str,
    metric: &str,
    kind: HeadKind,
) -> (Vec<u32>, Vec<u32>) {
    let mut layers = BTreeSet::new();
    let mut heads = BTreeSet::new();
    for r in d.find(model, metric) {
        if r.head_kind == Some(kind)
            && let (Some(l), Some(h)) = (r.layer, r.head)
        {
            layers.insert(l);
            heads.insert(h);
        }
    }
    (layers.into_iter().collect(), heads.into_iter().collect())
}

type CellMap = BTreeMap<(u32, u32, Option<u32>), f64>;

fn cell_map(d: &ExperimentData, model: &str, metric: &str, kind: HeadKind) -> CellMap {
    d.find(model, metric)
        .filter(|r| r.head_kind == Some(kind))
        .filter_map(|r| Some(((r.layer?, r.head?, r.phase), r.value)))
        .collect()
}

fn sym_range(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let m = values
        .filter(|v| v.is_finite())
        .fold(0.0f64, |a, v| a.max(v.abs()));
    (m > 0.0).then_some((-m, m))
}

/// Layer x head heatmap of `metric` at `phase` (None = pooled rows); `diverging` for
/// signed effects (centred at 0), sequential otherwise.
#[allow(clippy::too_many_arguments)]
fn layer_head_heatmap(
    out: &Path,
    cells: &CellMap,
    layers: &[u32],
    heads: &[u32],
    phase: Option<u32>,
    title: String,
    colorbar: &str,
    range: Option<(f64, f64)>,
    head_label: &str,
    diverging: bool,
) -> Result<FigureFiles> {
    let matrix = layers
        .iter()
        .map(|&l| {
            heads
                .iter()
                .map(|&h| cells.get(&(l, h, phase)).copied().unwrap_or(f64::NAN))
                .collect()
        })
        .collect();
    let spec = HeatmapSpec {
        matrix,
        row_labels: layers.iter().map(|l| format!("L{l}")).collect(),
        col_labels: heads.iter().map(|h| format!("{head_label}{h}")).collect(),
        title,
        x_label: if head_label == "KV" {
            "KV head".into()
        } else {
            "query head".into()
        },
        y_label: "layer".into(),
        colorbar_label: colorbar.to_string(),
        diverging,
        range,
        annotate: true,
        size: None,
    };
    Ok(heatmap(out, &spec)?)
}

/// Rows = heads (`L{l}H{h}` / `L{l}KV{g}`), columns = phases.
fn head_phase_map(
    out: &Path,
    d: &ExperimentData,
    model: &str,
    metric: &str,
    phases: &[u32],
    title: String,
    colorbar: &str,
) -> Result<Option<FigureFiles>> {
    let mut row_labels = Vec::new();
    let mut matrix = Vec::new();
    for (kind, tag) in [(HeadKind::Query, "H"), (HeadKind::Kv, "KV")] {
        let cells = cell_map(d, model, metric, kind);
        let (layers, heads) = head_axes(d, model, metric, kind);
        for &l in &layers {
            for &h in &heads {
                if !cells.contains_key(&(l, h, None))
                    && !phases.iter().any(|&p| cells.contains_key(&(l, h, Some(p))))
                {
                    continue;
                }
                row_labels.push(format!("L{l}{tag}{h}"));
                matrix.push(
                    phases
                        .iter()
                        .map(|&p| cells.get(&(l, h, Some(p))).copied().unwrap_or(f64::NAN))
                        .collect::<Vec<f64>>(),
                );
            }
        }
    }
    if matrix.is_empty() {
        return Ok(None);
    }
    let spec = HeatmapSpec {
        matrix,
        row_labels,
        col_labels: phases.iter().map(|p| format!("{p}")).collect(),
        title,
        x_label: "source phase (t_K mod P)".into(),
        y_label: "head (layer, query head H / KV head KV)".into(),
        colorbar_label: colorbar.to_string(),
        diverging: true,
        range: None,
        annotate: true,
        size: None,
    };
    Ok(Some(heatmap(out, &spec)?))
}

/// Rows = layers, columns = (KV head, phase): the paper's Figure 3 layout.
fn layer_kv_phase_map(
    out: &Path,
    d: &ExperimentData,
    model: &str,
    metric: &str,
    phases: &[u32],
    title: String,
    colorbar: &str,
) -> Result<Option<FigureFiles>> {
    let cells = cell_map(d, model, metric, HeadKind::Kv);
    let (layers, heads) = head_axes(d, model, metric, HeadKind::Kv);
    if layers.is_empty() {
        return Ok(None);
    }
    let mut col_labels = Vec::new();
    for &h in &heads {
        for &p in phases {
            col_labels.push(if heads.len() > 1 {
                format!("KV{h} r{p}")
            } else {
                format!("{p}")
            });
        }
    }
    let matrix = layers
        .iter()
        .map(|&l| {
            heads
                .iter()
                .flat_map(|&h| phases.iter().map(move |&p| (h, p)))
                .map(|(h, p)| cells.get(&(l, h, Some(p))).copied().unwrap_or(f64::NAN))
                .collect()
        })
        .collect();
    let spec = HeatmapSpec {
        matrix,
        row_labels: layers.iter().map(|l| format!("L{l}")).collect(),
        col_labels,
        title,
        x_label: if heads.len() > 1 {
            "KV head and source phase".into()
        } else {
            "source phase (t_K mod P)".into()
        },
        y_label: "layer".into(),
        colorbar_label: colorbar.to_string(),
        diverging: true,
        range: None,
        annotate: true,
        size: None,
    };
    Ok(Some(heatmap(out, &spec)?))
}

fn spec_index_heatmap(
    out: &Path,
    d: &ExperimentData,
    model: &str,
    title: String,
) -> Result<Option<FigureFiles>> {
    let cells = cell_map(d, model, "specialization", HeadKind::Query);
    let (layers, heads) = head_axes(d, model, "specialization", HeadKind::Query);
    let (cells, layers, heads, label) = if layers.is_empty() {
        let (l, h) = head_axes(d, model, "specialization", HeadKind::Kv);
        (
            cell_map(d, model, "specialization", HeadKind::Kv),
            l,
            h,
            "KV",
        )
    } else {
        (cells, layers, heads, "H")
    };
    if layers.is_empty() {
        return Ok(None);
    }
    layer_head_heatmap(
        out,
        &cells,
        &layers,
        &heads,
        None,
        title,
        "specialization S = 1 - (exp(H) - 1)/(P - 1)",
        Some((0.0, 1.0)),
        label,
        false,
    )
    .map(Some)
}

/// A head's identity in rankings.
#[derive(Debug, Clone, PartialEq)]
struct HeadId(u32, u32, HeadKind);

impl std::fmt::Display for HeadId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.2 {
            HeadKind::Query => write!(f, "L{}.H{}", self.0, self.1),
            HeadKind::Kv => write!(f, "L{}.KV{}", self.0, self.1),
        }
    }
}

/// Rank heads by specialization of `effect(value)` of `metric` over phases.
fn ranking(
    d: &ExperimentData,
    model: &str,
    metric: &str,
    phases: &[u32],
    effect: impl Fn(f64) -> f64,
) -> Vec<RankedHead<HeadId>> {
    let mut profiles = Vec::new();
    for kind in [HeadKind::Query, HeadKind::Kv] {
        let cells = cell_map(d, model, metric, kind);
        let (layers, heads) = head_axes(d, model, metric, kind);
        for &l in &layers {
            for &h in &heads {
                let prof: Vec<f64> = phases
                    .iter()
                    .map(|&p| {
                        cells
                            .get(&(l, h, Some(p)))
                            .copied()
                            .map(&effect)
                            .unwrap_or(0.0)
                    })
                    .map(|v| if v.is_finite() { v } else { 0.0 })
                    .collect();
                profiles.push((HeadId(l, h, kind), prof));
            }
        }
    }
    if phases.len() < 2 || profiles.is_empty() {
        return Vec::new();
    }
    // Heads whose total positive effect is under 5% of the largest are not ranked:
    // a tiny effect on one phase is not a specialization (units differ by metric).
    let totals: Vec<f64> = profiles
        .iter()
        .map(|(_, p)| p.iter().map(|v| v.max(0.0)).sum::<f64>())
        .collect();
    let max = totals.iter().copied().fold(0.0, f64::max);
    rank_specialized(&profiles, 10, 0.05 * max).unwrap_or_default()
}

/// Draw every figure and write `report.md` + `report.html` for the tables in `data_dir`.
pub fn draw_experiment(data_dir: &Path, report_dir: &Path) -> Result<Vec<PathBuf>> {
    let d = ExperimentData::load(data_dir)?;
    std::fs::create_dir_all(report_dir).map_err(|e| Error::io(report_dir, e))?;
    let exp = d.experiment();
    let mut files = Vec::new();
    let mut report = Report::new(format!("{}: {}", d.name, d.kind));
    if let Some(e) = &exp
        && !e.file.experiment.description.is_empty()
    {
        report.paragraph(e.file.experiment.description.clone());
    }
    let models = d.models();
    report.paragraph(format!(
        "Kind `{}` on {}. Tables: {}.",
        d.kind,
        models
            .iter()
            .map(|m| format!("`{m}`"))
            .collect::<Vec<_>>()
            .join(", "),
        d.tables
            .iter()
            .filter_map(|p| p.file_name())
            .map(|s| format!("`{}`", s.to_string_lossy()))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let out = |name: &str| report_dir.join(name);
    match d.kind {
        Kind::PhaseSweep => {
            for m in &models {
                report.section(format!("Model `{m}`"));
                let mut series = Vec::new();
                for (sfx, label) in [
                    ("_prefix", "prefix padding"),
                    ("_in_sequence", "in-sequence padding"),
                ] {
                    if d.has(m, &format!("accuracy{sfx}")) {
                        report.headlines(baseline_headlines(&d, m, sfx, &format!("{label}: ")));
                        series.push((label, format!("accuracy{sfx}")));
                    }
                }
                if let Some(f) = accuracy_figure(
                    &out(&format!("accuracy_{m}")),
                    &d,
                    m,
                    &series,
                    &format!("{m}: top-1 accuracy by phase group"),
                )? {
                    push(
                        &mut files,
                        &mut report,
                        &format!("{m}: accuracy by phase group, 95% cluster-bootstrap bands"),
                        f,
                    );
                }
            }
        }
        kind => {
            let m = models.first().cloned().unwrap_or_default();
            report.section("Headline numbers");
            report.headlines(baseline_headlines(&d, &m, "", ""));
            let phases = d.phases(&m, "accuracy");
            let mut acc_series = vec![("clean", "accuracy".to_string())];
            if kind == Kind::PatchHeads {
                acc_series.push((
                    "corrupted (answer = the replaced value)",
                    "accuracy_corrupted".into(),
                ));
            }
            if let Some(f) = accuracy_figure(
                &out("accuracy_by_phase"),
                &d,
                &m,
                &acc_series,
                &format!("{m}: top-1 accuracy by phase"),
            )? {
                push(
                    &mut files,
                    &mut report,
                    "Top-1 accuracy by phase of the target key, 95% cluster-bootstrap bands",
                    f,
                );
            }
            match kind {
                Kind::PatchHeads => draw_patch(
                    &d,
                    exp.as_ref(),
                    &m,
                    &phases,
                    report_dir,
                    &mut report,
                    &mut files,
                )?,
                Kind::AblateHeads => draw_ablate(
                    &d,
                    exp.as_ref(),
                    &m,
                    &phases,
                    report_dir,
                    &mut report,
                    &mut files,
                )?,
                Kind::Knockout => {
                    draw_knockout(&d, &m, &phases, report_dir, &mut report, &mut files)?
                }
                Kind::GateProfiles => draw_gates(&d, &m, report_dir, &mut report, &mut files)?,
                Kind::GateCycling => draw_cycling(
                    &d,
                    exp.as_ref(),
                    &m,
                    &phases,
                    report_dir,
                    &mut report,
                    &mut files,
                )?,
                Kind::PhaseSweep => unreachable!(),
            }
        }
    }
    report.section("Reading the tables");
    let first = d
        .tables
        .first()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    report.code(
        "python",
        format!(
            "import polars as pl\ndf = pl.read_ipc(\"{first}\")  # or pl.read_parquet(...) on the .parquet copy\nprint(df.filter(pl.col(\"metric\") == \"accuracy\"))"
        ),
    );
    if !d.notes.is_empty() {
        report.section("Notes");
        for n in &d.notes {
            report.paragraph(n.clone());
        }
    }
    report.section("Experiment");
    report.code("toml", d.toml.clone());
    let rf = report.write(report_dir)?;
    files.push(rf.markdown);
    files.push(rf.html);
    Ok(files)
}

fn ranked_table(report: &mut Report, caption: &str, ranked: &[RankedHead<HeadId>]) {
    if ranked.is_empty() {
        report.paragraph("No head has a positive effect large enough to rank.");
        return;
    }
    let (header, rows) = ranked_heads_rows(ranked);
    report.table(caption, header, rows);
}

fn draw_patch(
    d: &ExperimentData,
    exp: Option<&Experiment>,
    m: &str,
    phases: &[u32],
    dir: &Path,
    report: &mut Report,
    files: &mut Vec<PathBuf>,
) -> Result<()> {
    let directions: Vec<Direction> = exp
        .and_then(|e| e.file.patch.clone())
        .unwrap_or_default()
        .directions;
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

fn draw_ablate(
    d: &ExperimentData,
    exp: Option<&Experiment>,
    m: &str,
    phases: &[u32],
    dir: &Path,
    report: &mut Report,
    files: &mut Vec<PathBuf>,
) -> Result<()> {
    let methods: Vec<Method> = exp
        .and_then(|e| e.file.ablate.clone())
        .unwrap_or_default()
        .methods;
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

fn draw_knockout(
    d: &ExperimentData,
    m: &str,
    phases: &[u32],
    dir: &Path,
    report: &mut Report,
    files: &mut Vec<PathBuf>,
) -> Result<()> {
    report.section("KV-head knockout");
    report.paragraph(
        "Relative change of top-1 accuracy, 100 x (knockout - clean) / clean, when one KV head of one \
         layer is removed (every query head reading it), per source phase.",
    );
    if let Some((k, v)) = cell_map(d, m, "rel_change_pct", HeadKind::Kv)
        .iter()
        .filter(|((_, _, p), v)| p.is_none() && v.is_finite())
        .min_by(|a, b| a.1.total_cmp(b.1))
    {
        report.headline(
            Headline::new(
                "Most damaging KV-head knockout (all phases)",
                format!("L{}.KV{}", k.0, k.1),
            )
            .with_detail(format!("{v:.1}% relative change")),
        );
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
    let rows: Vec<&LongRow> = d
        .find(m, "layer_out_rel_change_pct")
        .filter(|r| r.head.is_none() && r.layer.is_some())
        .collect();
    if !rows.is_empty() {
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
    }
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

fn draw_gates(
    d: &ExperimentData,
    m: &str,
    dir: &Path,
    report: &mut Report,
    files: &mut Vec<PathBuf>,
) -> Result<()> {
    report.section("Gate profiles");
    report.paragraph(
        "g(r) = W x E[a][r], the mean gate weight at offset r relative to the uniform share (1 = uniform); \
         exp(H(E[a])) = offsets the mean gate uses; E[exp(H(a))] = offsets a single window uses.",
    );
    // Gate rows: (layer, kv, gate) -> g per offset.
    let mut profiles: BTreeMap<(u32, u32, &str), BTreeMap<u32, f64>> = BTreeMap::new();
    for g in ["key", "value"] {
        for r in d.find(m, &format!("{g}_gate_g")) {
            if let (Some(l), Some(h), Some(o)) = (r.layer, r.head, r.phase) {
                profiles.entry((l, h, g)).or_default().insert(o, r.value);
            }
        }
    }
    if profiles.is_empty() {
        return Ok(());
    }
    let w = profiles.values().map(|p| p.len()).max().unwrap_or(0) as u32;
    if let Some(((l, h, g), prof)) = profiles.iter().max_by(|a, b| {
        let ma = a.1.values().copied().fold(0.0, f64::max);
        let mb = b.1.values().copied().fold(0.0, f64::max);
        ma.total_cmp(&mb)
    }) {
        let (o, v) = prof
            .iter()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(o, v)| (*o, *v))
            .unwrap_or((0, f64::NAN));
        report.headline(
            Headline::new(
                "Most peaked gate",
                format!("layer {l}, KV head {h}, {g} gate"),
            )
            .with_detail(format!("g({o}) = {v:.2} (1 = uniform)")),
        );
    }
    let spec = HeatmapSpec {
        matrix: profiles
            .values()
            .map(|p| {
                (0..w)
                    .map(|o| p.get(&o).copied().unwrap_or(f64::NAN))
                    .collect()
            })
            .collect(),
        row_labels: profiles
            .keys()
            .map(|(l, h, g)| format!("L{l} KV{h} {g}"))
            .collect(),
        col_labels: (0..w).map(|o| o.to_string()).collect(),
        title: format!("{m}: gate profile g(r) per layer, KV head and gate"),
        x_label: "offset r in the window".into(),
        y_label: "layer, KV head, gate".into(),
        colorbar_label: "g(r) (1 = uniform share)".into(),
        diverging: false,
        range: None,
        annotate: true,
        size: None,
    };
    let f = heatmap(dir.join("gate_g"), &spec)?;
    push(files, report, "Gate profiles g(r)", f);
    for ((l, h, g), prof) in profiles.iter().take(8) {
        let spec = BarProfileSpec {
            labels: (0..w).map(|o| o.to_string()).collect(),
            values: (0..w)
                .map(|o| prof.get(&o).copied().unwrap_or(f64::NAN))
                .collect(),
            title: format!("{m}: layer {l}, KV head {h}, {g} gate"),
            x_label: "offset r in the window".into(),
            y_label: "g(r)".into(),
            reference: Some(1.0),
            reference_label: Some("uniform share".into()),
            size: None,
        };
        let f = bar_profile(dir.join(format!("gate_profile_L{l}_KV{h}_{g}")), &spec)?;
        push(
            files,
            report,
            &format!("g(r), layer {l}, KV head {h}, {g} gate"),
            f,
        );
    }
    // Effective numbers of offsets.
    let metrics = [
        ("key_gate_exp_entropy_of_mean", "key exp(H(E[a]))"),
        ("key_gate_mean_exp_entropy", "key E[exp(H(a))]"),
        ("value_gate_exp_entropy_of_mean", "value exp(H(E[a]))"),
        ("value_gate_mean_exp_entropy", "value E[exp(H(a))]"),
    ];
    let keys: BTreeSet<(u32, u32)> = profiles.keys().map(|(l, h, _)| (*l, *h)).collect();
    let val = |metric: &str, model: &str, l: u32, h: u32| {
        d.find(model, metric)
            .find(|r| r.layer == Some(l) && r.head == Some(h) && r.phase.is_none())
            .map_or(f64::NAN, |r| r.value)
    };
    let spec = HeatmapSpec {
        matrix: keys
            .iter()
            .map(|&(l, h)| metrics.iter().map(|(mt, _)| val(mt, m, l, h)).collect())
            .collect(),
        row_labels: keys.iter().map(|(l, h)| format!("L{l} KV{h}")).collect(),
        col_labels: metrics.iter().map(|(_, n)| n.to_string()).collect(),
        title: format!("{m}: effective number of offsets"),
        x_label: "statistic".into(),
        y_label: "layer, KV head".into(),
        colorbar_label: format!("effective offsets (1..{w})"),
        diverging: false,
        range: Some((1.0, f64::from(w.max(2)))),
        annotate: true,
        size: None,
    };
    let f = heatmap(dir.join("gate_entropy"), &spec)?;
    push(files, report, "Effective number of offsets per gate", f);
    // Trajectories over checkpoints.
    let mut steps: Vec<(u64, String)> = d
        .rows
        .iter()
        .filter_map(|r| {
            let (base, step) = r.model.split_once('@')?;
            (base == m).then(|| step.parse::<u64>().ok().map(|s| (s, r.model.clone())))?
        })
        .collect();
    steps.sort();
    steps.dedup();
    if !steps.is_empty() {
        let mut series = Vec::new();
        for &(l, h) in keys.iter().take(8) {
            for g in ["key", "value"] {
                let metric = format!("{g}_gate_exp_entropy_of_mean");
                let x: Vec<f64> = steps.iter().map(|(s, _)| *s as f64).collect();
                let y: Vec<f64> = steps
                    .iter()
                    .map(|(_, model)| val(&metric, model, l, h))
                    .collect();
                series.push(BandSeries {
                    name: format!("L{l} KV{h} {g}"),
                    lo: y.clone(),
                    hi: y.clone(),
                    x,
                    y,
                });
            }
        }
        let spec = LinePlotSpec {
            series,
            title: format!("{m}: exp(H(E[a])) over training"),
            x_label: "training step".into(),
            y_label: "effective offsets of the mean gate".into(),
            y_range: Some((1.0, f64::from(w.max(2)))),
            size: None,
        };
        let f = line_with_bands(dir.join("gate_trajectory"), &spec)?;
        push(files, report, "Gate sharpness over training checkpoints", f);
    }
    Ok(())
}

fn draw_cycling(
    d: &ExperimentData,
    exp: Option<&Experiment>,
    m: &str,
    phases: &[u32],
    dir: &Path,
    report: &mut Report,
    files: &mut Vec<PathBuf>,
) -> Result<()> {
    let deltas = exp
        .and_then(|e| e.file.cycling.clone())
        .unwrap_or_default()
        .deltas;
    report.section("Gate cycling");
    report.paragraph(
        "The learned gates of the selected layers are rolled by delta offsets. Prediction: the baseline \
         accuracy profile shifted by delta, predicted(r) = acc(r - delta). R^2 (of the prediction itself, \
         no fitted slope) and MAE with 95% cluster-bootstrap intervals. R^2 divides by the spread of \
         the observed profile: when shifted gates flatten the profile (e.g. the model fails at every \
         phase) it is undefined or hugely negative, and MAE is the number to read.",
    );
    let fmt_ci = |r: &LongRow| ci_text(r, |v| format!("{v:.3}"));
    for (metric, label) in [
        ("cycling_r2", "R^2 (all shifts)"),
        ("cycling_mae", "MAE (all shifts)"),
    ] {
        if let Some(r) = d.scalar(m, metric) {
            report.headline(Headline::new(label, format!("{:.3}", r.value)).with_detail(fmt_ci(r)));
        }
    }
    let mut rows_tbl = Vec::new();
    let mut series = Vec::new();
    let mut lines = vec![("baseline".to_string(), "accuracy".to_string())];
    for &dl in &deltas {
        let sfx = delta_suffix(dl);
        let pred: BTreeMap<u32, f64> = d
            .find(m, &format!("cycling_predicted{sfx}"))
            .filter_map(|r| Some((r.phase?, r.value)))
            .collect();
        let obs: BTreeMap<u32, f64> = d
            .find(m, &format!("cycling_observed{sfx}"))
            .filter_map(|r| Some((r.phase?, r.value)))
            .collect();
        if obs.is_empty() {
            continue;
        }
        series.push(ScatterSeries {
            name: format!("delta {dl:+}"),
            predicted: phases
                .iter()
                .map(|p| pred.get(p).copied().unwrap_or(f64::NAN))
                .collect(),
            observed: phases
                .iter()
                .map(|p| obs.get(p).copied().unwrap_or(f64::NAN))
                .collect(),
        });
        lines.push((
            format!("observed, delta {dl:+}"),
            format!("cycling_observed{sfx}"),
        ));
        let r2 = d.scalar(m, &format!("cycling_r2{sfx}"));
        let mae = d.scalar(m, &format!("cycling_mae{sfx}"));
        rows_tbl.push(vec![
            format!("{dl:+}"),
            r2.map_or("n/a".into(), |r| format!("{:.3}", r.value)),
            r2.map_or(String::new(), fmt_ci),
            mae.map_or("n/a".into(), |r| format!("{:.3}", r.value)),
            mae.map_or(String::new(), fmt_ci),
        ]);
    }
    if !rows_tbl.is_empty() {
        report.table(
            "Agreement per shift",
            ["delta", "R^2", "R^2 CI", "MAE", "MAE CI"]
                .map(String::from)
                .to_vec(),
            rows_tbl,
        );
    }
    if !series.is_empty() {
        let r2_text = match (d.scalar(m, "cycling_r2"), d.scalar(m, "cycling_mae")) {
            (Some(a), Some(b)) => {
                let ci = |r: &LongRow| match (r.ci_lo, r.ci_hi) {
                    (Some(lo), Some(hi)) => format!(" [{lo:.3}, {hi:.3}]"),
                    _ => String::new(),
                };
                Some(format!(
                    "R² = {:.3}{}, MAE = {:.3}{}",
                    a.value,
                    ci(a),
                    b.value,
                    ci(b)
                ))
            }
            _ => None,
        };
        let spec = ScatterSpec {
            series,
            title: format!("{m}: gate cycling"),
            x_label: "predicted accuracy (baseline shifted by delta)".into(),
            y_label: "observed accuracy with rolled gates".into(),
            r2_text,
            size: None,
        };
        let f = scatter_predicted_vs_observed(dir.join("cycling_scatter"), &spec)?;
        push(
            files,
            report,
            "Predicted vs observed per-phase accuracy, one point per phase and shift",
            f,
        );
    }
    let series: Vec<(&str, String)> = lines.iter().map(|(a, b)| (a.as_str(), b.clone())).collect();
    if let Some(f) = accuracy_figure(
        &dir.join("cycling_profiles"),
        d,
        m,
        &series,
        &format!("{m}: accuracy by phase with rolled gates"),
    )? {
        push(files, report, "Accuracy profiles with rolled gates", f);
    }
    Ok(())
}
