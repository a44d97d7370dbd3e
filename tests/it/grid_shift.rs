//! The grid-shift test: its statistics on synthetic clusters (an exactly rolled profile
//! is found with confidence near 1, unrelated profiles give an r(D) interval covering
//! 0), `phaselens grid-shift` on synthetic per-example tables with its errors, and the
//! per-example table phase-sweep writes.

use std::path::Path;
use std::process::{Command, Output};

use phaselens::analysis::PhaseCluster;
use phaselens::analysis::grid_shift::{
    PairedExample, best_shift, grid_shift, pearson, roll, shift_correlations,
};
use phaselens::output::{Table, read_phase_accuracy_rows};
use phaselens::runner::kinds::phase_sweep::examples::{
    EXAMPLES_COLUMNS, ExampleRow, examples_table, read_examples,
};
use phaselens::runner::run_experiment;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::common::runner::{experiment, opts, organism, tiny};

const P: usize = 8;

/// A profile with a clear phase effect.
const PROFILE: [f64; P] = [0.9, 0.8, 0.75, 0.3, 0.15, 0.2, 0.55, 0.85];

/// `n` examples' outcomes at every phase, drawn with probability `profile[r]`.
fn outcomes(n: usize, profile: &[f64], seed: u64) -> Vec<Vec<bool>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| profile.iter().map(|&q| rng.random_bool(q)).collect())
        .collect()
}

/// Each example's outcomes rolled by `d` phases (phase r takes phase r - d's outcome).
fn rolled(o: &[Vec<bool>], d: usize) -> Vec<Vec<bool>> {
    o.iter()
        .map(|v| (0..P).map(|r| v[(r + P - d) % P]).collect())
        .collect()
}

fn pairs(a: &[Vec<bool>], b: &[Vec<bool>]) -> Vec<PairedExample> {
    a.iter()
        .zip(b)
        .map(|(x, y)| PairedExample {
            a: PhaseCluster::from_correct(x),
            b: PhaseCluster::from_correct(y),
        })
        .collect()
}

#[test]
fn roll_pearson_and_best_shift() {
    assert_eq!(roll(&[0.0, 1.0, 2.0, 3.0], 1), vec![3.0, 0.0, 1.0, 2.0]);
    assert_eq!(roll(&[0.0, 1.0, 2.0, 3.0], 0), vec![0.0, 1.0, 2.0, 3.0]);
    assert!((pearson(&[1.0, 2.0, 3.0], &[3.0, 5.0, 7.0]) - 1.0).abs() < 1e-12);
    assert!((pearson(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12);
    assert!(pearson(&[1.0, 1.0, 1.0], &[1.0, 2.0, 3.0]).is_nan());
    let b = roll(&PROFILE, 3);
    let r = shift_correlations(&PROFILE, &b);
    assert_eq!(r.len(), P);
    assert!((r[3] - 1.0).abs() < 1e-12, "{r:?}");
    assert_eq!(best_shift(&r), Some(3));
    assert_eq!(best_shift(&[f64::NAN, f64::NAN]), None);
    // Ties go to the smallest k.
    assert_eq!(best_shift(&[0.5, 0.9, 0.9]), Some(1));
}

#[test]
fn exactly_rolled_profile_is_found_with_confidence() {
    for d in [3, 4] {
        let a = outcomes(40, &PROFILE, 7);
        let g = grid_shift(&pairs(&a, &rolled(&a, d)), d, 2000, 1, 0.95).unwrap();
        assert_eq!((g.period, g.offset, g.n_examples), (P, d, 40));
        assert_eq!(g.best_k, Some(d));
        // Paired resamples: B's profile is A's rolled in every replicate.
        assert!(g.r_offset().estimate > 1.0 - 1e-9, "{:?}", g.r_offset());
        assert!(g.r_offset().lo > 1.0 - 1e-9, "{:?}", g.r_offset());
        assert!(g.r_diff.lo > 0.5, "{:?}", g.r_diff);
        assert!(g.p_best_is_offset() > 0.99, "{}", g.p_best_is_offset());
        let total: f64 = g.best_k_fraction.iter().sum();
        assert!(total <= 1.0 + 1e-12 && total > 0.99, "{total}");
        // The profiles' intervals hold their estimates.
        for c in g.profile_a.iter().chain(&g.profile_b) {
            assert!(c.lo <= c.estimate && c.estimate <= c.hi, "{c:?}");
        }
        for r in 0..P {
            let (ea, eb) = (
                g.profile_a[(r + P - d) % P].estimate,
                g.profile_b[r].estimate,
            );
            assert!((ea - eb).abs() < 1e-12);
        }
    }
}

#[test]
fn noisy_rolled_profile_keeps_its_shift() {
    // B: new draws from the rolled profile (not the same outcomes): still D.
    let a = outcomes(64, &PROFILE, 11);
    let b = outcomes(64, &roll(&PROFILE, 4), 12);
    let g = grid_shift(&pairs(&a, &b), 4, 2000, 2, 0.95).unwrap();
    assert_eq!(g.best_k, Some(4));
    assert!(g.r_offset().lo > 0.3, "{:?}", g.r_offset());
    assert!(g.r_diff.lo > 0.0, "{:?}", g.r_diff);
    assert!(g.p_best_is_offset() > 0.8, "{}", g.p_best_is_offset());
}

#[test]
fn unrelated_profiles_cover_zero() {
    let flat = [0.5; P];
    for seed in [21, 22, 23] {
        let a = outcomes(40, &flat, seed);
        let b = outcomes(40, &flat, seed + 100);
        let g = grid_shift(&pairs(&a, &b), 4, 2000, 3, 0.95).unwrap();
        let c = g.r_offset();
        assert!(c.lo < 0.0 && 0.0 < c.hi, "seed {seed}: {c:?}");
        assert!(g.r_diff.lo < 0.0 && 0.0 < g.r_diff.hi, "{:?}", g.r_diff);
        assert!(g.p_best_is_offset() < 0.5, "{}", g.p_best_is_offset());
    }
}

#[test]
fn the_bootstrap_is_deterministic_and_uses_reps() {
    let a = outcomes(32, &PROFILE, 5);
    let b = outcomes(32, &roll(&PROFILE, 2), 6);
    let ex = pairs(&a, &b);
    let g1 = grid_shift(&ex, 2, 500, 9, 0.95).unwrap();
    assert_eq!(g1, grid_shift(&ex, 2, 500, 9, 0.95).unwrap());
    assert_eq!(g1.r[0].reps, 500);
    assert_ne!(g1.r, grid_shift(&ex, 2, 500, 10, 0.95).unwrap().r);
}

#[test]
fn statistic_errors() {
    let a = outcomes(8, &PROFILE, 1);
    let ex = pairs(&a, &a);
    assert!(grid_shift(&[], 0, 10, 0, 0.95).is_err());
    let e = grid_shift(&ex, P, 10, 0, 0.95).unwrap_err().to_string();
    assert!(e.contains("offset"), "{e}");
    assert!(grid_shift(&ex, 1, 0, 0, 0.95).is_err());
    assert!(grid_shift(&ex, 1, 10, 0, 1.5).is_err());
    // A phase that run B never observed.
    let mut holes = ex.clone();
    for e in &mut holes {
        let mut v: Vec<f64> = e.b.sums().to_vec();
        v[5] = f64::NAN;
        e.b = PhaseCluster::from_values(&v);
    }
    let e = grid_shift(&holes, 1, 10, 0, 0.95).unwrap_err().to_string();
    assert!(e.contains("run B") && e.contains("found 7"), "{e}");
    // Different numbers of phases.
    let mut mixed = ex.clone();
    mixed[3].b = PhaseCluster::from_correct(&[true; 4]);
    assert!(grid_shift(&mixed, 1, 10, 0, 0.95).is_err());
}

// ---- `phaselens grid-shift` on synthetic per-example tables ----

/// An experiment TOML as a phase sweep records it (`seed`, `n_logical`, `period` and
/// the select overlay's grid `offset` vary).
fn toml(offset: usize, seed: u64, n: usize, period: usize) -> String {
    format!(
        "[experiment]\nkind = \"phase-sweep\"\n\n[model]\npath = \"models:m.gguf\"\nname = \"m\"\n\
         compression = {{ kind = \"select\", block = {period}, top_k = 2, window = 8, offset = {offset} }}\n\n\
         [task]\nkind = \"passkey\"\nvocab = {{ kind = \"hugging_face\", tokenizer = \"models:m.gguf\", pad = \"<pad>\" }}\n\
         period = {period}\nn_logical = {n}\nseed = {seed}\n\n[sweep]\nprotocols = [\"prefix_padding\"]\n"
    )
}

/// Write `<data>/<name>/m/examples.arrow` of `outcomes` (rows: examples; columns: phases).
fn write_run(data: &Path, name: &str, outcomes: &[Vec<bool>], text: &str) {
    let p = outcomes[0].len();
    let rows: Vec<ExampleRow> = outcomes
        .iter()
        .enumerate()
        .flat_map(|(l, v)| {
            v.iter().enumerate().map(move |(r, &c)| ExampleRow {
                model: "m".into(),
                protocol: "prefix".into(),
                phase: r as u32,
                logical: l as u64,
                correct: c,
                ld: Some(if c { 1.0 } else { -1.0 } + 0.01 * (l + r) as f64),
            })
        })
        .collect();
    let path = data.join(name).join("m").join("examples.arrow");
    examples_table(&rows, p)
        .with_provenance(text)
        .write_arrow(&path)
        .unwrap();
}

fn grid_shift_cli(root: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .arg("grid-shift")
        .args(args)
        .arg("--data-dir")
        .arg(root.join("data"))
        .arg("--reports-dir")
        .arg(root.join("reports"))
        .output()
        .unwrap()
}

/// The `value` of the `grid_shift/v1` row (measure, statistic, k).
fn value(t: &Table, measure: &str, statistic: &str, k: i64) -> f64 {
    let (m, s, kk, v) = (
        t.utf8("measure").unwrap(),
        t.utf8("statistic").unwrap(),
        t.int64("k").unwrap(),
        t.float64("value").unwrap(),
    );
    (0..t.num_rows())
        .find(|&i| {
            m[i].as_deref() == Some(measure)
                && s[i].as_deref() == Some(statistic)
                && kk[i] == Some(k)
        })
        .and_then(|i| v[i])
        .unwrap_or_else(|| panic!("no row {measure} {statistic} k = {k}"))
}

#[test]
fn cli_finds_the_shift_from_the_overlay_offsets() {
    let dir = tempfile::tempdir().unwrap();
    let (root, data) = (dir.path(), dir.path().join("data"));
    let a = outcomes(24, &PROFILE, 3);
    write_run(&data, "syn", &a, &toml(0, 46, 24, P));
    write_run(&data, "syn-shift4", &rolled(&a, 4), &toml(4, 46, 24, P));
    let o = grid_shift_cli(root, &["syn", "syn-shift4", "--reps", "300"]);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains("D = 4") && out.contains("| accuracy | 1.00 [1.00, 1.00]"),
        "{out}"
    );
    let t = Table::read_arrow(data.join("grid-shift/syn--syn-shift4.arrow")).unwrap();
    assert_eq!(t.metadata()["phaselens.schema"], "grid_shift/v1");
    assert_eq!(t.metadata()["phaselens.grid_shift.offset"], "4");
    assert!(value(&t, "accuracy", "r", 4) > 1.0 - 1e-9);
    assert!(value(&t, "accuracy", "p_best_k", 4) > 0.99);
    assert!(value(&t, "accuracy", "r_offset_minus_r0", 4) > 0.5);
    assert_eq!(
        value(&t, "accuracy", "best_k", 4),
        value(&t, "accuracy", "r", 4)
    );
    // The logit differences are rolled too: a second measure.
    assert!(value(&t, "logit_diff", "r", 4) > 0.9);
    assert!(data.join("grid-shift/syn--syn-shift4.parquet").is_file());
    let md = std::fs::read_to_string(root.join("reports/grid-shift/syn--syn-shift4.md")).unwrap();
    assert!(
        md.contains("A rolled by D = 4") && md.contains("P(best k = D)"),
        "{md}"
    );
    // --offset overrides the overlays' (here a wrong shift: r(2) is not 1).
    let o = grid_shift_cli(
        root,
        &["syn", "syn-shift4", "--reps", "50", "--offset", "2"],
    );
    assert!(o.status.success());
    let t = Table::read_arrow(data.join("grid-shift/syn--syn-shift4.arrow")).unwrap();
    assert_eq!(t.metadata()["phaselens.grid_shift.offset"], "2");
    assert!(value(&t, "accuracy", "p_best_k", 2) < 0.1);
}

/// Runs the command on `a` and `b` and returns its error message (it must fail).
fn failure(root: &Path, a: &str, b: &str) -> String {
    let o = grid_shift_cli(root, &[a, b, "--reps", "20"]);
    assert!(!o.status.success(), "{a} {b} succeeded");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn cli_errors_name_the_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let (root, data) = (dir.path(), dir.path().join("data"));
    let a = outcomes(16, &PROFILE, 4);
    write_run(&data, "a", &a, &toml(0, 46, 16, P));
    write_run(&data, "seed", &a, &toml(4, 47, 16, P));
    write_run(&data, "fewer", &a[..8], &toml(4, 46, 16, P));
    let short: Vec<Vec<bool>> = a.iter().map(|v| v[..4].to_vec()).collect();
    write_run(&data, "period", &short, &toml(2, 46, 16, 4));
    let e = failure(root, "a", "seed");
    assert!(
        e.contains("[task] seed") && e.contains("46") && e.contains("47"),
        "{e}"
    );
    assert!(e.contains("seed/m/examples.arrow"), "{e}");
    let e = failure(root, "a", "period");
    assert!(
        e.contains("different periods") && e.contains("period/m/examples.arrow"),
        "{e}"
    );
    let e = failure(root, "a", "fewer");
    assert!(e.contains("example counts"), "{e}");
    // A run from before the per-example tables: rerun it.
    std::fs::create_dir_all(data.join("old/m")).unwrap();
    std::fs::write(data.join("old/m/phase_accuracy.arrow"), b"").unwrap();
    let e = failure(root, "a", "old");
    assert!(
        e.contains("examples.arrow") && e.contains("phaselens run exp/old.toml"),
        "{e}"
    );
    let e = failure(root, "a", "missing");
    assert!(e.contains("no such experiment output"), "{e}");
    // No overlay in either run and no --offset.
    let plain = toml(0, 46, 16, P).replace("compression = ", "# compression = ");
    write_run(&data, "p1", &a, &plain);
    write_run(&data, "p2", &a, &plain);
    let e = failure(root, "p1", "p2");
    assert!(e.contains("--offset"), "{e}");
}

// ---- the per-example table of phase-sweep ----

#[test]
fn phase_sweep_writes_the_per_example_table() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let org = d.join("organisms");
    std::fs::create_dir_all(&org).unwrap();
    organism(&org, "a-w4s4", &tiny(1, 2, 1, 4, 4), 1);
    let exp = experiment(
        d,
        "sweep.toml",
        "[experiment]\nkind = \"phase-sweep\"\nbootstrap_reps = 20\n[model]\norganism = \"organisms/a-w4s4\"\n[task]\nn_logical = 8\n",
    );
    run_experiment(&exp, &opts(d)).unwrap();
    let base = d.join("notebooks-data/sweep/a-w4s4");
    let path = base.join("examples.arrow");
    let t = Table::read_arrow(&path).unwrap();
    phaselens::output::validate_columns(&t, EXAMPLES_COLUMNS).unwrap();
    assert!(base.join("examples.parquet").is_file());
    let ex = read_examples(&path).unwrap();
    assert_eq!(ex.period, 4);
    assert!(ex.experiment_toml.unwrap().contains("phase-sweep"));
    // Both protocols x 4 phases x 8 logical examples, each example at every phase.
    assert_eq!(ex.rows.len(), 2 * 4 * 8);
    assert!(
        ex.rows
            .iter()
            .all(|r| r.ld.is_none() && r.model == "a-w4s4")
    );
    // The per-phase counts equal the phase_accuracy table's.
    let pa =
        read_phase_accuracy_rows(&Table::read_arrow(base.join("phase_accuracy.arrow")).unwrap())
            .unwrap();
    for row in &pa {
        let of: Vec<&ExampleRow> = ex
            .rows
            .iter()
            .filter(|r| r.protocol == row.protocol && r.phase == row.phase)
            .collect();
        assert_eq!(of.len() as u64, row.n);
        assert_eq!(of.iter().filter(|r| r.correct).count() as u64, row.correct);
        let mut ids: Vec<u64> = of.iter().map(|r| r.logical).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 8);
    }
    // A resumed run writes the same table.
    let before = d.join("before.arrow");
    std::fs::copy(&path, &before).unwrap();
    let again = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(again.stats.cells_computed, 0);
    assert_eq!(
        read_examples(&path).unwrap().rows,
        read_examples(&before).unwrap().rows
    );
}
