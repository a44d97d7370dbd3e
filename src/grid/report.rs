//! `reports/grids/<grid>/report.md` (+ HTML): the designs side by side (the paper's
//! single final query as the headline), with the paper's numbers where the grid file
//! gives them, what each design learned (read off its numbers), accuracy by query
//! slot and by number of bindings, seed variance, and the figures.

use std::path::{Path, PathBuf};

use crate::error::Result;
use crate::output::{Headline, Report};

use super::merged::{Merged, SummaryRow, bindings_of, detail, final_row, seed_groups, slot_of};
use super::spec::Grid;
use crate::analysis::effects::mean_sd;

fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.2}")
    } else {
        "-".into()
    }
}

fn with_ci(x: f64, ci: (f64, f64), digits: usize) -> String {
    if !x.is_finite() {
        return "-".into();
    }
    if ci.0.is_finite() && ci.1.is_finite() {
        format!("{x:.digits$} ({:.digits$}-{:.digits$})", ci.0, ci.1)
    } else {
        format!("{x:.digits$}")
    }
}

/// What a design learned, in one paragraph, read off its merged numbers.
pub fn learned(m: &Merged, design: &str, chance: f64) -> String {
    let Some(r) = final_row(m, design, "prefix").or_else(|| {
        m.summary
            .iter()
            .find(|r| r.design == design && r.eval == "final")
    }) else {
        return "no final-query sweep yet.".into();
    };
    if r.mean_accuracy < 3.0 * chance {
        return format!(
            "did not learn the lookup: single final queries are answered at {} ({} padding), about chance ({:.3}).",
            pct(r.mean_accuracy),
            r.protocol,
            chance
        );
    }
    let mut text = format!(
        "answers {} of single final queries ({} padding) {}.",
        pct(r.mean_accuracy),
        r.protocol,
        phase_clause(m, design, r)
    );
    if let Some(q) = final_row(m, design, "in-sequence") {
        text.push_str(&format!(
            " In-sequence padding: {} (gap {:.1} pp, CI {:.1}-{:.1}).",
            pct(q.mean_accuracy),
            q.gap_pp,
            q.gap_ci.0,
            q.gap_ci.1
        ));
    }
    if let Some(slots) = slot_clause(m, design) {
        text.push_str(&slots);
    }
    let nb = detail(m, design, "bindings", bindings_of);
    if nb.len() >= 2 {
        let parts: Vec<String> = nb
            .iter()
            .map(|r| format!("{} at N = {}", pct(r.mean_accuracy), r.n_bindings))
            .collect();
        text.push_str(&format!(" By bindings: {}.", parts.join(", ")));
    }
    text
}

/// The phase clause of [`learned`]: phase-sensitive (with its weak phases) or not,
/// read off the final row `r` and the design's phase rows in the same protocol.
fn phase_clause(m: &Merged, design: &str, r: &SummaryRow) -> String {
    let phases: Vec<_> = m
        .phases
        .iter()
        .filter(|p| p.design == design && p.eval == "final" && p.protocol == r.protocol)
        .collect();
    let best = phases
        .iter()
        .map(|p| p.accuracy)
        .fold(f64::NEG_INFINITY, f64::max);
    let worst = phases
        .iter()
        .map(|p| p.accuracy)
        .fold(f64::INFINITY, f64::min);
    if r.gap_ci.0 >= 10.0 {
        let mid = 0.5 * (best + worst);
        let weak: Vec<String> = phases
            .iter()
            .filter(|p| p.accuracy < mid)
            .map(|p| format!("{} ({})", p.phase, pct(p.accuracy)))
            .collect();
        format!(
            "and is phase-sensitive: weak at phase{} {} mod {} against {} at its best phase, a gap of {:.1} pp (CI {:.1}-{:.1})",
            if weak.len() == 1 { "" } else { "s" },
            weak.join(", "),
            r.period,
            pct(best),
            r.gap_pp,
            r.gap_ci.0,
            r.gap_ci.1
        )
    } else {
        format!(
            "with no clear phase profile (gap {:.1} pp, CI {:.1}-{:.1})",
            r.gap_pp, r.gap_ci.0, r.gap_ci.1
        )
    }
}

/// The by-query-slot sentence of [`learned`] (with its elimination verdict), or
/// `None` when the design has fewer than two slots swept.
fn slot_clause(m: &Merged, design: &str) -> Option<String> {
    let slots = detail(m, design, "slot", slot_of);
    let a = slots.first().filter(|_| slots.len() >= 2)?;
    // The first slot (a single query) against every later one: a gain beyond both
    // 95% CIs at any slot means the model uses the queries before the target.
    let better = slots[1..]
        .iter()
        .filter(|r| r.mean_ci.0 > a.mean_ci.1)
        .max_by(|x, y| x.mean_accuracy.total_cmp(&y.mean_accuracy));
    let worse = slots[1..]
        .iter()
        .filter(|r| r.mean_ci.1 < a.mean_ci.0)
        .min_by(|x, y| x.mean_accuracy.total_cmp(&y.mean_accuracy));
    let verdict = match (better, worse) {
        (Some(b), _) => format!(
            "later queries are answered better (slot {}: {}, CI {}-{}, against {}, CI {}-{}, at slot {}): it gains from the queries before the target (elimination)",
            b.query_slot,
            pct(b.mean_accuracy),
            pct(b.mean_ci.0),
            pct(b.mean_ci.1),
            pct(a.mean_accuracy),
            pct(a.mean_ci.0),
            pct(a.mean_ci.1),
            a.query_slot
        ),
        (None, Some(w)) => format!(
            "later queries are answered worse (slot {}: {})",
            w.query_slot,
            pct(w.mean_accuracy)
        ),
        (None, None) => {
            "the queries before the target do not help beyond the CIs: no elimination gain"
                .to_string()
        }
    };
    let parts: Vec<String> = slots
        .iter()
        .map(|r| format!("{} at slot {}", pct(r.mean_accuracy), r.query_slot))
        .collect();
    Some(format!(" By query slot: {}; {verdict}.", parts.join(", ")))
}

fn chance_of(grid: &Grid, design: &str) -> f64 {
    grid.design(design)
        .ok()
        .and_then(|d| d.organism(&grid.dir).ok())
        .and_then(|f| f.task.vocab.build().ok())
        .map_or(f64::NAN, |s| 1.0 / s.value_atoms().len().max(1) as f64)
}

/// Write the report into `dir`; returns the Markdown path.
pub fn write(grid: &Grid, m: &Merged, dir: &Path, figures: &[PathBuf]) -> Result<PathBuf> {
    let mut rep = Report::new(format!("Grid `{}`", grid.name));
    if !grid.description.is_empty() {
        rep.paragraph(grid.description.clone());
    }
    headlines(&mut rep, grid, m);
    side_by_side(&mut rep, grid, m);
    frontier_section(&mut rep, grid, m);
    rep.section("What each design learned");
    for (name, progress) in &m.progress {
        let mut text = if m.designs.contains(name) {
            format!("{name}: {}", learned(m, name, chance_of(grid, name)))
        } else {
            format!("{name}: {progress}; nothing measured yet.")
        };
        if let Ok(d) = grid.design(name)
            && !d.note.is_empty()
        {
            text.push_str(&format!(" Note: {}", d.note));
        }
        rep.paragraph(text);
    }
    for sweep in &DETAIL_SWEEPS {
        detail_section(&mut rep, m, sweep);
    }
    seed_section(&mut rep, grid, m);
    if !figures.is_empty() {
        rep.section("Figures");
    }
    for f in figures {
        rep.figure(figure_caption(f), f);
    }
    if m.designs.is_empty() {
        rep.section("Grid file");
        rep.paragraph("No design has a finished sweep yet: no tables or figures.");
    } else {
        rep.section("Tables and grid file");
        rep.paragraph(
            "grid.arrow / grid.parquet: one row per design x sweep x protocol x phase; \
             grid_summary.arrow / .parquet: one row per design x sweep x protocol (docs/grid.md).",
        );
    }
    if let Ok(text) = std::fs::read_to_string(&grid.path) {
        rep.code("toml", text);
    }
    let files = rep.write(dir)?;
    Ok(files.markdown)
}

/// The headlines: designs merged, and the largest and smallest final-query phase gaps.
fn headlines(rep: &mut Report, grid: &Grid, m: &Merged) {
    let finals: Vec<&SummaryRow> = m
        .designs
        .iter()
        .filter_map(|d| final_row(m, d, "prefix"))
        .collect();
    rep.headline(Headline::new(
        "designs merged",
        format!("{} of {}", m.designs.len(), grid.designs.len()),
    ));
    if let Some(r) = finals.iter().max_by(|a, b| a.gap_pp.total_cmp(&b.gap_pp)) {
        rep.headline(
            Headline::new(
                "largest phase gap (final query, prefix)",
                format!("{:.1} pp", r.gap_pp),
            )
            .with_detail(format!(
                "{} (CI {:.1}-{:.1}), worst phase {}",
                r.design, r.gap_ci.0, r.gap_ci.1, r.worst_phase
            )),
        );
    }
    if let Some(r) = finals.iter().min_by(|a, b| a.gap_pp.total_cmp(&b.gap_pp)) {
        rep.headline(
            Headline::new(
                "smallest phase gap (final query, prefix)",
                format!("{:.1} pp", r.gap_pp),
            )
            .with_detail(format!(
                "{} (CI {:.1}-{:.1})",
                r.design, r.gap_ci.0, r.gap_ci.1
            )),
        );
    }
}

/// The "designs side by side" section: the final-query table over every design of
/// the grid, the designs not merged yet, and what the paper reports.
fn side_by_side(rep: &mut Report, grid: &Grid, m: &Merged) {
    rep.section("Designs side by side: the paper's single final query");
    rep.paragraph(
        "Accuracy of one query at the end of the prompt (the paper's protocol), 95% \
         cluster-bootstrap CIs over logical examples; gap = best minus worst phase group \
         (selection-adjusted CI). P = the design's phase period. Batch accuracy: the last 50 \
         training steps, every query of a prompt.",
    );
    let mut header: Vec<String> = vec!["design".into()];
    header.extend(grid.columns.iter().cloned());
    header.extend(
        [
            "state",
            "P",
            "steps",
            "batch acc",
            "prefix: mean (CI)",
            "prefix: gap pp (CI)",
            "worst phase (acc)",
            "in-seq: mean (CI)",
            "in-seq: gap pp (CI)",
            "paper",
        ]
        .map(String::from),
    );
    let rows = m
        .progress
        .iter()
        .filter_map(|(name, progress)| design_row(grid, m, name, progress))
        .collect();
    rep.table(
        "Final query, by design (every design of the grid)",
        header,
        rows,
    );
    let pending: Vec<String> = m
        .progress
        .iter()
        .filter(|(n, _)| !m.designs.contains(n))
        .map(|(n, p)| format!("{n}: {p}"))
        .collect();
    if !pending.is_empty() {
        rep.paragraph(format!(
            "Not in the tables, figures or comparisons yet ({} of {}): {}. Their rows \
             above are empty until they are trained and swept (`phaselens grid {}` resumes \
             them; `phaselens grid merge` adds them).",
            pending.len(),
            grid.designs.len(),
            pending.join("; "),
            grid.path.display()
        ));
    }
    if !grid.paper.is_empty() {
        rep.subsection("What the paper reports");
        rep.paragraph(grid.paper.clone());
    }
}

/// One row of the side-by-side table (`None` for a name the grid does not define).
fn design_row(grid: &Grid, m: &Merged, name: &str, progress: &str) -> Option<Vec<String>> {
    let d = grid.design(name).ok()?;
    let mut row = vec![name.to_string()];
    for c in &grid.columns {
        row.push(d.value(c).map_or("-".into(), |v| {
            v.as_str().map_or_else(|| v.to_string(), String::from)
        }));
    }
    let p = final_row(m, name, "prefix");
    let q = final_row(m, name, "in-sequence");
    let any = p.or(q);
    row.push(progress.to_string());
    row.push(any.map_or("-".into(), |r| r.period.to_string()));
    row.push(
        any.and_then(|r| r.steps)
            .map_or("-".into(), |s| s.to_string()),
    );
    row.push(any.and_then(|r| r.batch_accuracy).map_or("-".into(), pct));
    match p {
        Some(r) => row.extend([
            with_ci(r.mean_accuracy, r.mean_ci, 2),
            with_ci(r.gap_pp, r.gap_ci, 1),
            format!("{} ({})", r.worst_phase, pct(r.worst_accuracy)),
        ]),
        None => row.extend(["-".into(), "-".into(), "-".into()]),
    }
    match q {
        Some(r) => row.extend([
            with_ci(r.mean_accuracy, r.mean_ci, 2),
            with_ci(r.gap_pp, r.gap_ci, 1),
        ]),
        None => row.extend(["-".into(), "-".into()]),
    }
    row.push(if d.paper.is_empty() {
        "-".into()
    } else {
        d.paper.clone()
    });
    Some(row)
}

/// A detail sweep reported as its own section: accuracy by `label` (query slot or
/// number of bindings), one row per design.
struct DetailSweep {
    eval: &'static str,
    title: &'static str,
    x: fn(&SummaryRow) -> i64,
    label: &'static str,
    what: &'static str,
}

/// The detail sweeps of the report, in section order.
const DETAIL_SWEEPS: [DetailSweep; 2] = [
    DetailSweep {
        eval: "slot",
        title: "Accuracy by query slot (does the model gain from the queries before?)",
        x: slot_of,
        label: "slot",
        what: "The final query is the k-th query of its prompt; the k - 1 before it (teacher-forced, \
             never the target) could help a model that eliminates bindings already asked. A flat \
             row means retrieval only.",
    },
    DetailSweep {
        eval: "bindings",
        title: "Accuracy by number of bindings",
        x: bindings_of,
        label: "N",
        what: "A single final query among N bindings (the designs were trained with the count of \
             their recipe).",
    },
];

/// The section of one detail sweep (nothing when no design has rows for it).
fn detail_section(rep: &mut Report, m: &Merged, sweep: &DetailSweep) {
    let DetailSweep {
        eval,
        title,
        x,
        label,
        what,
    } = *sweep;
    let mut xs: Vec<i64> = Vec::new();
    let mut per: Vec<(String, Vec<&SummaryRow>)> = Vec::new();
    for name in &m.designs {
        let rows = detail(m, name, eval, x);
        for r in &rows {
            if !xs.contains(&x(r)) {
                xs.push(x(r));
            }
        }
        if !rows.is_empty() {
            per.push((name.clone(), rows));
        }
    }
    if per.is_empty() {
        return;
    }
    xs.sort_unstable();
    rep.section(title);
    rep.paragraph(what);
    let mut header = vec!["design".to_string(), "protocol".into()];
    header.extend(xs.iter().map(|v| format!("{label} = {v}")));
    let rows = per
        .iter()
        .map(|(name, rs)| {
            let mut row = vec![name.clone(), rs[0].protocol.clone()];
            row.extend(xs.iter().map(|v| {
                rs.iter()
                    .find(|r| x(r) == *v)
                    .map_or("-".into(), |r| with_ci(r.mean_accuracy, r.mean_ci, 2))
            }));
            row
        })
        .collect();
    rep.table(format!("Mean accuracy by {label} (95% CI)"), header, rows);
}

/// The seed-variance section (nothing when no designs differ only in seed).
fn seed_section(rep: &mut Report, grid: &Grid, m: &Merged) {
    let groups = seed_groups(grid, m);
    if groups.is_empty() {
        return;
    }
    rep.section("Seed variance");
    let mut rows = Vec::new();
    for (key, members) in &groups {
        for proto in ["prefix", "in-sequence"] {
            let rs: Vec<&SummaryRow> = members
                .iter()
                .filter_map(|d| final_row(m, d, proto))
                .collect();
            if !rs.is_empty() {
                rows.push(seed_row(key, proto, &rs));
            }
        }
    }
    rep.table(
        "Designs that differ only in seed (final query; mean +- sd over seeds)",
        [
            "other keys",
            "protocol",
            "seeds",
            "mean accuracy",
            "gap pp",
            "gaps pp",
            "worst phases",
        ]
        .map(String::from)
        .to_vec(),
        rows,
    );
}

/// One row of the seed-variance table: the final rows `rs` of a seed group in `proto`.
fn seed_row(key: &str, proto: &str, rs: &[&SummaryRow]) -> Vec<String> {
    let gaps: Vec<f64> = rs.iter().map(|r| r.gap_pp).collect();
    let means: Vec<f64> = rs.iter().map(|r| r.mean_accuracy).collect();
    let (gm, gs) = mean_sd(&gaps);
    let (mm, ms) = mean_sd(&means);
    let worst: Vec<String> = rs.iter().map(|r| r.worst_phase.to_string()).collect();
    vec![
        if key.is_empty() {
            "-".into()
        } else {
            key.to_string()
        },
        proto.to_string(),
        rs.len().to_string(),
        format!("{mm:.2} +- {ms:.2}"),
        format!("{gm:.1} +- {gs:.1}"),
        gaps.iter()
            .map(|g| format!("{g:.1}"))
            .collect::<Vec<_>>()
            .join(", "),
        worst.join(", "),
    ]
}

/// The caption of a grid figure, from its file stem.
fn figure_caption(f: &Path) -> String {
    let stem = f
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    match stem.as_str() {
        "phase_gap" => "Phase gap and mean accuracy per design (final query, 95% CI)".to_string(),
        "accuracy_by_phase" => "Accuracy by phase, one panel per design (95% Wilson)".to_string(),
        "accuracy_by_slot" => "Accuracy by query slot".to_string(),
        "accuracy_by_bindings" => "Accuracy by number of bindings".to_string(),
        s if s.starts_with("seed_variance") => "Seeds overlaid (accuracy by phase)".to_string(),
        "frontier_profiles" => {
            "Accuracy by phase per design, its seeds overlaid (95% Wilson)".to_string()
        }
        s if s.starts_with("frontier_") => format!(
            "Frontier, {} padding: phase gap vs mean accuracy per design (mean over seeds, 95% CI; colour: the gate's verdict)",
            &s["frontier_".len()..]
        ),
        s => s.to_string(),
    }
}

/// `x +- sd (lo-hi)` (no sd for one seed), `-` when `x` is not finite.
fn with_sd_ci(x: f64, sd: Option<f64>, ci: (f64, f64), digits: usize) -> String {
    if !x.is_finite() {
        return "-".into();
    }
    let sd = sd.map_or(String::new(), |s| format!(" +- {s:.digits$}"));
    if ci.0.is_finite() && ci.1.is_finite() {
        format!("{x:.digits$}{sd} ({:.digits$}-{:.digits$})", ci.0, ci.1)
    } else {
        format!("{x:.digits$}{sd}")
    }
}

/// The frontier section: every design of the grid pooled over seeds (the merged ones
/// with their points and the gate's verdict, the others as not trained).
fn frontier_section(rep: &mut Report, grid: &Grid, m: &Merged) {
    let gate = grid.max_gap_pp;
    rep.section("Frontier: phase gap vs mean accuracy per design (seeds pooled)");
    rep.paragraph(format!(
        "Each design pools the grid's designs that differ only in `seed`. Its point is the \
         mean over its merged seeds of each seed's final-query mean accuracy and phase gap \
         (+- the sd over seeds, from two seeds on). 95% CI: with one seed, that sweep's \
         cluster-bootstrap CI over logical examples (the gap's selection-adjusted); with \
         more, a two-level bootstrap (seeds resampled with replacement, each drawn seed's \
         value drawn from its own sweep CI; with 2-3 seeds it says little about seeds not \
         trained). Verdict against the {gate} pp gap gate (`[grid] max_gap`), per protocol: \
         pass when the gap's CI upper bound is at most {gate} pp, fail when its lower bound \
         is above {gate} pp, else inconclusive; overall: fail if a protocol fails, pass if \
         all pass; a design answering below 3x chance under every protocol is flagged as \
         not having learned the lookup (its small gap is no mitigation). Worst phase: of \
         the seed-mean profile. Table: grid_frontier.arrow (docs/tables.md)."
    ));
    let header: Vec<String> = [
        "design",
        "seeds",
        "state",
        "prefix: mean acc (CI)",
        "prefix: gap pp (CI)",
        "prefix: worst phase (acc)",
        "in-seq: mean acc (CI)",
        "in-seq: gap pp (CI)",
        "verdict (prefix / in-seq)",
        "verdict",
    ]
    .map(String::from)
    .to_vec();
    let mut rows = Vec::new();
    let mut counts = [0usize; 4];
    for g in &m.groups {
        let (row, slot) = frontier_row(grid, m, g);
        counts[slot] += 1;
        rows.push(row);
    }
    rep.table(
        format!("Designs pooled over seeds against the {gate} pp gap gate (final query)"),
        header,
        rows,
    );
    rep.paragraph(format!(
        "{} of {} designs measured: {} pass, {} fail, {} inconclusive; {} not trained yet.",
        m.groups.len() - counts[3],
        m.groups.len(),
        counts[0],
        counts[1],
        counts[2],
        counts[3]
    ));
}

/// One design's row of the frontier table (its points under each protocol, verdicts,
/// whether it learned the lookup) and its overall verdict's slot among (pass, fail,
/// inconclusive, not trained).
fn frontier_row(
    grid: &Grid,
    m: &Merged,
    g: &super::frontier::rows::DesignGroup,
) -> (Vec<String>, usize) {
    use super::frontier::Verdict;
    let protos = ["prefix", "in-sequence"];
    let pts: Vec<Option<&super::frontier::FrontierRow>> = protos
        .iter()
        .map(|p| {
            m.frontier
                .iter()
                .find(|r| r.design == g.label && r.protocol == *p)
        })
        .collect();
    let seeds = pts.iter().flatten().map(|r| r.seeds()).max().unwrap_or(0);
    let state = group_state(g, m, seeds);
    let mut row = vec![
        g.label.clone(),
        format!("{seeds}/{}", g.members.len()),
        state,
    ];
    for (k, r) in pts.iter().enumerate() {
        match r {
            Some(r) => {
                row.push(with_sd_ci(r.mean_accuracy, r.mean_sd, r.mean_ci, 2));
                row.push(with_sd_ci(r.gap_pp, r.gap_sd, r.gap_ci, 1));
                if k == 0 {
                    row.push(format!("{} ({})", r.worst_phase, pct(r.worst_accuracy)));
                }
            }
            None => row.extend((0..if k == 0 { 3 } else { 2 }).map(|_| "-".to_string())),
        }
    }
    let vs: Vec<Verdict> = pts.iter().flatten().map(|r| r.verdict).collect();
    row.push(
        pts.iter()
            .map(|r| r.map_or("-", |r| r.verdict.name()))
            .collect::<Vec<_>>()
            .join(" / "),
    );
    let overall = Verdict::overall(&vs);
    // A design that did not learn the lookup passes the gap gate trivially.
    let chance = g.members.first().map_or(f64::NAN, |d| chance_of(grid, d));
    let unlearned = !vs.is_empty() && pts.iter().flatten().all(|r| r.mean_accuracy < 3.0 * chance);
    let slot = match overall {
        Some(Verdict::Pass) => 0,
        Some(Verdict::Fail) => 1,
        Some(Verdict::Inconclusive) => 2,
        None => 3,
    };
    row.push(match overall {
        None => "not trained".into(),
        Some(v) if unlearned => {
            format!("{}; did not learn (mean < 3x chance {chance:.3})", v.name())
        }
        Some(v) => v.name().to_string(),
    });
    (row, slot)
}

/// The state of a frontier design with `seeds` merged seeds: `done`, `k of n seeds
/// merged`, or (none merged) its first seed's progress; plus the progress of every
/// seed not merged that has started (`; baseline-seed1: not trained (step 750/2000)`).
fn group_state(g: &super::frontier::DesignGroup, m: &Merged, seeds: usize) -> String {
    let progress = |d: &String| {
        m.progress
            .iter()
            .find(|(n, _)| n == d)
            .map_or("not trained", |(_, p)| p.as_str())
    };
    let pending: Vec<&String> = g
        .members
        .iter()
        .filter(|d| !m.designs.contains(d))
        .collect();
    let mut state = if seeds == 0 {
        g.members
            .first()
            .map_or("not trained".to_string(), |d| progress(d).to_string())
    } else if seeds == g.members.len() {
        "done".to_string()
    } else {
        format!("{seeds} of {} seeds merged", g.members.len())
    };
    for d in pending {
        let p = progress(d);
        if p != "not trained (not started)" && !(seeds == 0 && g.members.first() == Some(d)) {
            state.push_str(&format!("; {d}: {p}"));
        }
    }
    state
}
