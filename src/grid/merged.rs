//! The merged grid data as the figures and the report read it: a row per design x sweep
//! x protocol (x phase), and the look-ups both of them make on those rows.

use super::frontier::rows::{DesignGroup, FrontierRow};
use super::spec::Grid;

/// One row of the merged phase table, as the figures and report read it.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseRow {
    /// The grid design.
    pub design: String,
    /// The sweep (`final`, or an `[[eval]]` name).
    pub eval: String,
    /// Bindings per prompt in the sweep.
    pub n_bindings: i64,
    /// The queried binding's slot.
    pub query_slot: i64,
    /// The padding protocol (`prefix`, `in-sequence`).
    pub protocol: String,
    /// The phase.
    pub phase: i64,
    /// Prompts of the phase.
    pub n: u64,
    /// Top-1 accuracy.
    pub accuracy: f64,
    /// Lower bound of its 95% Wilson interval.
    pub wilson_lo: f64,
    /// Upper bound of its 95% Wilson interval.
    pub wilson_hi: f64,
}

/// One row of the merged summary table.
#[derive(Debug, Clone, PartialEq)]
pub struct SummaryRow {
    /// The grid design.
    pub design: String,
    /// The sweep (`final`, or an `[[eval]]` name).
    pub eval: String,
    /// Bindings per prompt in the sweep.
    pub n_bindings: i64,
    /// The queried binding's slot.
    pub query_slot: i64,
    /// The padding protocol (`prefix`, `in-sequence`).
    pub protocol: String,
    /// The phase period.
    pub period: i64,
    /// Mean accuracy over phases.
    pub mean_accuracy: f64,
    /// Its 95% cluster-bootstrap CI.
    pub mean_ci: (f64, f64),
    /// Best minus worst phase accuracy (pp).
    pub gap_pp: f64,
    /// Its selection-adjusted 95% cluster-bootstrap CI (pp).
    pub gap_ci: (f64, f64),
    /// The phase of highest accuracy.
    pub best_phase: i64,
    /// The phase of lowest accuracy.
    pub worst_phase: i64,
    /// Its accuracy.
    pub worst_accuracy: f64,
    /// Training steps of the design's organism.
    pub steps: Option<u64>,
    /// Its final training-batch accuracy.
    pub batch_accuracy: Option<f64>,
}

/// Everything the figures and the report need.
#[derive(Debug, Clone)]
pub struct Merged {
    /// Every phase row.
    pub phases: Vec<PhaseRow>,
    /// Every summary row.
    pub summary: Vec<SummaryRow>,
    /// Merged designs in grid order.
    pub designs: Vec<String>,
    /// Every design of the grid, in grid order, with how far it got (`done`,
    /// `trained; sweeps 3/7`, `not trained (step 750/2000)`, `not trained (not started)`).
    pub progress: Vec<(String, String)>,
    /// Every design of the frontier (the grid's designs pooled over `seed`), in order.
    pub groups: Vec<DesignGroup>,
    /// The frontier: one point per group x protocol with a merged seed.
    pub frontier: Vec<FrontierRow>,
}

/// The final-query summary row of `design` for `protocol`.
pub fn final_row<'a>(m: &'a Merged, design: &str, protocol: &str) -> Option<&'a SummaryRow> {
    m.summary
        .iter()
        .find(|r| r.design == design && r.eval == "final" && r.protocol == protocol)
}

/// The protocols of the final sweeps, prefix padding first.
pub fn protocols(m: &Merged) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for r in m.summary.iter().filter(|r| r.eval == "final") {
        if !v.contains(&r.protocol) {
            v.push(r.protocol.clone());
        }
    }
    v.sort_by_key(|p| (p != "prefix", p.clone()));
    v
}

/// The final-query phase rows of `design` for `protocol`.
pub fn final_phases<'a>(m: &'a Merged, design: &str, protocol: &str) -> Vec<&'a PhaseRow> {
    m.phases
        .iter()
        .filter(|r| r.design == design && r.eval == "final" && r.protocol == protocol)
        .collect()
}

/// Groups of merged designs that differ only in `seed` (two or more members), named
/// by their other keys.
pub fn seed_groups(grid: &Grid, m: &Merged) -> Vec<(String, Vec<String>)> {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for name in &m.designs {
        let Ok(d) = grid.design(name) else { continue };
        if d.value("seed").is_none() {
            continue;
        }
        let others: Vec<String> = grid
            .columns
            .iter()
            .filter(|c| c.as_str() != "seed")
            .map(|c| format!("{c}={}", d.value(c).map_or("-".into(), |v| v.to_string())))
            .collect();
        let key = others.join(" ");
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(name.clone()),
            None => groups.push((key, vec![name.clone()])),
        }
    }
    groups.retain(|(_, v)| v.len() >= 2);
    groups
}

/// The detail rows (slot or bindings sweeps, plus the final sweep in the same
/// protocol) of a design, sorted by `x`.
pub fn detail<'a>(
    m: &'a Merged,
    design: &str,
    eval: &str,
    x: fn(&SummaryRow) -> i64,
) -> Vec<&'a SummaryRow> {
    let Some(proto) = m
        .summary
        .iter()
        .find(|r| r.design == design && r.eval == eval)
        .map(|r| r.protocol.clone())
    else {
        return Vec::new();
    };
    let mut rows: Vec<&SummaryRow> = m
        .summary
        .iter()
        .filter(|r| {
            r.design == design && r.protocol == proto && (r.eval == eval || r.eval == "final")
        })
        .collect();
    rows.sort_by_key(|r| x(r));
    rows.dedup_by_key(|r| x(r));
    rows
}

/// The query slot of a row (the x of the slot sweeps).
pub fn slot_of(r: &SummaryRow) -> i64 {
    r.query_slot
}

/// The number of bindings of a row (the x of the bindings sweeps).
pub fn bindings_of(r: &SummaryRow) -> i64 {
    r.n_bindings
}
