//! The mitigation frontier: per design (the grid's designs that differ only in `seed`,
//! pooled), the mean accuracy over phases against the phase gap of the paper's single
//! final query, with the spread over seeds, a 95% CI and a verdict against the grid's
//! phase-gap gate (`[grid] max_gap`, default 5 pp, the audit's `--max-gap 5pp`).
//!
//! - A point's value is the mean over the design's merged seeds of each seed's sweep
//!   statistic (`mean_accuracy`, `phase_gap_pp` of `grid_summary`); `sd` is the sample
//!   standard deviation over seeds (none for a single seed).
//! - Its CI: one seed, that sweep's 95% cluster-bootstrap CI over logical examples
//!   (the gap's selection-adjusted, as `phase-sweep` and `phaselens audit` report it;
//!   `ci_method = "sweep"`); two or more, the two-level bootstrap of
//!   [`runs_mean_ci`] (seeds resampled, each drawn seed's value drawn from its own CI;
//!   `ci_method = "seed-bootstrap"`).
//! - The verdict, per protocol: `pass` when the gap's CI upper bound is at most the
//!   gate, `fail` when its lower bound is above it, else `inconclusive` (the audit's
//!   `--gate-on upper` to pass, `--gate-on lower` to fail). A design's overall verdict:
//!   `fail` if a protocol fails, `pass` if every protocol passes, else `inconclusive`.
//! - Worst phase: of the seed-mean profile (each phase's accuracy averaged over seeds).
//!
//! Written as `grid_frontier.arrow` (+ `.parquet`, schema [`FRONTIER_SCHEMA`], one row
//! per design x protocol with a merged seed), drawn as `frontier_<protocol>` and
//! `frontier_profiles`, reported as the report's frontier table (which also lists the
//! designs with no merged seed as not trained).

use std::path::Path;

use crate::analysis::{RunEstimate, runs_mean_ci};
use crate::error::Result;
use crate::output::{ColumnData, Table, write_parquet_copy};

use super::merged::{Merged, final_phases, final_row, protocols};
use super::spec::Grid;

pub(super) mod rows;
pub use rows::{CiMethod, DesignGroup, FrontierRow, Verdict, design_groups, strip_seed};

/// Schema id of `grid_frontier.arrow`.
pub const FRONTIER_SCHEMA: &str = "grid_frontier/v1";
/// Seed of the frontier's two-level bootstrap (fixed: a re-merge writes the same table).
pub const FRONTIER_SEED: u64 = 20_261_202;

/// Sample sd (n - 1), `None` below two values.
fn sd(v: &[f64]) -> Option<f64> {
    (v.len() >= 2).then(|| {
        let n = v.len() as f64;
        let m = v.iter().sum::<f64>() / n;
        (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
    })
}

/// The frontier rows of `groups` from the merged rows `m`: one per group x protocol
/// with at least one merged seed (protocols in [`protocols`] order, groups in order).
/// `reps` bootstrap replicates (at least 1) with [`FRONTIER_SEED`].
pub fn frontier(groups: &[DesignGroup], m: &Merged, gate_pp: f64, reps: usize) -> Vec<FrontierRow> {
    let mut out = Vec::new();
    for g in groups {
        for p in protocols(m) {
            if let Some(r) = point(g, m, &p, gate_pp, reps.max(1)) {
                out.push(r);
            }
        }
    }
    out
}

/// The point of group `g` under protocol `p`, `None` without a merged seed.
fn point(g: &DesignGroup, m: &Merged, p: &str, gate_pp: f64, reps: usize) -> Option<FrontierRow> {
    let rows: Vec<_> = g
        .members
        .iter()
        .filter_map(|d| final_row(m, d, p))
        .collect();
    let first = rows.first()?;
    let means: Vec<f64> = rows.iter().map(|r| r.mean_accuracy).collect();
    let gaps: Vec<f64> = rows.iter().map(|r| r.gap_pp).collect();
    let avg = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (ci_method, mean_ci, gap_ci) = if rows.len() == 1 {
        (CiMethod::Sweep, first.mean_ci, first.gap_ci)
    } else {
        let ci = |est: &dyn Fn(usize) -> (f64, (f64, f64)), bounds| {
            let runs: Vec<RunEstimate> = (0..rows.len())
                .map(|i| {
                    let (estimate, ci95) = est(i);
                    RunEstimate { estimate, ci95 }
                })
                .collect();
            runs_mean_ci(&runs, bounds, reps, FRONTIER_SEED, 0.95)
                .map_or((f64::NAN, f64::NAN), |c| (c.lo, c.hi))
        };
        (
            CiMethod::SeedBootstrap,
            ci(&|i| (rows[i].mean_accuracy, rows[i].mean_ci), (0.0, 1.0)),
            ci(&|i| (rows[i].gap_pp, rows[i].gap_ci), (0.0, 100.0)),
        )
    };
    let (worst_phase, worst_accuracy) = seed_mean_profile(m, &rows_members(g, m, p), p)
        .into_iter()
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
        .unwrap_or((-1, f64::NAN));
    Some(FrontierRow {
        design: g.label.clone(),
        protocol: p.to_string(),
        members: rows.iter().map(|r| r.design.clone()).collect(),
        seeds_total: g.members.len(),
        period: first.period,
        mean_accuracy: avg(&means),
        mean_sd: sd(&means),
        mean_ci,
        gap_pp: avg(&gaps),
        gap_sd: sd(&gaps),
        gap_ci,
        worst_phase,
        worst_accuracy,
        seed_worst_phases: rows.iter().map(|r| r.worst_phase).collect(),
        ci_method,
        gate_pp,
        verdict: Verdict::of_gap(gap_ci, gate_pp),
    })
}

/// The members of `g` with a final row in protocol `p`.
fn rows_members(g: &DesignGroup, m: &Merged, p: &str) -> Vec<String> {
    g.members
        .iter()
        .filter(|d| final_row(m, d, p).is_some())
        .cloned()
        .collect()
}

/// The seed-mean accuracy profile of `members` (final query, protocol `p`): per phase,
/// the mean accuracy over the members that have that phase, phases ascending.
pub fn seed_mean_profile(m: &Merged, members: &[String], p: &str) -> Vec<(i64, f64)> {
    let mut acc: Vec<(i64, f64, usize)> = Vec::new();
    for d in members {
        for r in final_phases(m, d, p) {
            match acc.iter_mut().find(|(ph, _, _)| *ph == r.phase) {
                Some((_, s, n)) => {
                    *s += r.accuracy;
                    *n += 1;
                }
                None => acc.push((r.phase, r.accuracy, 1)),
            }
        }
    }
    acc.sort_by_key(|(ph, _, _)| *ph);
    acc.into_iter()
        .map(|(ph, s, n)| (ph, s / n as f64))
        .collect()
}

/// The frontier as a [`FRONTIER_SCHEMA`] table (docs/tables.md).
pub fn frontier_table(rows: &[FrontierRow]) -> Result<Table> {
    let mut t = Table::new("grid_frontier");
    let s = |f: &dyn Fn(&FrontierRow) -> String| {
        ColumnData::Utf8(rows.iter().map(|r| Some(f(r))).collect())
    };
    let i = |f: &dyn Fn(&FrontierRow) -> i64| {
        ColumnData::Int64(rows.iter().map(|r| Some(f(r))).collect())
    };
    let x =
        |f: &dyn Fn(&FrontierRow) -> Option<f64>| ColumnData::Float64(rows.iter().map(f).collect());
    let join = |v: &[String]| v.join(",");
    t.add_column("design", s(&|r| r.design.clone()))?;
    t.add_column("protocol", s(&|r| r.protocol.clone()))?;
    t.add_column("seeds", i(&|r| r.seeds() as i64))?;
    t.add_column("seeds_total", i(&|r| r.seeds_total as i64))?;
    t.add_column("members", s(&|r| join(&r.members)))?;
    t.add_column("phase_period", i(&|r| r.period))?;
    t.add_column("mean_accuracy", x(&|r| Some(r.mean_accuracy)))?;
    t.add_column("mean_accuracy_sd", x(&|r| r.mean_sd))?;
    t.add_column("mean_ci_lo", x(&|r| Some(r.mean_ci.0)))?;
    t.add_column("mean_ci_hi", x(&|r| Some(r.mean_ci.1)))?;
    t.add_column("phase_gap_pp", x(&|r| Some(r.gap_pp)))?;
    t.add_column("phase_gap_sd", x(&|r| r.gap_sd))?;
    t.add_column("gap_ci_lo", x(&|r| Some(r.gap_ci.0)))?;
    t.add_column("gap_ci_hi", x(&|r| Some(r.gap_ci.1)))?;
    t.add_column("worst_phase", i(&|r| r.worst_phase))?;
    t.add_column("worst_accuracy", x(&|r| Some(r.worst_accuracy)))?;
    t.add_column(
        "seed_worst_phases",
        s(&|r| {
            r.seed_worst_phases
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(",")
        }),
    )?;
    t.add_column("ci_method", s(&|r| r.ci_method.name().to_string()))?;
    t.add_column("max_gap_pp", x(&|r| Some(r.gate_pp)))?;
    t.add_column("verdict", s(&|r| r.verdict.name().to_string()))?;
    Ok(t)
}

/// Write `grid_frontier.arrow` + `.parquet` into `data` (nothing without rows);
/// returns the Arrow path when written.
pub fn write(grid: &Grid, rows: &[FrontierRow], data: &Path) -> Result<Option<std::path::PathBuf>> {
    if rows.is_empty() {
        return Ok(None);
    }
    let path = data.join("grid_frontier.arrow");
    let grid_text = std::fs::read_to_string(&grid.path).unwrap_or_default();
    frontier_table(rows)?
        .with_metadata(crate::output::META_SCHEMA, FRONTIER_SCHEMA)
        .with_metadata("phaselens.grid_toml", grid_text)
        .with_metadata("phaselens.version", env!("CARGO_PKG_VERSION"))
        .write_arrow(&path)?;
    write_parquet_copy(&path)?;
    Ok(Some(path))
}
