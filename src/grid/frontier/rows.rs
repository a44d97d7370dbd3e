//! The frontier's rows and groups: a design (the grid designs that differ only in
//! `seed`), one point of the frontier, how its CI was computed and its verdict against
//! the gap gate. Plain data (no merged tables), so the merged data can hold them.

use super::super::spec::Grid;

/// A design of the frontier: the grid designs that differ only in `seed`.
#[derive(Debug, Clone, PartialEq)]
pub struct DesignGroup {
    /// The members' common name without its `seed<N>` part (`baseline` for
    /// `baseline-seed0`, `baseline-seed1`, ...), or the first member's name when the
    /// members' names do not share one.
    pub label: String,
    /// The grid designs (seeds), in grid order.
    pub members: Vec<String>,
}

/// The frontier's groups: every design of the grid, grouped by all its grid keys but
/// `seed`, in grid order.
pub fn design_groups(grid: &Grid) -> Vec<DesignGroup> {
    // (other keys, [(design, its seed)]) in grid order.
    type Keyed = (String, Vec<(String, Option<String>)>);
    let mut keyed: Vec<Keyed> = Vec::new();
    for d in &grid.designs {
        let key = grid
            .columns
            .iter()
            .filter(|c| c.as_str() != "seed")
            .map(|c| format!("{c}={}", d.value(c).map_or("-".into(), |v| v.to_string())))
            .collect::<Vec<_>>()
            .join(" ");
        let seed = d.value("seed").map(|v| v.to_string());
        match keyed.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push((d.name.clone(), seed)),
            None => keyed.push((key, vec![(d.name.clone(), seed)])),
        }
    }
    let mut out: Vec<DesignGroup> = Vec::new();
    for (_, members) in keyed {
        let mut label = group_label(&members);
        // Labels are unique: a stripped name another group already has falls back to
        // the first member's name (design names are unique).
        if out.iter().any(|g| g.label == label) {
            label = members[0].0.clone();
        }
        out.push(DesignGroup {
            label,
            members: members.into_iter().map(|(n, _)| n).collect(),
        });
    }
    out
}

/// A name without its `seed<value>` part (`-`-separated), e.g. `w8s8` for `w8s8-seed0`.
pub fn strip_seed(name: &str, seed: Option<&str>) -> String {
    let Some(seed) = seed else {
        return name.to_string();
    };
    let token = format!("seed{seed}");
    name.split('-')
        .filter(|p| *p != token)
        .collect::<Vec<_>>()
        .join("-")
}

fn group_label(members: &[(String, Option<String>)]) -> String {
    let stripped: Vec<String> = members
        .iter()
        .map(|(n, s)| strip_seed(n, s.as_deref()))
        .collect();
    match stripped.first() {
        Some(first) if !first.is_empty() && stripped.iter().all(|s| s == first) => first.clone(),
        _ => members.first().map(|(n, _)| n.clone()).unwrap_or_default(),
    }
}

/// How a point's CI was computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CiMethod {
    /// One seed: its sweep's cluster-bootstrap CI.
    Sweep,
    /// Two or more seeds: [`crate::analysis::runs_mean_ci`].
    SeedBootstrap,
}

impl CiMethod {
    /// The name in `grid_frontier.arrow`'s `ci_method` column.
    pub fn name(self) -> &'static str {
        match self {
            CiMethod::Sweep => "sweep",
            CiMethod::SeedBootstrap => "seed-bootstrap",
        }
    }
}

/// A verdict against the gap gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The gap's CI upper bound is at most the gate.
    Pass,
    /// The gap's CI lower bound is above the gate.
    Fail,
    /// The CI straddles the gate (or is undefined).
    Inconclusive,
}

impl Verdict {
    /// The name in `grid_frontier.arrow`'s `verdict` column.
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "fail",
            Verdict::Inconclusive => "inconclusive",
        }
    }

    /// The verdict of a gap CI `(lo, hi)` (pp) against `gate_pp`.
    pub fn of_gap(ci: (f64, f64), gate_pp: f64) -> Verdict {
        if ci.1.is_finite() && ci.1 <= gate_pp {
            Verdict::Pass
        } else if ci.0.is_finite() && ci.0 > gate_pp {
            Verdict::Fail
        } else {
            Verdict::Inconclusive
        }
    }

    /// A design's verdict over its protocols: fail if any fails, pass if all pass.
    pub fn overall(vs: &[Verdict]) -> Option<Verdict> {
        if vs.is_empty() {
            None
        } else if vs.contains(&Verdict::Fail) {
            Some(Verdict::Fail)
        } else if vs.iter().all(|v| *v == Verdict::Pass) {
            Some(Verdict::Pass)
        } else {
            Some(Verdict::Inconclusive)
        }
    }
}

/// One point of the frontier: a design (its merged seeds) under one protocol.
#[derive(Debug, Clone, PartialEq)]
pub struct FrontierRow {
    /// The design's label (its grid name without the seed).
    pub design: String,
    /// The padding protocol (`prefix`, `in-sequence`).
    pub protocol: String,
    /// The merged seeds (grid designs) behind the point, in grid order.
    pub members: Vec<String>,
    /// The design's seeds in the grid (merged or not).
    pub seeds_total: usize,
    /// The phase period.
    pub period: i64,
    /// Mean over seeds of each seed's mean accuracy over phases.
    pub mean_accuracy: f64,
    /// Sample sd over seeds; `None` for one seed.
    pub mean_sd: Option<f64>,
    /// 95% CI of `mean_accuracy` (see [`CiMethod`]).
    pub mean_ci: (f64, f64),
    /// Mean over seeds of each seed's phase gap (pp).
    pub gap_pp: f64,
    /// Sample sd of the gap over seeds; `None` for one seed.
    pub gap_sd: Option<f64>,
    /// 95% CI of `gap_pp` (see [`CiMethod`]).
    pub gap_ci: (f64, f64),
    /// Worst phase of the seed-mean profile and its accuracy.
    pub worst_phase: i64,
    /// The worst phase's seed-mean accuracy.
    pub worst_accuracy: f64,
    /// Each seed's own worst phase, in member order.
    pub seed_worst_phases: Vec<i64>,
    /// How the CIs were computed.
    pub ci_method: CiMethod,
    /// The gap gate (pp, `[grid] max_gap`).
    pub gate_pp: f64,
    /// [`Verdict::of_gap`] of `gap_ci` against `gate_pp`.
    pub verdict: Verdict,
}

impl FrontierRow {
    /// Merged seeds behind the point.
    pub fn seeds(&self) -> usize {
        self.members.len()
    }
}
