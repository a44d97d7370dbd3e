//! The report frame shared by every kind, and the figure helpers kinds draw with.
//! Everything is drawn from an experiment's tables alone
//! (`notebooks-data/<experiment>/*.arrow`), so `phaselens figures` redraws it without a
//! model. Each kind draws its own figures and report section ([`Kind::figures`](crate::runner::Kind::figures),
//! in its file under `runner/kinds/`); docs/experiments.md lists them.
//!
//! A report: title, description, summary, the kind's body ([`Kind::report`](crate::runner::Kind::report): by default
//! the headline numbers, `accuracy_by_phase` and the kind's figures), how to read the
//! tables, notes, and the experiment TOML stored in the tables.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::analysis::{RankedHead, rank_specialized};
use crate::error::{Error, Result};
use crate::output::{
    BandSeries, FigureFiles, HeadKind, Headline, HeatmapSpec, LinePlotSpec, LongRow,
    META_EXPERIMENT_TOML, META_SCHEMA, Report, ScatterSeries, Table, committed_files, heatmap,
    line_with_bands, ranked_heads_rows, read_long_rows,
};

use super::experiment::Experiment;
use super::kinds::KindConfig;
use super::{META_KIND, META_NOTES};

/// The long tables of one experiment folder.
#[derive(Debug, Clone)]
pub struct ExperimentData {
    pub name: String,
    /// The kind's settings: from the experiment TOML stored in the tables, or the
    /// kind's defaults when that does not parse.
    pub kind: KindConfig,
    pub rows: Vec<LongRow>,
    pub toml: String,
    pub notes: Vec<String>,
    pub tables: Vec<PathBuf>,
}

impl ExperimentData {
    /// Read every long table (`*.arrow`, schema `long/v1`) directly under `dir`.
    pub fn load(dir: &Path) -> Result<Self> {
        // Committed tables only: never the temporary file of an interrupted write.
        if !dir.is_dir() {
            return Err(Error::io(
                dir,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such folder"),
            ));
        }
        let paths = committed_files(dir, "arrow").map_err(|e| Error::io(dir, e))?;
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
                kind = KindConfig::named(k);
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
            .or_else(|| rows.first().and_then(|r| KindConfig::named(&r.kind)))
            .ok_or_else(|| Error::Other(format!("{}: unknown experiment kind", dir.display())))?;
        let kind = match Experiment::parse(Path::new("experiment.toml"), toml.clone()) {
            Ok(e) if e.kind().name() == kind.kind().name() => e.file.kind,
            _ => kind,
        };
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

    pub fn find(&self, model: &str, metric: &str) -> impl Iterator<Item = &LongRow> {
        let (model, metric) = (model.to_string(), metric.to_string());
        self.rows
            .iter()
            .filter(move |r| r.model == model && r.metric == metric)
    }

    pub fn has(&self, model: &str, metric: &str) -> bool {
        self.find(model, metric).next().is_some()
    }

    /// The whole-model row of `metric` (no layer, head or phase).
    pub fn scalar(&self, model: &str, metric: &str) -> Option<&LongRow> {
        self.find(model, metric)
            .find(|r| r.layer.is_none() && r.head.is_none() && r.phase.is_none())
    }

    /// Phases present in `metric`'s per-phase whole-model rows, sorted.
    pub fn phases(&self, model: &str, metric: &str) -> Vec<u32> {
        let s: BTreeSet<u32> = self.find(model, metric).filter_map(|r| r.phase).collect();
        s.into_iter().collect()
    }
}

/// Whether `dir` holds a long-format table written by the runner (other folders under
/// `notebooks-data/`, e.g. training loss curves, are not experiments).
fn has_long_table(dir: &Path) -> bool {
    committed_files(dir, "arrow").is_ok_and(|paths| {
        paths.iter().any(|p| {
            Table::read_arrow(p).is_ok_and(|t| {
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
    if let Some(n) = only {
        crate::output::check_output_name(n)
            .map_err(|m| Error::Input(format!("--experiment: {m}")))?;
    }
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
        let report_dir = reports_root.join(&n);
        crate::output::clean_stale_temps(&report_dir, 1).map_err(|e| Error::io(&report_dir, e))?;
        let files = draw_experiment(&dir, &report_dir)?;
        out.push((n, files));
    }
    Ok(out)
}

pub(crate) fn push(files: &mut Vec<PathBuf>, report: &mut Report, caption: &str, f: FigureFiles) {
    report.figure_files(caption, &f);
    files.push(f.png);
    files.push(f.svg);
}

pub(crate) fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:.1}%", 100.0 * x)
    } else {
        "n/a".into()
    }
}

pub(crate) fn ci_text(r: &LongRow, f: impl Fn(f64) -> String) -> String {
    match (r.ci_lo, r.ci_hi) {
        (Some(lo), Some(hi)) => format!("95% CI [{}, {}]", f(lo), f(hi)),
        _ => String::new(),
    }
}

/// Headline numbers from the baseline rows (`accuracy{suffix}`, `mean_accuracy{suffix}`, ...).
pub(crate) fn baseline_headlines(
    d: &ExperimentData,
    model: &str,
    suffix: &str,
    label: &str,
) -> Vec<Headline> {
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

pub(crate) fn band_series(
    d: &ExperimentData,
    model: &str,
    metric: &str,
    name: &str,
) -> Option<BandSeries> {
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

pub(crate) fn accuracy_figure(
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
pub(crate) fn head_axes(
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

pub(crate) type CellMap = BTreeMap<(u32, u32, Option<u32>), f64>;

pub(crate) fn cell_map(d: &ExperimentData, model: &str, metric: &str, kind: HeadKind) -> CellMap {
    d.find(model, metric)
        .filter(|r| r.head_kind == Some(kind))
        .filter_map(|r| Some(((r.layer?, r.head?, r.phase), r.value)))
        .collect()
}

/// A scatter series of `estimated` against `observed` over the per-phase cells both
/// maps hold (pooled cells left out); `None` when they share none.
pub(crate) fn paired_series(
    name: String,
    estimated: &CellMap,
    observed: &CellMap,
) -> Option<ScatterSeries> {
    let (predicted, observed): (Vec<f64>, Vec<f64>) = estimated
        .iter()
        .filter(|((_, _, ph), _)| ph.is_some())
        .filter_map(|(k, v)| observed.get(k).map(|o| (*v, *o)))
        .unzip();
    (!predicted.is_empty()).then_some(ScatterSeries {
        name,
        predicted,
        observed,
    })
}

pub(crate) fn sym_range(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let m = values
        .filter(|v| v.is_finite())
        .fold(0.0f64, |a, v| a.max(v.abs()));
    (m > 0.0).then_some((-m, m))
}

/// A layer x head grid of one metric's cells (`(layer, head, phase)` -> value) with its
/// axes; `head_label` is `H` for query heads, `KV` for KV heads.
pub(crate) struct HeadGrid<'a> {
    pub cells: &'a CellMap,
    pub layers: &'a [u32],
    pub heads: &'a [u32],
    pub head_label: &'a str,
}

/// A heatmap's colour scale: the colour bar's label, its range (None = the data's) and
/// whether it diverges (signed effects, centred at 0) or is sequential.
pub(crate) struct ColourScale<'a> {
    pub label: &'a str,
    pub range: Option<(f64, f64)>,
    pub diverging: bool,
}

/// Layer x head heatmap of the grid's cells at `phase` (None = pooled rows).
pub(crate) fn layer_head_heatmap(
    out: &Path,
    grid: &HeadGrid,
    phase: Option<u32>,
    title: String,
    scale: &ColourScale,
) -> Result<FigureFiles> {
    let HeadGrid {
        cells,
        layers,
        heads,
        head_label,
    } = *grid;
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
        colorbar_label: scale.label.to_string(),
        diverging: scale.diverging,
        range: scale.range,
        annotate: true,
        size: None,
    };
    Ok(heatmap(out, &spec)?)
}

/// Rows = heads (`L{l}H{h}` / `L{l}KV{g}`), columns = phases.
pub(crate) fn head_phase_map(
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
pub(crate) fn layer_kv_phase_map(
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

pub(crate) fn spec_index_heatmap(
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
        &HeadGrid {
            cells: &cells,
            layers: &layers,
            heads: &heads,
            head_label: label,
        },
        None,
        title,
        &ColourScale {
            label: "specialization S = 1 - (exp(H) - 1)/(P - 1)",
            range: Some((0.0, 1.0)),
            diverging: false,
        },
    )
    .map(Some)
}

/// A head's identity in rankings.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HeadId(pub u32, pub u32, pub HeadKind);

impl std::fmt::Display for HeadId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.2 {
            HeadKind::Query => write!(f, "L{}.H{}", self.0, self.1),
            HeadKind::Kv => write!(f, "L{}.KV{}", self.0, self.1),
        }
    }
}

/// Rank heads by specialization of `effect(value)` of `metric` over phases.
pub(crate) fn ranking(
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

/// What a kind draws into: the data, the model and phases of its figures, the report
/// and the files written so far.
pub struct Figures<'a> {
    pub data: &'a ExperimentData,
    /// Models of the tables (without `@step` checkpoints), in first-seen order.
    pub models: Vec<String>,
    /// The first model: the one single-model kinds draw.
    pub model: String,
    /// Phases of the first model's per-phase `accuracy` rows.
    pub phases: Vec<u32>,
    /// `reports/<experiment>`.
    pub dir: &'a Path,
    pub report: Report,
    pub files: Vec<PathBuf>,
}

impl Figures<'_> {
    /// Embed `f` in the report under `caption` and list its files.
    pub fn push(&mut self, caption: &str, f: FigureFiles) {
        push(&mut self.files, &mut self.report, caption, f);
    }

    /// "Headline numbers" and the `accuracy_by_phase` figure of `series` (legend, metric).
    pub fn headlines_and_accuracy(&mut self, series: &[(&str, String)]) -> Result<()> {
        let (d, m) = (self.data, self.model.clone());
        self.report.section("Headline numbers");
        self.report.headlines(baseline_headlines(d, &m, "", ""));
        if let Some(f) = accuracy_figure(
            &self.dir.join("accuracy_by_phase"),
            d,
            &m,
            series,
            &format!("{m}: top-1 accuracy by phase"),
        )? {
            self.push(
                "Top-1 accuracy by phase of the target key, 95% cluster-bootstrap bands",
                f,
            );
        }
        Ok(())
    }
}

/// Draw every figure and write `report.md` + `report.html` for the tables in `data_dir`.
pub fn draw_experiment(data_dir: &Path, report_dir: &Path) -> Result<Vec<PathBuf>> {
    let d = ExperimentData::load(data_dir)?;
    std::fs::create_dir_all(report_dir).map_err(|e| Error::io(report_dir, e))?;
    let kind = d.kind.kind();
    let mut report = Report::new(format!("{}: {}", d.name, kind.name()));
    if let Ok(e) = Experiment::parse(Path::new("experiment.toml"), d.toml.clone())
        && !e.file.experiment.description.is_empty()
    {
        report.paragraph(e.file.experiment.description.clone());
    }
    let models = d.models();
    report.paragraph(format!(
        "Kind `{}` on {}. Tables: {}.",
        kind.name(),
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
    let model = models.first().cloned().unwrap_or_default();
    let mut f = Figures {
        data: &d,
        phases: d.phases(&model, "accuracy"),
        model,
        models,
        dir: report_dir,
        report,
        files: Vec::new(),
    };
    kind.report(&mut f)?;
    let (mut report, mut files) = (f.report, f.files);
    closing_sections(&mut report, &d);
    let rf = report.write(report_dir)?;
    files.push(rf.markdown);
    files.push(rf.html);
    Ok(files)
}

/// "Reading the tables", the notes and the stored experiment TOML.
fn closing_sections(report: &mut Report, d: &ExperimentData) {
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
}

pub(crate) fn ranked_table(report: &mut Report, caption: &str, ranked: &[RankedHead<HeadId>]) {
    if ranked.is_empty() {
        report.paragraph("No head has a positive effect large enough to rank.");
        return;
    }
    let (header, rows) = ranked_heads_rows(ranked);
    report.table(caption, header, rows);
}
