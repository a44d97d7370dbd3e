//! The grid merge's frontier (`src/grid/frontier.rs`): designs pooled over seeds, gap
//! against mean accuracy with sd and CIs, the gap gate's verdict, designs not trained;
//! on hand-made merged rows, and end to end through `phaselens grid merge` on
//! synthetic sweeps (no training).

use std::path::Path;

use crate::grid_common::{EVAL, grid_dir, phaselens, text};
use phaselens::analysis::{RunEstimate, runs_mean_ci};
use phaselens::grid::Grid;
use phaselens::grid::frontier::{
    CiMethod, DesignGroup, Verdict, design_groups, frontier, seed_mean_profile, strip_seed,
};
use phaselens::grid::merged::{Merged, PhaseRow, SummaryRow};
use phaselens::output::{PhaseAccuracyRow, Table, phase_accuracy_table};

/// A final-query summary row of `design` (prefix padding unless `protocol`).
fn summary(
    design: &str,
    protocol: &str,
    mean: f64,
    mean_ci: (f64, f64),
    gap: f64,
    gap_ci: (f64, f64),
    worst: i64,
) -> SummaryRow {
    SummaryRow {
        design: design.into(),
        eval: "final".into(),
        n_bindings: 6,
        query_slot: 1,
        protocol: protocol.into(),
        period: 4,
        mean_accuracy: mean,
        mean_ci,
        gap_pp: gap,
        gap_ci,
        best_phase: 0,
        worst_phase: worst,
        worst_accuracy: f64::NAN,
        steps: Some(12),
        batch_accuracy: None,
    }
}

fn phases(design: &str, protocol: &str, acc: &[f64]) -> Vec<PhaseRow> {
    acc.iter()
        .enumerate()
        .map(|(r, &a)| PhaseRow {
            design: design.into(),
            eval: "final".into(),
            n_bindings: 6,
            query_slot: 1,
            protocol: protocol.into(),
            phase: r as i64,
            n: 64,
            accuracy: a,
            wilson_lo: a - 0.05,
            wilson_hi: a + 0.05,
        })
        .collect()
}

fn group(label: &str, members: &[&str]) -> DesignGroup {
    DesignGroup {
        label: label.into(),
        members: members.iter().map(|s| s.to_string()).collect(),
    }
}

/// Three designs: `a` with three seeds (large gaps), `b` with one of three seeds
/// (flat), `c` with none.
fn merged() -> (Vec<DesignGroup>, Merged) {
    let groups = vec![
        group("a", &["a-seed0", "a-seed1", "a-seed2"]),
        group("b", &["b-seed0", "b-seed1", "b-seed2"]),
        group("c", &["c-seed0", "c-seed1", "c-seed2"]),
    ];
    let summary = vec![
        summary(
            "a-seed0",
            "prefix",
            0.50,
            (0.45, 0.55),
            40.0,
            (30.0, 50.0),
            3,
        ),
        summary(
            "a-seed1",
            "prefix",
            0.60,
            (0.55, 0.65),
            50.0,
            (40.0, 60.0),
            3,
        ),
        summary(
            "a-seed2",
            "prefix",
            0.70,
            (0.65, 0.75),
            30.0,
            (20.0, 40.0),
            1,
        ),
        summary("b-seed0", "prefix", 0.90, (0.88, 0.92), 2.0, (0.0, 4.5), 2),
    ];
    let mut ph = Vec::new();
    ph.extend(phases("a-seed0", "prefix", &[0.7, 0.6, 0.5, 0.3]));
    ph.extend(phases("a-seed1", "prefix", &[0.8, 0.7, 0.6, 0.3]));
    ph.extend(phases("a-seed2", "prefix", &[0.9, 0.6, 0.7, 0.7]));
    ph.extend(phases("b-seed0", "prefix", &[0.9, 0.91, 0.89, 0.9]));
    let m = Merged {
        phases: ph,
        summary,
        designs: vec!["a-seed0", "a-seed1", "a-seed2", "b-seed0"]
            .into_iter()
            .map(String::from)
            .collect(),
        progress: Vec::new(),
        groups: groups.clone(),
        frontier: Vec::new(),
    };
    (groups, m)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn frontier_pools_seeds_with_mean_sd_and_ci() {
    let (groups, m) = merged();
    let rows = frontier(&groups, &m, 5.0, 2000);
    // `c` has no merged seed: no point.
    let names: Vec<&str> = rows.iter().map(|r| r.design.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    let a = &rows[0];
    assert_eq!(a.protocol, "prefix");
    assert_eq!(a.seeds(), 3);
    assert_eq!(a.seeds_total, 3);
    assert!(close(a.mean_accuracy, 0.6), "{}", a.mean_accuracy);
    assert!(close(a.gap_pp, 40.0), "{}", a.gap_pp);
    // Sample sd (n - 1): means 0.5, 0.6, 0.7 -> 0.1; gaps 40, 50, 30 -> 10.
    assert!(close(a.mean_sd.unwrap(), 0.1), "{:?}", a.mean_sd);
    assert!(close(a.gap_sd.unwrap(), 10.0), "{:?}", a.gap_sd);
    assert_eq!(a.ci_method, CiMethod::SeedBootstrap);
    // The interval holds the point and lies within the seeds' own intervals.
    assert!(a.gap_ci.0 < 40.0 && 40.0 < a.gap_ci.1, "{:?}", a.gap_ci);
    assert!(a.gap_ci.0 > 20.0 && a.gap_ci.1 < 60.0, "{:?}", a.gap_ci);
    assert!(a.mean_ci.0 < 0.6 && 0.6 < a.mean_ci.1, "{:?}", a.mean_ci);
    assert!(a.mean_ci.0 > 0.45 && a.mean_ci.1 < 0.75, "{:?}", a.mean_ci);
    assert_eq!(a.verdict, Verdict::Fail);
    // Worst phase of the seed-mean profile (0.8, 0.633, 0.6, 0.433): phase 3, though
    // one seed's worst is phase 1.
    assert_eq!(a.worst_phase, 3);
    assert!(close(a.worst_accuracy, (0.3 + 0.3 + 0.7) / 3.0));
    assert_eq!(a.seed_worst_phases, [3, 3, 1]);
    // One seed: no sd, the sweep's own CI, passes the 5 pp gate (upper bound 4.5).
    let b = &rows[1];
    assert_eq!(b.seeds(), 1);
    assert_eq!(b.seeds_total, 3);
    assert_eq!(b.members, ["b-seed0"]);
    assert_eq!((b.mean_sd, b.gap_sd), (None, None));
    assert_eq!(b.ci_method, CiMethod::Sweep);
    assert_eq!(b.gap_ci, (0.0, 4.5));
    assert_eq!(b.mean_ci, (0.88, 0.92));
    assert_eq!(b.verdict, Verdict::Pass);
    assert_eq!(b.worst_phase, 2);
    // A tighter gate makes `b` inconclusive; the computation is reproducible.
    let tight = frontier(&groups, &m, 3.0, 2000);
    assert_eq!(tight[1].verdict, Verdict::Inconclusive);
    assert_eq!(tight[0].gap_ci, a.gap_ci);
}

#[test]
fn seed_mean_profile_averages_the_seeds_phase_by_phase() {
    let (_, m) = merged();
    let members: Vec<String> = ["a-seed0", "a-seed2"].map(String::from).to_vec();
    let p = seed_mean_profile(&m, &members, "prefix");
    let want = [(0, 0.8), (1, 0.6), (2, 0.6), (3, 0.5)];
    assert_eq!(p.len(), 4);
    for ((ph, acc), (wph, wacc)) in p.iter().zip(want) {
        assert_eq!(*ph, wph);
        assert!(close(*acc, wacc), "phase {ph}: {acc}");
    }
    assert!(seed_mean_profile(&m, &members, "in-sequence").is_empty());
}

#[test]
fn verdicts_follow_the_gap_ci_against_the_gate() {
    assert_eq!(Verdict::of_gap((0.0, 5.0), 5.0), Verdict::Pass);
    assert_eq!(Verdict::of_gap((0.0, 5.1), 5.0), Verdict::Inconclusive);
    assert_eq!(Verdict::of_gap((5.0, 9.0), 5.0), Verdict::Inconclusive);
    assert_eq!(Verdict::of_gap((5.1, 9.0), 5.0), Verdict::Fail);
    assert_eq!(
        Verdict::of_gap((f64::NAN, f64::NAN), 5.0),
        Verdict::Inconclusive
    );
    use Verdict::*;
    assert_eq!(Verdict::overall(&[Pass, Pass]), Some(Pass));
    assert_eq!(Verdict::overall(&[Pass, Inconclusive]), Some(Inconclusive));
    assert_eq!(Verdict::overall(&[Inconclusive, Fail]), Some(Fail));
    assert_eq!(Verdict::overall(&[]), None);
}

#[test]
fn runs_mean_ci_is_the_seed_mean_with_both_noises() {
    let run = |estimate, lo, hi| RunEstimate {
        estimate,
        ci95: (lo, hi),
    };
    // No noise at either level: a point.
    let same = [run(0.4, 0.4, 0.4), run(0.4, 0.4, 0.4)];
    let c = runs_mean_ci(&same, (0.0, 1.0), 500, 1, 0.95).unwrap();
    assert!(
        close(c.estimate, 0.4) && close(c.lo, 0.4) && close(c.hi, 0.4),
        "{c:?}"
    );
    // Only between-seed spread: the interval stays within the seeds' values.
    let spread = [run(0.2, 0.2, 0.2), run(0.4, 0.4, 0.4), run(0.6, 0.6, 0.6)];
    let c = runs_mean_ci(&spread, (0.0, 1.0), 2000, 1, 0.95).unwrap();
    assert!(close(c.estimate, 0.4));
    assert!(
        c.lo >= 0.2 - 1e-12 && c.hi <= 0.6 + 1e-12 && c.lo < 0.35 && c.hi > 0.45,
        "{c:?}"
    );
    // Only within-seed noise: about the CI of a mean of two independent estimates
    // (half-width 10 / sqrt 2 ~ 7.1 pp), clamped at the bound.
    let noisy = [run(50.0, 40.0, 60.0), run(50.0, 40.0, 60.0)];
    let c = runs_mean_ci(&noisy, (0.0, 100.0), 4000, 3, 0.95).unwrap();
    assert!(
        (c.hi - 50.0 - 7.07).abs() < 1.0 && (50.0 - c.lo - 7.07).abs() < 1.0,
        "{c:?}"
    );
    let top = [run(99.0, 90.0, 100.0), run(98.0, 89.0, 100.0)];
    let c = runs_mean_ci(&top, (0.0, 100.0), 1000, 3, 0.95).unwrap();
    assert!(c.hi <= 100.0 && c.lo < 98.5, "{c:?}");
    // Reproducible; errors on bad input.
    assert_eq!(runs_mean_ci(&top, (0.0, 100.0), 1000, 3, 0.95).unwrap(), c);
    assert!(runs_mean_ci(&[], (0.0, 1.0), 10, 0, 0.95).is_err());
    assert!(runs_mean_ci(&[run(f64::NAN, 0.0, 1.0)], (0.0, 1.0), 10, 0, 0.95).is_err());
}

#[test]
fn designs_group_over_seed_with_their_names_without_the_seed() {
    assert_eq!(strip_seed("w8s8-seed3", Some("3")), "w8s8");
    assert_eq!(strip_seed("seed1-kv2", Some("1")), "kv2");
    assert_eq!(strip_seed("w8s8-kv2", Some("0")), "w8s8-kv2");
    assert_eq!(strip_seed("x-seed10", Some("1")), "x-seed10");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let g = Grid::load(&repo.join("experiments/grids/mitigations.toml")).unwrap();
    let groups = design_groups(&g);
    assert_eq!(groups.len(), 16);
    assert!(groups.iter().any(|g| g.label == "stagger-kv4"));
    assert_eq!(groups[0].label, "baseline");
    assert_eq!(
        groups[0].members,
        ["baseline-seed0", "baseline-seed1", "baseline-seed2"]
    );
    assert!(groups.iter().all(|g| g.members.len() == 3));
    assert!(groups.iter().any(|g| g.label == "w9s8-kv2"));
    assert_eq!(g.max_gap_pp, 5.0);
    let g = Grid::load(&repo.join("experiments/grids/paper.toml")).unwrap();
    let groups = design_groups(&g);
    assert_eq!(groups[0].label, "w8s8");
    assert_eq!(groups[0].members.len(), 4);
    assert_eq!(groups.len(), 8);
    assert!(groups[1..].iter().all(|g| g.members.len() == 3));
    assert_eq!(groups[1].label, "w8s8-kv2");
    assert_eq!(
        groups[1].members,
        ["w8s8-kv2", "w8s8-kv2-seed1", "w8s8-kv2-seed2"]
    );
}

#[test]
fn the_gate_is_read_from_the_grid_file() {
    let gate = |line: &str| {
        let (_d, p) = grid_dir(&format!("{line}\n[[design]]\nname = \"x\"\n"));
        Grid::load(&p)
            .map(|g| g.max_gap_pp)
            .map_err(|e| e.to_string())
    };
    assert_eq!(gate(""), Ok(5.0));
    assert_eq!(gate("max_gap = \"3pp\""), Ok(3.0));
    assert_eq!(gate("max_gap = 2.5"), Ok(2.5));
    assert_eq!(gate("max_gap = 10"), Ok(10.0));
    for bad in ["max_gap = \"three\"", "max_gap = 0", "max_gap = true"] {
        let e = gate(bad).unwrap_err();
        assert!(
            e.contains("grid.toml") && e.contains("max_gap"),
            "{bad}: {e}"
        );
    }
}

/// Write a synthetic finished `final` sweep of `design` (P = 4, both protocols) into
/// the grid's data folder under `root`.
fn fake_sweep(root: &Path, design: &str, acc: [f64; 4], mean_ci: (f64, f64), gap_ci: (f64, f64)) {
    let dir = root
        .join("notebooks-data/grids/grid")
        .join(design)
        .join("final");
    std::fs::create_dir_all(dir.join(design)).unwrap();
    std::fs::write(dir.join("done.json"), "{}").unwrap();
    let mut rows = Vec::new();
    for proto in ["prefix", "in-sequence"] {
        for (r, a) in acc.iter().enumerate() {
            rows.push(PhaseAccuracyRow::new(
                design,
                proto,
                r as u32,
                100,
                (a * 100.0).round() as u64,
            ));
        }
    }
    phase_accuracy_table("phase_accuracy", &rows)
        .write_arrow(dir.join(design).join("phase_accuracy.arrow"))
        .unwrap();
    let mean = acc.iter().sum::<f64>() / 4.0;
    let (best, worst) = (0..4).fold((0, 0), |(b, w), r| {
        (
            if acc[r] > acc[b] { r } else { b },
            if acc[r] < acc[w] { r } else { w },
        )
    });
    let stats = serde_json::json!({
        "n_logical": 100,
        "mean_accuracy": mean,
        "mean_accuracy_ci95": [mean_ci.0, mean_ci.1],
        "phase_gap_pp": 100.0 * (acc[best] - acc[worst]),
        "phase_gap_ci95": [gap_ci.0, gap_ci.1],
        "best_phase": best,
        "worst_phase": worst,
    });
    let summary = serde_json::json!({
        "period": 4,
        "protocols": { "prefix_padding": stats, "in_sequence_padding": stats },
    });
    std::fs::write(
        dir.join(design).join("summary.json"),
        serde_json::to_string_pretty(&summary).unwrap(),
    )
    .unwrap();
}

#[test]
fn merge_writes_the_frontier_and_lists_designs_not_trained() {
    let (dir, _) = grid_dir(&format!(
        "[axes]\nseed = [0, 1, 2]\n[[design]]\nname = \"a\"\n\
         [[design]]\nname = \"b\"\nset = {{ W = 8 }}\n[[design]]\nname = \"c\"\nset = {{ W = 12 }}\n\
         [[design]]\nname = \"u\"\nset = {{ W = 16 }}\n{EVAL}"
    ));
    let d = dir.path();
    fake_sweep(
        d,
        "a-seed0",
        [0.9, 0.8, 0.5, 0.3],
        (0.55, 0.70),
        (50.0, 70.0),
    );
    fake_sweep(
        d,
        "a-seed1",
        [0.8, 0.8, 0.6, 0.4],
        (0.58, 0.72),
        (30.0, 50.0),
    );
    fake_sweep(
        d,
        "b-seed0",
        [0.91, 0.9, 0.9, 0.89],
        (0.88, 0.92),
        (0.0, 4.0),
    );
    // At chance: a small gap that is no mitigation.
    fake_sweep(d, "u-seed0", [0.0, 0.01, 0.0, 0.0], (0.0, 0.01), (0.0, 2.0));
    let merge = || {
        let o = phaselens(d, &["grid", "merge", "grid.toml", "--plain"], &[]);
        assert!(o.status.success(), "{}", text(&o));
        text(&o)
    };
    let out = merge();
    assert!(out.contains("merged 4 design(s)"), "{out}");
    let path = d.join("notebooks-data/grids/grid/grid_frontier.arrow");
    assert!(out.contains("grid_frontier.arrow"), "{out}");
    let t = Table::read_arrow(&path).unwrap();
    assert_eq!(t.metadata()["phaselens.schema"], "grid_frontier/v1");
    let designs: Vec<String> = t
        .utf8("design")
        .unwrap()
        .iter()
        .flatten()
        .cloned()
        .collect();
    assert_eq!(designs, ["a", "a", "b", "b", "u", "u"]);
    let protos: Vec<String> = t
        .utf8("protocol")
        .unwrap()
        .iter()
        .flatten()
        .cloned()
        .collect();
    assert_eq!(
        protos,
        [
            "prefix",
            "in-sequence",
            "prefix",
            "in-sequence",
            "prefix",
            "in-sequence"
        ]
    );
    assert_eq!(
        t.int64("seeds").unwrap(),
        &[Some(2), Some(2), Some(1), Some(1), Some(1), Some(1)]
    );
    assert_eq!(t.int64("seeds_total").unwrap(), &[Some(3); 6]);
    let gap = t.float64("phase_gap_pp").unwrap();
    assert!(close(gap[0].unwrap(), 50.0), "{gap:?}");
    let gap_sd = t.float64("phase_gap_sd").unwrap();
    assert!(close(gap_sd[0].unwrap(), 200f64.sqrt()), "{gap_sd:?}");
    assert_eq!(gap_sd[2], None, "one seed has no sd");
    let mean = t.float64("mean_accuracy").unwrap();
    assert!(close(mean[0].unwrap(), (0.625 + 0.65) / 2.0), "{mean:?}");
    assert_eq!(t.float64("gap_ci_hi").unwrap()[2], Some(4.0));
    let verdicts: Vec<String> = t
        .utf8("verdict")
        .unwrap()
        .iter()
        .flatten()
        .cloned()
        .collect();
    assert_eq!(verdicts, ["fail", "fail", "pass", "pass", "pass", "pass"]);
    let methods: Vec<String> = t
        .utf8("ci_method")
        .unwrap()
        .iter()
        .flatten()
        .cloned()
        .collect();
    assert_eq!(methods[0], "seed-bootstrap");
    assert_eq!(methods[2], "sweep");
    assert_eq!(t.int64("worst_phase").unwrap()[0], Some(3));
    assert_eq!(
        t.utf8("members").unwrap()[0].as_deref(),
        Some("a-seed0,a-seed1")
    );
    assert!(
        d.join("notebooks-data/grids/grid/grid_frontier.parquet")
            .exists()
    );
    let rep = d.join("reports/grids/grid");
    for f in [
        "frontier_prefix.png",
        "frontier_prefix.svg",
        "frontier_in-sequence.png",
        "frontier_profiles.png",
    ] {
        assert!(rep.join(f).exists(), "{f}");
    }
    let md = std::fs::read_to_string(rep.join("report.md")).unwrap();
    let row = |name: &str| {
        md.lines()
            .rfind(|l| l.starts_with(&format!("| {name} |")))
            .unwrap_or_else(|| panic!("no frontier row for {name}:\n{md}"))
            .to_string()
    };
    assert!(row("a").contains("| 2/3 | 2 of 3 seeds merged |"), "{md}");
    assert!(row("a").contains("| fail / fail | fail |"), "{md}");
    assert!(row("b").contains("| pass / pass | pass |"), "{md}");
    assert!(row("b").contains("| 0.90 (0.88-0.92) |"), "{md}");
    assert!(row("b").ends_with("| pass / pass | pass |"), "{md}");
    assert!(
        row("u").contains("| pass / pass | pass; did not learn (mean < 3x chance"),
        "{md}"
    );
    assert!(
        row("c").contains("| 0/3 | not trained (not started) |")
            && row("c").ends_with("| not trained |"),
        "{md}"
    );
    assert!(
        md.contains("3 of 4 designs measured: 2 pass, 1 fail, 0 inconclusive; 1 not trained yet."),
        "{md}"
    );
    // A re-merge writes the same frontier, byte for byte.
    let first = std::fs::read(&path).unwrap();
    merge();
    assert_eq!(std::fs::read(&path).unwrap(), first);
}
