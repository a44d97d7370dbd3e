//! Merge every design's phase sweeps into two long tables (polars) and read them back
//! as the rows ([`super::merged`]) that the figures and the report draw from.
//!
//! - `grid.arrow` (+ `.parquet`): one row per design x sweep x protocol x phase, with
//!   the `phase_accuracy/v1` columns (`protocol, phase, n, correct, accuracy,
//!   wilson_lo, wilson_hi`), the sweep (`eval`, `n_bindings`, `query_slot`) and one
//!   column per design key (`W`, `S`, `kv_heads`, `seed`, ...: every key some design
//!   sets, read from the design's recipe).
//! - `grid_summary.arrow` (+ `.parquet`): one row per design x sweep x protocol: mean
//!   accuracy and phase gap with their cluster-bootstrap CIs (from the sweep's
//!   `summary.json`), worst and best phase, the phase period, training steps and
//!   final batch accuracy (`phase_period`, `train_steps`, `final_batch_accuracy`, so
//!   that no table column has the name of a key alias such as `period` or `steps`).
//! - `grid_frontier.arrow` (+ `.parquet`): the designs pooled over seeds, gap against
//!   mean accuracy with CIs and the gate's verdict ([`super::frontier`]).
//!
//! Resumable: each design's part is cached in `<data>/<design>/part*.arrow` with the
//! sizes and modification times of its inputs, and rebuilt only when those change.
//! Designs without a finished sweep are not an error: the report lists them as not
//! trained (with their training step) or not swept, and the tables and figures hold
//! the designs that have one.

use std::fmt;
use std::path::{Path, PathBuf};

use polars::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::output::{
    ColumnData, Table, TableError, read_dataframe, write_bytes_atomic, write_parquet_copy,
};

use super::merged::{Merged, PhaseRow, SummaryRow};
use super::spec::{Design, Grid};
use super::task::{DesignRecord, EvalSpec, GridOptions, eval_specs};

/// Schema id of `grid.arrow`.
pub const GRID_SCHEMA: &str = "grid_phase_accuracy/v1";
/// Schema id of `grid_summary.arrow`.
pub const SUMMARY_SCHEMA: &str = "grid_summary/v1";

/// What a merge wrote.
#[derive(Debug, Clone)]
pub struct MergeSummary {
    /// Designs with at least one finished sweep, merged.
    pub merged: Vec<String>,
    /// Designs with no finished sweep yet, with how far they got (`not trained (step
    /// 750/2000)`, `trained; sweeps 0/7`).
    pub missing: Vec<(String, String)>,
    /// The tables written.
    pub tables: Vec<PathBuf>,
    /// The figures drawn.
    pub figures: Vec<PathBuf>,
    /// The report (`report.md`), when written.
    pub report: Option<PathBuf>,
}

impl fmt::Display for MergeSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "merged {} design(s){}",
            self.merged.len(),
            if self.missing.is_empty() {
                String::new()
            } else {
                format!(
                    "; not in the tables yet: {} ({})",
                    self.missing.len(),
                    self.missing
                        .iter()
                        .map(|(d, p)| format!("{d}: {p}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        )?;
        for t in &self.tables {
            writeln!(f, "table: {}", t.display())?;
        }
        if let Some(r) = &self.report {
            writeln!(f, "report: {}", r.display())?;
        }
        Ok(())
    }
}

/// How far a design got, as the report and the merge say it.
pub fn progress_label(grid: &Grid, d: &Design, opts: &GridOptions) -> String {
    let p = super::slurm::design_progress(grid, d, opts);
    if p.starts_with("step ") || p == "not started" {
        format!("not trained ({p})")
    } else {
        p
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Fingerprint {
    inputs: Vec<(String, u64, u128)>,
    version: String,
}

fn fingerprint(paths: &[PathBuf]) -> Fingerprint {
    let inputs = paths
        .iter()
        .map(|p| {
            let m = std::fs::metadata(p).ok();
            let size = m.as_ref().map_or(0, |m| m.len());
            let mtime = m
                .and_then(|m| m.modified().ok())
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            (p.display().to_string(), size, mtime)
        })
        .collect();
    Fingerprint {
        inputs,
        version: format!(
            "{} {GRID_SCHEMA} {SUMMARY_SCHEMA}",
            env!("CARGO_PKG_VERSION")
        ),
    }
}

/// A polars error on the table (file, or what an in-memory frame is) at `path`.
fn perr(path: impl Into<PathBuf>) -> impl Fn(PolarsError) -> Error {
    let path = path.into();
    move |source| {
        Error::Table(TableError::Polars {
            path: path.clone(),
            source,
        })
    }
}

/// The finished sweeps of a design and their two input files.
fn sweeps(grid: &Grid, d: &Design, opts: &GridOptions) -> Vec<(EvalSpec, PathBuf, PathBuf)> {
    let Ok(file) = d.organism(&grid.dir) else {
        return Vec::new();
    };
    let data = opts.design_data_dir(grid, d);
    eval_specs(grid, &file)
        .into_iter()
        .filter(|s| data.join(&s.name).join("done.json").exists())
        .map(|s| {
            let dir = data.join(&s.name).join(&d.name);
            (
                s,
                dir.join("phase_accuracy.arrow"),
                dir.join("summary.json"),
            )
        })
        .filter(|(_, a, j)| a.exists() && j.exists())
        .collect()
}

fn num(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// One design's two part frames (phases, summary), without the key columns.
fn build_part(
    d: &Design,
    found: &[(EvalSpec, PathBuf, PathBuf)],
    record: Option<&DesignRecord>,
) -> Result<(DataFrame, DataFrame)> {
    let mut phases: Option<DataFrame> = None;
    let mut srows: Vec<SummarySource> = Vec::new();
    let mut period = 0i64;
    for (s, arrow, json) in found {
        let df = sweep_frame(d, s, arrow)?;
        let text = std::fs::read_to_string(json).map_err(|e| Error::io(json, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
            path: json.clone(),
            message: e.to_string(),
        })?;
        period = v["period"].as_i64().unwrap_or(0);
        srows.extend(summary_sources(s, &df, &v, arrow)?);
        match &mut phases {
            None => phases = Some(df),
            Some(all) => {
                all.vstack_mut_owned(df).map_err(perr(arrow))?;
            }
        }
    }
    let phases = phases.unwrap_or_default();
    let summary = summary_frame(d, &srows, period, record)?;
    Ok((phases, summary))
}

/// One sweep's `phase_accuracy.arrow` (at `arrow`) without its `model` column, with
/// the design and the sweep (`eval`, `n_bindings`, `query_slot`) as columns.
fn sweep_frame(d: &Design, s: &EvalSpec, arrow: &Path) -> Result<DataFrame> {
    let mut df = read_dataframe(arrow)?;
    let h = df.height();
    let _ = df.drop_in_place("model");
    for c in [
        Column::new("design".into(), vec![d.name.clone(); h]),
        Column::new("eval".into(), vec![s.kind.name().to_string(); h]),
        Column::new("n_bindings".into(), vec![s.n_bindings as i64; h]),
        Column::new("query_slot".into(), vec![s.n_queries as i64; h]),
    ] {
        df.with_column(c).map_err(perr(arrow))?;
    }
    Ok(df)
}

/// What one summary row is made of: the sweep, the protocol, its statistics from
/// `summary.json`, and its worst phase accuracy.
struct SummarySource {
    eval: String,
    n_bindings: i64,
    query_slot: i64,
    protocol: String,
    stats: serde_json::Value,
    worst: f64,
}

/// The summary sources of one sweep `s`: one per protocol of its `summary.json` (`v`),
/// with the worst phase accuracy read off its phase frame `df` (from `arrow`).
fn summary_sources(
    s: &EvalSpec,
    df: &DataFrame,
    v: &serde_json::Value,
    arrow: &Path,
) -> Result<Vec<SummarySource>> {
    let acc = df
        .column("accuracy")
        .map_err(perr(arrow))?
        .f64()
        .map_err(perr(arrow))?
        .clone();
    let proto = df
        .column("protocol")
        .map_err(perr(arrow))?
        .str()
        .map_err(perr(arrow))?
        .clone();
    let mut out = Vec::new();
    if let Some(m) = v["protocols"].as_object() {
        for (pname, p) in m {
            let label = match pname.as_str() {
                "prefix_padding" => "prefix",
                _ => "in-sequence",
            };
            let worst = proto
                .iter()
                .zip(acc.iter())
                .filter(|(pr, _)| *pr == Some(label))
                .filter_map(|(_, a)| a)
                .fold(f64::INFINITY, f64::min);
            out.push(SummarySource {
                eval: s.kind.name().to_string(),
                n_bindings: s.n_bindings as i64,
                query_slot: s.n_queries as i64,
                protocol: label.to_string(),
                stats: p.clone(),
                worst,
            });
        }
    }
    Ok(out)
}

/// A design's summary part frame: one row per source, the phase period, and the
/// training record's steps and final batch accuracy.
fn summary_frame(
    d: &Design,
    srows: &[SummarySource],
    period: i64,
    record: Option<&DesignRecord>,
) -> Result<DataFrame> {
    let n = srows.len();
    let mut columns = vec![
        Column::new("design".into(), vec![d.name.clone(); n]),
        Column::new(
            "eval".into(),
            srows.iter().map(|r| r.eval.clone()).collect::<Vec<_>>(),
        ),
        Column::new(
            "n_bindings".into(),
            srows.iter().map(|r| r.n_bindings).collect::<Vec<_>>(),
        ),
        Column::new(
            "query_slot".into(),
            srows.iter().map(|r| r.query_slot).collect::<Vec<_>>(),
        ),
        Column::new(
            "protocol".into(),
            srows.iter().map(|r| r.protocol.clone()).collect::<Vec<_>>(),
        ),
        Column::new("phase_period".into(), vec![period; n]),
    ];
    columns.extend(stat_columns(srows));
    columns.extend([
        Column::new("train_steps".into(), vec![record.map(|r| r.steps); n]),
        Column::new(
            "final_batch_accuracy".into(),
            vec![record.and_then(|r| r.final_batch_accuracy); n],
        ),
    ]);
    DataFrame::new(n, columns).map_err(perr(format!("<summary of design `{}`>", d.name)))
}

/// The statistics columns of the summary (`n_logical` to `worst_accuracy`).
fn stat_columns(srows: &[SummarySource]) -> Vec<Column> {
    let f = |g: &dyn Fn(&serde_json::Value) -> f64| -> Vec<f64> {
        srows.iter().map(|r| g(&r.stats)).collect()
    };
    let int = |key: &str, default: i64| -> Vec<i64> {
        srows
            .iter()
            .map(|r| r.stats[key].as_i64().unwrap_or(default))
            .collect()
    };
    vec![
        Column::new("n_logical".into(), int("n_logical", 0)),
        Column::new("mean_accuracy".into(), f(&|p| num(&p["mean_accuracy"]))),
        Column::new(
            "mean_ci_lo".into(),
            f(&|p| num(&p["mean_accuracy_ci95"][0])),
        ),
        Column::new(
            "mean_ci_hi".into(),
            f(&|p| num(&p["mean_accuracy_ci95"][1])),
        ),
        Column::new("phase_gap_pp".into(), f(&|p| num(&p["phase_gap_pp"]))),
        Column::new("gap_ci_lo".into(), f(&|p| num(&p["phase_gap_ci95"][0]))),
        Column::new("gap_ci_hi".into(), f(&|p| num(&p["phase_gap_ci95"][1]))),
        Column::new("best_phase".into(), int("best_phase", -1)),
        Column::new("worst_phase".into(), int("worst_phase", -1)),
        Column::new(
            "worst_accuracy".into(),
            srows.iter().map(|r| r.worst).collect::<Vec<_>>(),
        ),
    ]
}

/// A polars frame as a phaselens [`Table`] (String, Int64, UInt64, Float64, Boolean;
/// smaller integer types widen to Int64).
pub fn table_from_frame(name: &str, df: &DataFrame) -> Result<Table> {
    let mut t = Table::new(name);
    for c in df.columns() {
        let err = &perr(format!("<table `{name}`, column `{}`>", c.name()));
        let data = match c.dtype() {
            DataType::String => ColumnData::Utf8(
                c.str()
                    .map_err(err)?
                    .iter()
                    .map(|s| s.map(String::from))
                    .collect(),
            ),
            DataType::UInt64 => ColumnData::UInt64(c.u64().map_err(err)?.iter().collect()),
            DataType::Float64 | DataType::Float32 => ColumnData::Float64(
                c.cast(&DataType::Float64)
                    .map_err(err)?
                    .f64()
                    .map_err(err)?
                    .iter()
                    .collect(),
            ),
            DataType::Boolean => ColumnData::Boolean(c.bool().map_err(err)?.iter().collect()),
            DataType::Null => ColumnData::Utf8(vec![None; c.len()]),
            _ => ColumnData::Int64(
                c.cast(&DataType::Int64)
                    .map_err(err)?
                    .i64()
                    .map_err(err)?
                    .iter()
                    .collect(),
            ),
        };
        t.add_column(c.name().as_str(), data)?;
    }
    Ok(t)
}

fn write_table(t: Table, path: &Path) -> Result<()> {
    t.write_arrow(path)?;
    write_parquet_copy(path)?;
    Ok(())
}

/// The cached part of a design, or a fresh one.
fn part(grid: &Grid, d: &Design, opts: &GridOptions) -> Result<Option<(DataFrame, DataFrame)>> {
    let found = sweeps(grid, d, opts);
    if found.is_empty() {
        return Ok(None);
    }
    let dir = opts.design_data_dir(grid, d);
    let record_path = dir.join("design.json");
    let mut inputs: Vec<PathBuf> = found
        .iter()
        .flat_map(|(_, a, j)| [a.clone(), j.clone()])
        .collect();
    inputs.push(record_path.clone());
    let fp = fingerprint(&inputs);
    let (pa, ps, pj) = (
        dir.join("part.arrow"),
        dir.join("part_summary.arrow"),
        dir.join("part.json"),
    );
    let cached = std::fs::read_to_string(&pj)
        .ok()
        .and_then(|t| serde_json::from_str::<Fingerprint>(&t).ok());
    if cached.as_ref() == Some(&fp) && pa.exists() && ps.exists() {
        let a = read_dataframe(&pa)?;
        let s = read_dataframe(&ps)?;
        return Ok(Some((a, s)));
    }
    let record: Option<DesignRecord> = std::fs::read_to_string(&record_path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    let (a, s) = build_part(d, &found, record.as_ref())?;
    table_from_frame("grid_part", &a)?.write_arrow(&pa)?;
    table_from_frame("grid_part_summary", &s)?.write_arrow(&ps)?;
    write_bytes_atomic(
        &pj,
        serde_json::to_string(&fp).expect("serialises").as_bytes(),
    )
    .map_err(|e| Error::io(&pj, e))?;
    Ok(Some((a, s)))
}

/// One typed column per design key, for the rows of `designs` (a design column).
fn key_columns(grid: &Grid, designs: &StringChunked) -> Result<Vec<Column>> {
    let mut out = Vec::new();
    for key in &grid.columns {
        let vals: Vec<Option<toml::Value>> = designs
            .iter()
            .map(|n| {
                n.and_then(|n| grid.designs.iter().find(|d| d.name == n))
                    .and_then(|d| d.value(key).cloned())
            })
            .collect();
        let present = || vals.iter().flatten();
        let col = if present().all(|v| v.is_integer()) {
            Column::new(
                key.as_str().into(),
                vals.iter()
                    .map(|v| v.as_ref().and_then(|v| v.as_integer()))
                    .collect::<Vec<_>>(),
            )
        } else if present().all(|v| v.is_integer() || v.is_float()) {
            Column::new(
                key.as_str().into(),
                vals.iter()
                    .map(|v| {
                        v.as_ref()
                            .and_then(|v| v.as_float().or(v.as_integer().map(|i| i as f64)))
                    })
                    .collect::<Vec<_>>(),
            )
        } else if present().all(|v| v.is_bool()) {
            Column::new(
                key.as_str().into(),
                vals.iter()
                    .map(|v| v.as_ref().and_then(|v| v.as_bool()))
                    .collect::<Vec<_>>(),
            )
        } else {
            Column::new(
                key.as_str().into(),
                vals.iter()
                    .map(|v| {
                        v.as_ref()
                            .map(|v| v.as_str().map_or_else(|| v.to_string(), String::from))
                    })
                    .collect::<Vec<_>>(),
            )
        };
        out.push(col);
    }
    Ok(out)
}

fn with_keys(grid: &Grid, mut df: DataFrame) -> Result<DataFrame> {
    if df.height() == 0 {
        return Ok(df);
    }
    let names = df
        .column("design")
        .and_then(|c| c.str().cloned())
        .map_err(perr("<merged table, column `design`>"))?;
    for c in key_columns(grid, &names)? {
        if df
            .get_column_names()
            .iter()
            .any(|n| n.as_str() == c.name().as_str())
        {
            return Err(Error::Other(format!(
                "design key `{}` has the name of a table column; use its dotted path",
                c.name()
            )));
        }
        let what = format!("<merged table, key column `{}`>", c.name());
        df.with_column(c).map_err(perr(what))?;
    }
    Ok(df)
}

/// Merge every design's sweeps into the two tables (see the module docs). Returns what
/// was written and the merged rows the figures and the report read; the figures and
/// tables are not drawn here (`super::merge` draws them next).
pub fn merge_tables(grid: &Grid, opts: &GridOptions) -> Result<(MergeSummary, Merged)> {
    let data = opts.data_dir(grid);
    let parts = stack_parts(grid, opts)?;
    let progress = grid
        .designs
        .iter()
        .map(|d| (d.name.clone(), progress_label(grid, d, opts)))
        .collect();
    let mut out = MergeSummary {
        merged: parts.merged.clone(),
        missing: parts.missing,
        tables: Vec::new(),
        figures: Vec::new(),
        report: None,
    };
    let (Some(phases), Some(summary)) = (parts.phases, parts.summary) else {
        // Nothing swept yet: no tables or figures, but a report that lists every
        // design and how far it got.
        let m = Merged {
            phases: Vec::new(),
            summary: Vec::new(),
            designs: Vec::new(),
            progress,
            groups: super::frontier::design_groups(grid),
            frontier: Vec::new(),
        };
        return Ok((out, m));
    };
    let phases = with_keys(grid, phases)?;
    let summary = with_keys(grid, summary)?;
    let grid_text = std::fs::read_to_string(&grid.path).unwrap_or_default();
    for (name, schema, df) in [
        ("grid", GRID_SCHEMA, &phases),
        ("grid_summary", SUMMARY_SCHEMA, &summary),
    ] {
        let path = data.join(format!("{name}.arrow"));
        let t = table_from_frame(name, df)?
            .with_metadata(crate::output::META_SCHEMA, schema)
            .with_metadata("phaselens.grid_toml", grid_text.clone())
            .with_metadata("phaselens.version", env!("CARGO_PKG_VERSION"));
        write_table(t, &path)?;
        out.tables.push(path);
    }
    let mut m = Merged {
        phases: phase_rows(&phases)?,
        summary: summary_rows(&summary)?,
        designs: parts.merged,
        progress,
        groups: super::frontier::design_groups(grid),
        frontier: Vec::new(),
    };
    m.frontier =
        super::frontier::frontier(&m.groups, &m, grid.max_gap_pp, grid.eval.bootstrap_reps);
    if let Some(path) = super::frontier::write(grid, &m.frontier, &data)? {
        out.tables.push(path);
    }
    Ok((out, m))
}

/// Every design's part frames stacked in grid order, and which designs had one.
struct Parts {
    phases: Option<DataFrame>,
    summary: Option<DataFrame>,
    merged: Vec<String>,
    /// Designs without a part, with how far they got.
    missing: Vec<(String, String)>,
}

/// Build or read each design's part (with a progress bar) and stack them.
fn stack_parts(grid: &Grid, opts: &GridOptions) -> Result<Parts> {
    let bar = if opts.progress == crate::runner::ProgressMode::Auto {
        indicatif::ProgressBar::new(grid.designs.len() as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("merge [{bar:30}] {pos}/{len} designs  {msg}")
            .expect("template")
            .progress_chars("=> "),
    );
    let mut parts = Parts {
        phases: None,
        summary: None,
        merged: Vec::new(),
        missing: Vec::new(),
    };
    for d in &grid.designs {
        bar.set_message(d.name.clone());
        match part(grid, d, opts)? {
            None => parts
                .missing
                .push((d.name.clone(), progress_label(grid, d, opts))),
            Some((a, s)) => {
                parts.merged.push(d.name.clone());
                for (acc, df) in [(&mut parts.phases, a), (&mut parts.summary, s)] {
                    match acc {
                        None => *acc = Some(df),
                        Some(all) => {
                            all.vstack_mut_owned(df)
                                .map_err(perr(opts.design_data_dir(grid, d)))?;
                        }
                    }
                }
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(parts)
}

fn col<'a>(df: &'a DataFrame, name: &str) -> Result<&'a Column> {
    df.column(name)
        .map_err(perr(format!("<merged table, column `{name}`>")))
}

fn strs(df: &DataFrame, name: &str) -> Result<Vec<String>> {
    let err = || perr(format!("<merged table, column `{name}`>"));
    Ok(col(df, name)?
        .str()
        .map_err(err())?
        .iter()
        .map(|s| s.unwrap_or_default().to_string())
        .collect())
}

fn ints(df: &DataFrame, name: &str) -> Result<Vec<Option<i64>>> {
    let err = || perr(format!("<merged table, column `{name}`>"));
    Ok(col(df, name)?
        .cast(&DataType::Int64)
        .map_err(err())?
        .i64()
        .map_err(err())?
        .iter()
        .collect())
}

fn floats(df: &DataFrame, name: &str) -> Result<Vec<f64>> {
    let err = || perr(format!("<merged table, column `{name}`>"));
    Ok(col(df, name)?
        .cast(&DataType::Float64)
        .map_err(err())?
        .f64()
        .map_err(err())?
        .iter()
        .map(|v| v.unwrap_or(f64::NAN))
        .collect())
}

fn phase_rows(df: &DataFrame) -> Result<Vec<PhaseRow>> {
    let (design, eval, proto) = (
        strs(df, "design")?,
        strs(df, "eval")?,
        strs(df, "protocol")?,
    );
    let (nb, slot, phase, n) = (
        ints(df, "n_bindings")?,
        ints(df, "query_slot")?,
        ints(df, "phase")?,
        ints(df, "n")?,
    );
    let (acc, lo, hi) = (
        floats(df, "accuracy")?,
        floats(df, "wilson_lo")?,
        floats(df, "wilson_hi")?,
    );
    Ok((0..df.height())
        .map(|i| PhaseRow {
            design: design[i].clone(),
            eval: eval[i].clone(),
            n_bindings: nb[i].unwrap_or(0),
            query_slot: slot[i].unwrap_or(0),
            protocol: proto[i].clone(),
            phase: phase[i].unwrap_or(0),
            n: n[i].unwrap_or(0) as u64,
            accuracy: acc[i],
            wilson_lo: lo[i],
            wilson_hi: hi[i],
        })
        .collect())
}

fn summary_rows(df: &DataFrame) -> Result<Vec<SummaryRow>> {
    let (design, eval, proto) = (
        strs(df, "design")?,
        strs(df, "eval")?,
        strs(df, "protocol")?,
    );
    let i = |n: &str| ints(df, n);
    let f = |n: &str| floats(df, n);
    let (nb, slot, period, best, worst, steps) = (
        i("n_bindings")?,
        i("query_slot")?,
        i("phase_period")?,
        i("best_phase")?,
        i("worst_phase")?,
        i("train_steps")?,
    );
    let (mean, mlo, mhi, gap, glo, ghi, wacc) = (
        f("mean_accuracy")?,
        f("mean_ci_lo")?,
        f("mean_ci_hi")?,
        f("phase_gap_pp")?,
        f("gap_ci_lo")?,
        f("gap_ci_hi")?,
        f("worst_accuracy")?,
    );
    let bacc = f("final_batch_accuracy")?;
    Ok((0..df.height())
        .map(|k| SummaryRow {
            design: design[k].clone(),
            eval: eval[k].clone(),
            n_bindings: nb[k].unwrap_or(0),
            query_slot: slot[k].unwrap_or(0),
            protocol: proto[k].clone(),
            period: period[k].unwrap_or(0),
            mean_accuracy: mean[k],
            mean_ci: (mlo[k], mhi[k]),
            gap_pp: gap[k],
            gap_ci: (glo[k], ghi[k]),
            best_phase: best[k].unwrap_or(-1),
            worst_phase: worst[k].unwrap_or(-1),
            worst_accuracy: wacc[k],
            steps: steps[k].map(|s| s as u64),
            batch_accuracy: bacc[k].is_finite().then_some(bacc[k]),
        })
        .collect())
}
