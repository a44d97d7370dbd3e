//! Certify a shipped organism's phase sensitivity from Rust, then pool a design's
//! training seeds the way the grid frontier does, through the library face.
//!
//! `cargo run --example audit --features all-backends`
//!
//! 1. [`run_audit`]: audit the shipped kvc-w8s8 organism with a small budget (a few
//!    seconds on one core) against a 5 pp phase-gap gate, and read the certificate it
//!    returns (also written as `audit.json` with a report, in a temporary folder here).
//! 2. [`runs_mean_ci`]: pool the four training seeds of the paper grid's W8/S8 design
//!    (each seed's phase gap with its own 95% CI, from the merged `grid_summary.arrow`)
//!    into a two-level bootstrap CI of the mean gap, judge it against the grid's gate
//!    with the frontier's rule ([`Verdict::of_gap`]), and check that the merge wrote
//!    the same numbers into `grid_frontier.arrow`.

use std::path::{Path, PathBuf};

use phaselens::analysis::{DEFAULT_LEVEL, DEFAULT_REPS, RunEstimate, runs_mean_ci};
use phaselens::audit::{AuditConfig, AuditRequest, ProgressMode, run_audit};
use phaselens::grid::frontier::{FRONTIER_SEED, Verdict};
use phaselens::output::Table;
use phaselens::prelude::*;

fn main() -> Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    audit(&root)?;
    pool_seeds(&root)
}

/// Part 1: an audit with a small budget, and what its certificate says.
fn audit(root: &Path) -> Result<()> {
    let mut config = AuditConfig::default();
    config.gates.max_gap = Some(5.0); // pp: `--max-gap 5pp`
    config.budget.prompts = 600; // forward rows in all (the default is 6000)
    config.budget.time = None; // size by prompts alone: the same plan on any machine
    config.audit.ci_width = None; // no required CI width: take what the budget buys
    config.audit.bootstrap_reps = 200;
    config.audit.permutations = 200;
    config.audit.filler = false;
    let out = tempfile_dir()?;
    let outcome = run_audit(&AuditRequest {
        model: root.join("experiments/organisms/kvc-w8s8"),
        out: out.clone(),
        config,
        device: DeviceSpec::Cpu,
        progress: ProgressMode::Hidden,
        fresh: true,
    })?;
    let c = &outcome.certificate;
    println!(
        "audit of {} ({}): {}",
        c.model.name, c.model.arch, c.headline
    );
    for part in &c.parts {
        for p in &part.protocols {
            let phases: Vec<String> = p
                .per_phase
                .iter()
                .map(|s| format!("{:.2}", s.accuracy))
                .collect();
            println!(
                "  {} {}: accuracy by phase [{}], gap {:.1} pp (95% CI {:.1}-{:.1}), \
                 flatness p = {:.3}",
                part.name,
                p.protocol,
                phases.join(" "),
                p.gap_pp,
                p.gap_ci95[0],
                p.gap_ci95[1],
                p.flatness.p_value
            );
        }
    }
    for g in &c.gates {
        println!(
            "  gate {} on {} {}: {} = {:.1} vs {:.1} -> {}",
            g.gate,
            g.part,
            g.protocol,
            g.statistic,
            g.value,
            g.threshold,
            if g.pass { "pass" } else { "fail" }
        );
    }
    println!(
        "  verdict {:?} (the CLI would exit {}); {} forwards; certificate written as {} \
         (with the report; the folder is removed now)",
        c.verdict,
        outcome.exit_code,
        c.forwards,
        outcome.json.display()
    );
    std::fs::remove_dir_all(&out).map_err(|e| Error::io(&out, e))?;
    Ok(())
}

/// A fresh folder under the system's temporary directory.
fn tempfile_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("phaselens-audit-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    Ok(dir)
}

/// Part 2: the W8/S8 design's seeds pooled as the grid frontier pools them.
fn pool_seeds(root: &Path) -> Result<()> {
    let data = root.join("notebooks-data/grids/paper");
    let summary = Table::read_arrow(data.join("grid_summary.arrow"))?;
    let frontier = Table::read_arrow(data.join("grid_frontier.arrow"))?;
    let (design, protocol) = ("w8s8", "prefix");
    // The seeds' final-query rows (the paper's single final query).
    let names = summary.utf8("design")?;
    let evals = summary.utf8("eval")?;
    let protocols = summary.utf8("protocol")?;
    let gap = summary.float64("phase_gap_pp")?;
    let (lo, hi) = (summary.float64("gap_ci_lo")?, summary.float64("gap_ci_hi")?);
    let seeds: Vec<RunEstimate> = (0..summary.num_rows())
        .filter(|&i| {
            names[i]
                .as_deref()
                .is_some_and(|d| d.starts_with("w8s8-seed"))
                && evals[i].as_deref() == Some("final")
                && protocols[i].as_deref() == Some(protocol)
        })
        .map(|i| RunEstimate {
            estimate: gap[i].unwrap_or(f64::NAN),
            ci95: (lo[i].unwrap_or(f64::NAN), hi[i].unwrap_or(f64::NAN)),
        })
        .collect();
    // The frontier's own row for the design: its gate and what the merge computed.
    let (f_design, f_protocol) = (frontier.utf8("design")?, frontier.utf8("protocol")?);
    let row = (0..frontier.num_rows())
        .find(|&i| {
            f_design[i].as_deref() == Some(design) && f_protocol[i].as_deref() == Some(protocol)
        })
        .ok_or_else(|| Error::Other(format!("no frontier row for {design} {protocol}")))?;
    let cell = |col: &str| -> Result<f64> {
        frontier.float64(col)?[row].ok_or_else(|| Error::Other(format!("{col}: null")))
    };
    let gate_pp = cell("max_gap_pp")?;
    // The grid's `[eval] bootstrap_reps` (default) and the frontier's fixed seed.
    let ci = runs_mean_ci(
        &seeds,
        (0.0, 100.0),
        DEFAULT_REPS,
        FRONTIER_SEED,
        DEFAULT_LEVEL,
    )?;
    let verdict = Verdict::of_gap((ci.lo, ci.hi), gate_pp);
    println!(
        "{design} over {} seeds ({protocol} padding): mean gap {:.1} pp, seed-bootstrap 95% CI \
         {:.1}-{:.1} -> {} against a {gate_pp} pp gate",
        seeds.len(),
        ci.estimate,
        ci.lo,
        ci.hi,
        verdict.name()
    );
    let merged = (cell("gap_ci_lo")?, cell("gap_ci_hi")?);
    if merged != (ci.lo, ci.hi) {
        return Err(Error::Other(format!(
            "grid_frontier.arrow holds {merged:?}, recomputed {:?}",
            (ci.lo, ci.hi)
        )));
    }
    println!("  the same interval as grid_frontier.arrow");
    Ok(())
}
