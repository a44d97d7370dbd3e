//! The audit's report (`report.md` + `report.html`) and figures (`figures/`), drawn
//! from the certificate alone.

use std::path::{Path, PathBuf};

use crate::error::Result;
use crate::output::{BandSeries, Headline, LinePlotSpec, Report, line_with_bands};

use super::certificate::{Certificate, Verdict};
use super::measure::PartResult;

fn pct(v: f64) -> String {
    if v.is_finite() {
        format!("{:.1}", 100.0 * v)
    } else {
        "n/a".into()
    }
}

/// Accuracy by phase (or shift), one line per protocol, Wilson bands.
fn accuracy_figure(part: &PartResult, dir: &Path) -> Result<crate::output::FigureFiles> {
    let series = part
        .protocols
        .iter()
        .map(|p| BandSeries {
            name: p.protocol.replace('_', " "),
            x: p.per_phase.iter().map(|s| f64::from(s.phase)).collect(),
            y: p.per_phase.iter().map(|s| s.accuracy).collect(),
            lo: p.per_phase.iter().map(|s| s.ci95[0]).collect(),
            hi: p.per_phase.iter().map(|s| s.ci95[1]).collect(),
        })
        .collect();
    let what = if part.phased && part.offset > 0 {
        format!(
            "phase ((target key position - {}) mod {})",
            part.offset, part.period
        )
    } else if part.phased {
        format!("phase (target key position mod {})", part.period)
    } else {
        format!("shift (prefix pads, 0..{})", part.period - 1)
    };
    Ok(line_with_bands(
        dir.join(format!("accuracy_{}", part.name)),
        &LinePlotSpec {
            series,
            title: format!(
                "{}: top-1 accuracy by {}",
                part.name,
                what.split(' ').next().unwrap_or("phase")
            ),
            x_label: what,
            y_label: "accuracy (95% Wilson CI)".into(),
            y_range: Some((0.0, 1.0)),
            size: None,
        },
    )?)
}

/// The filler probe's `P(correct) - P(distractor)` by `L mod P`.
fn filler_figure(part: &PartResult, dir: &Path) -> Result<Option<crate::output::FigureFiles>> {
    let Some(f) = &part.filler else {
        return Ok(None);
    };
    let r = &f.by_residue;
    let band = |i: usize| {
        r.iter()
            .map(|s| s.ci95.map_or(f64::NAN, |c| c[i]))
            .collect()
    };
    let series = vec![BandSeries {
        name: "P(correct) - P(distractor)".into(),
        x: r.iter().map(|s| f64::from(s.residue)).collect(),
        y: r.iter().map(|s| s.prob_diff).collect(),
        lo: band(0),
        hi: band(1),
    }];
    Ok(Some(line_with_bands(
        dir.join(format!("filler_{}", part.name)),
        &LinePlotSpec {
            series,
            title: format!("{}: filler-length flip probe", part.name),
            x_label: format!("filler length L mod {}", part.period),
            y_label: "P(correct) - P(distractor)".into(),
            y_range: Some((-1.0, 1.0)),
            size: None,
        },
    )?))
}

/// The per-phase table of one part.
fn phase_table(report: &mut Report, part: &PartResult) {
    let what = if part.phased { "phase" } else { "shift" };
    let mut header = vec![what.to_string()];
    header.extend(
        part.protocols
            .iter()
            .map(|p| format!("{} accuracy % [95% CI] (n)", p.protocol)),
    );
    let rows = (0..part.period)
        .map(|r| {
            let mut row = vec![r.to_string()];
            for p in &part.protocols {
                let s = &p.per_phase[r];
                row.push(format!(
                    "{} [{}, {}] ({})",
                    pct(s.accuracy),
                    pct(s.ci95[0]),
                    pct(s.ci95[1]),
                    s.n
                ));
            }
            row
        })
        .collect();
    report.table(format!("Accuracy by {what}"), header, rows);
}

/// The long-context table of one part (if any).
fn long_table(report: &mut Report, part: &PartResult) {
    if part.long_context.is_empty() {
        return;
    }
    let ci = |c: Option<[f64; 2]>, scale: f64| {
        c.map_or("n/a".to_string(), |c| {
            format!("[{:.1}, {:.1}]", scale * c[0], scale * c[1])
        })
    };
    let rows = part
        .long_context
        .iter()
        .map(|l| {
            vec![
                l.length.to_string(),
                l.protocol.clone(),
                format!("{} {}", pct(l.mean_accuracy), ci(l.mean_ci95, 100.0)),
                l.worst_phase.map_or("n/a".into(), |w| w.to_string()),
                format!("{:.1} {}", l.gap_pp, ci(l.gap_ci95, 1.0)),
            ]
        })
        .collect();
    let header = [
        "length",
        "protocol",
        "mean accuracy % [CI]",
        "worst phase",
        "gap pp [CI]",
    ]
    .map(String::from)
    .to_vec();
    report.table(
        "Long-context haystacks (needle depths 0.1, 0.5, 0.9; 95% cluster-bootstrap CIs, selection-adjusted for the gap)",
        header,
        rows,
    );
}

/// The headlines of one part.
fn part_headlines(part: &PartResult) -> Vec<Headline> {
    let what = if part.phased { "phase" } else { "shift" };
    let mut h = Vec::new();
    for p in &part.protocols {
        h.push(
            Headline::new(
                format!("{} gap", p.protocol),
                format!("{:.1} pp", p.gap_pp),
            )
            .with_detail(format!(
                "selection-adjusted 95% CI [{:.1}, {:.1}]; worst {what} {} at {}% [{}, {}]; mean {}% [{}, {}]; flatness permutation p = {:.4} ({} permutations)",
                p.gap_ci95[0], p.gap_ci95[1], p.worst_phase, pct(p.worst_accuracy),
                pct(p.worst_ci95[0]), pct(p.worst_ci95[1]), pct(p.mean_accuracy),
                pct(p.mean_ci95[0]), pct(p.mean_ci95[1]), p.flatness.p_value, p.flatness.permutations
            )),
        );
    }
    let s = &part.shift_invariance;
    h.push(
        Headline::new("shift-invariance flip rate", format!("{}%", pct(s.flip_rate))).with_detail(
            format!(
                "{} of {} logical examples answered right at some of the {} shifts and wrong at others; 95% Wilson CI [{}, {}]",
                s.flipping, s.n_logical, s.shifts, pct(s.ci95[0]), pct(s.ci95[1])
            ),
        ),
    );
    if let Some(f) = &part.filler {
        h.push(
            Headline::new("filler probe swing", format!("{:.3}", f.swing)).with_detail(format!(
                "max - min over L mod {} of mean P(correct) - P(distractor), L = {}..={}, {} instances; wrong answer on top at residues {:?}",
                part.period, f.lengths[0], f.lengths[1], f.instances, f.wrong_on_top_residues
            )),
        );
    }
    h
}

/// The verdict section: every gate.
fn gates_section(report: &mut Report, c: &Certificate) {
    let verdict = match c.verdict {
        Verdict::Pass => "PASS: every gate passed".to_string(),
        Verdict::Fail => format!(
            "FAIL: {} of {} gate checks failed (exit code {})",
            c.gates.iter().filter(|g| !g.pass).count(),
            c.gates.len(),
            c.exit_code
        ),
        Verdict::NoGates => "no gate set: measurement only (exit code 0)".to_string(),
    };
    report.section("Verdict").paragraph(verdict);
    if !c.gates.is_empty() {
        let rows = c
            .gates
            .iter()
            .map(|g| {
                vec![
                    g.gate.clone(),
                    g.part.clone(),
                    g.protocol.clone(),
                    g.statistic.clone(),
                    format!("{:.4}", g.value),
                    format!("{}", g.threshold),
                    if g.pass { "pass" } else { "FAIL" }.into(),
                ]
            })
            .collect();
        let header = [
            "gate",
            "part",
            "protocol",
            "statistic",
            "value",
            "threshold",
            "result",
        ]
        .map(String::from)
        .to_vec();
        report.table("Gates", header, rows);
    }
}

/// The geometry paragraph.
fn geometry_text(c: &Certificate) -> String {
    let g = &c.geometry;
    let mut s = if let Some(o) = &c.model.compression {
        let offset = c.parts.first().map_or(0, |p| p.offset);
        format!(
            "Compression overlay (applied at load, not trained with the model): {o}. Audited periods {:?}; a target key's phase is (position - {offset}) mod P, on the overlay's block grid.",
            c.parts.iter().map(|p| p.period).collect::<Vec<_>>()
        )
    } else if g.compressed {
        format!(
            "Compression strides {:?}; audited periods {:?}.",
            g.strides,
            c.parts.iter().map(|p| p.period).collect::<Vec<_>>()
        )
    } else {
        "No chunked compression: the model has no phase. The audit ran the shift-invariance test only (the same prompts shifted by 0..P-1 prefix pads); the gates apply to accuracy by shift.".to_string()
    };
    for k in &c.skipped_strides {
        s.push_str(&format!(" Stride {} not audited: {}.", k.stride, k.reason));
    }
    s
}

/// Write `report.md`, `report.html` and `figures/` into `out`; the Markdown path.
pub fn write(c: &Certificate, out: &Path) -> Result<PathBuf> {
    let figs = out.join("figures");
    let mut r = Report::new(format!("phaselens audit: {}", c.model.name));
    r.paragraph(format!(
        "Model `{}` ({}, {} layers, vocabulary {}), audited {} with phaselens {} in {:.0} s ({} forward passes, {} logical examples per phase). Certificate: `audit.json` (schema {} v{}).",
        c.model.path, c.model.arch, c.model.n_layers, c.model.vocab_size, c.created_utc,
        c.phaselens_version, c.seconds, c.forwards, c.sizing.n_logical, c.schema, c.schema_version
    ));
    r.paragraph(geometry_text(c));
    gates_section(&mut r, c);
    r.section("Headline").paragraph(c.headline.clone());
    for part in &c.parts {
        r.section(format!("{} ({})", part.name, part.why));
        r.headlines(part_headlines(part));
        phase_table(&mut r, part);
        long_table(&mut r, part);
        let f = accuracy_figure(part, &figs)?;
        r.figure_files(format!("{}: accuracy with 95% Wilson bands", part.name), &f);
        if let Some(f) = filler_figure(part, &figs)? {
            r.figure_files(
                format!("{}: filler probe, 95% cluster-bootstrap bands", part.name),
                &f,
            );
        }
        for n in &part.notes {
            r.paragraph(format!("Note: {n}"));
        }
    }
    r.section("How to read this").paragraph(
        "Every logical example is rendered once at every phase (matched groups). The phase gap is the best minus the worst phase's accuracy; its interval is a selection-adjusted cluster bootstrap over logical examples. The flatness test permutes each example's outcomes across phases (p < 0.05: the profile is not flat). Under prefix padding the renderings of one example are the same prompt shifted by 0..P-1 pads, so the flip rate is the shift-invariance test. Worst-phase intervals are Wilson intervals of that phase, not adjusted for having chosen it.",
    );
    let files = r.write(out)?;
    Ok(files.markdown)
}
