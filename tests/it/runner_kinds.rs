//! End-to-end tests of ablate-heads, knockout, gate-profiles, gate-cycling and
//! phase-sweep on tiny random organisms, and the redraw of figures from tables.

use std::collections::BTreeMap;

use crate::common::runner::*;
use phaselens::output::{
    HeadKind, LONG_COLUMNS, LongRow, PHASE_ACCURACY_COLUMNS, Table, read_long_rows,
    read_phase_accuracy_rows, validate_columns,
};
use phaselens::runner::report::draw_all;
use phaselens::runner::run_experiment;

fn rows(path: &std::path::Path) -> Vec<LongRow> {
    let t = Table::read_arrow(path).unwrap();
    validate_columns(&t, LONG_COLUMNS).unwrap();
    assert!(path.with_extension("parquet").exists());
    read_long_rows(&t).unwrap()
}

fn head(exp_kind: &str, extra: &str) -> String {
    format!(
        "[experiment]\nkind = \"{exp_kind}\"\nbootstrap_reps = 40\n\n[model]\norganism = \"tiny\"\n\n[task]\nn_logical = 8\n{extra}"
    )
}

fn assert_files(dir: &std::path::Path, names: &[&str]) {
    for n in names {
        assert!(dir.join(n).exists(), "missing {}", dir.join(n).display());
    }
}

/// Pooled whole-model accuracy (the `accuracy` row without phase).
fn pooled(rows: &[LongRow], metric: &str) -> f64 {
    rows.iter()
        .find(|r| r.metric == metric && r.layer.is_none() && r.phase.is_none())
        .unwrap()
        .value
}

#[test]
fn ablate_heads_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    two_value_organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 11);
    let exp = experiment(d, "abl.toml", &head("ablate-heads", ""));
    let s = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(s.stats.cells_computed, 4 * 3 * 2 * 6);
    let rows = rows(&d.join("notebooks-data/abl/heads.arrow"));
    let clean = pooled(&rows, "accuracy");
    assert!(
        clean > 0.0 && clean < 1.0,
        "the test model should be partly right: {clean}"
    );
    for m in ["zero", "mean", "resample"] {
        let metric = format!("rel_change_pct_{m}");
        let cells: Vec<&LongRow> = rows.iter().filter(|r| r.metric == metric).collect();
        assert_eq!(cells.len(), 12 * 5, "{metric}");
        for r in cells.iter().filter(|r| r.phase.is_none()) {
            let acc = rows
                .iter()
                .find(|x| {
                    x.metric == format!("accuracy_{m}")
                        && x.layer == r.layer
                        && x.head == r.head
                        && x.head_kind == r.head_kind
                        && x.phase.is_none()
                })
                .unwrap();
            assert!((0.0..=1.0).contains(&acc.value));
            let want = 100.0 * (acc.value - clean) / clean;
            assert!((r.value - want).abs() < 1e-9, "{} vs {want}", r.value);
        }
    }
    // Something changes when heads are zeroed.
    assert!(
        rows.iter()
            .any(|r| r.metric == "rel_change_pct_zero" && r.value.abs() > 0.0)
    );
    assert_files(
        &d.join("reports/abl"),
        &[
            "report.md",
            "report.html",
            "accuracy_by_phase.png",
            "rel_change_pct_zero_map.png",
            "rel_change_pct_mean_map.svg",
            "rel_change_pct_zero_phase2.png",
            "specialization_index.png",
        ],
    );
}

#[test]
fn knockout_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    two_value_organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 12);
    let exp = experiment(d, "ko.toml", &head("knockout", "\n[knockout]\nband = 4\n"));
    let s = run_experiment(&exp, &opts(d)).unwrap();
    // 4 phases x (2 layers x 2 KV heads + 2 layer outputs)
    assert_eq!(s.stats.cells_computed, 4 * 6);
    let rows = rows(&d.join("notebooks-data/ko/heads.arrow"));
    let kv: Vec<&LongRow> = rows
        .iter()
        .filter(|r| r.metric == "rel_change_pct")
        .collect();
    assert_eq!(kv.len(), 4 * 5);
    assert!(kv.iter().all(|r| r.head_kind == Some(HeadKind::Kv)));
    let lo: Vec<&LongRow> = rows
        .iter()
        .filter(|r| r.metric == "layer_out_rel_change_pct")
        .collect();
    assert_eq!(lo.len(), 2 * 5);
    assert!(lo.iter().all(|r| r.head.is_none() && r.layer.is_some()));
    for r in kv.iter().chain(&lo) {
        assert!(r.value.is_nan() || r.value >= -100.0 - 1e-9, "{r:?}");
    }
    assert_files(
        &d.join("reports/ko"),
        &[
            "report.md",
            "knockout_kv.png",
            "knockout_kv.svg",
            "layer_output.png",
            "specialization_index.png",
        ],
    );
}

#[test]
fn gate_profiles_with_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = tiny(2, 4, 2, 4, 4);
    organism(d, "tiny", &cfg, 13);
    for (step, seed) in [(10, 1), (20, 2)] {
        let ck = d.join(format!("run/checkpoints/step-{step:07}"));
        phaselens::model::save_kvc(&random_model(&cfg, seed), &ck).unwrap();
    }
    let exp = experiment(
        d,
        "gates.toml",
        &head(
            "gate-profiles",
            "\n[gates]\ncheckpoints = \"run/checkpoints\"\n",
        ),
    );
    run_experiment(&exp, &opts(d)).unwrap();
    let rows = rows(&d.join("notebooks-data/gates/gates.arrow"));
    let mut models = BTreeMap::<String, usize>::new();
    for r in rows.iter().filter(|r| r.metric == "key_gate_g") {
        *models.entry(r.model.clone()).or_default() += 1;
    }
    // 2 layers x 2 KV heads x 4 offsets, for the model and both checkpoints
    assert_eq!(
        models,
        BTreeMap::from([
            ("tiny".to_string(), 16),
            ("tiny@10".to_string(), 16),
            ("tiny@20".to_string(), 16)
        ])
    );
    for g in ["key", "value"] {
        for l in 0..2u32 {
            for h in 0..2u32 {
                let at = |m: &str| {
                    rows.iter()
                        .filter(|r| {
                            r.model == "tiny"
                                && r.metric == m
                                && r.layer == Some(l)
                                && r.head == Some(h)
                        })
                        .map(|r| r.value)
                        .collect::<Vec<f64>>()
                };
                let gs = at(&format!("{g}_gate_g"));
                assert!(
                    (gs.iter().sum::<f64>() - 4.0).abs() < 1e-4,
                    "sum g = W: {gs:?}"
                );
                let mean_h = at(&format!("{g}_gate_exp_entropy_of_mean"))[0];
                let h_mean = at(&format!("{g}_gate_mean_exp_entropy"))[0];
                assert!((1.0..=4.0 + 1e-9).contains(&mean_h));
                assert!(
                    h_mean <= mean_h + 1e-6,
                    "E[exp H(a)] {h_mean} > exp H(E[a]) {mean_h}"
                );
            }
        }
    }
    assert_files(
        &d.join("reports/gates"),
        &[
            "report.md",
            "gate_g.png",
            "gate_entropy.svg",
            "gate_trajectory.png",
            "gate_profile_L0_KV0_key.png",
        ],
    );
}

#[test]
fn gate_cycling_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    two_value_organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 14);
    // Rolling a 4-offset window by 4 is the identity: observed = baseline, MAE = 0.
    let exp = experiment(
        d,
        "cyc.toml",
        &head("gate-cycling", "\n[cycling]\ndeltas = [-1, 1, 4]\n"),
    );
    let s = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(s.stats.cells_computed, 4 * 3);
    let rows = rows(&d.join("notebooks-data/cyc/cycling.arrow"));
    let per_phase = |m: &str| {
        let mut v: Vec<(u32, f64)> = rows
            .iter()
            .filter(|r| r.metric == m && r.phase.is_some())
            .map(|r| (r.phase.unwrap(), r.value))
            .collect();
        v.sort_by_key(|x| x.0);
        v
    };
    assert_eq!(per_phase("cycling_observed_d+4"), per_phase("accuracy"));
    assert_eq!(per_phase("cycling_predicted_d+4"), per_phase("accuracy"));
    let mae4 = rows.iter().find(|r| r.metric == "cycling_mae_d+4").unwrap();
    assert_eq!(mae4.value, 0.0);
    // predicted(r) = baseline(r - delta)
    let base = per_phase("accuracy");
    let pred = per_phase("cycling_predicted_d+1");
    for (r, v) in pred {
        assert_eq!(v, base[((r + 3) % 4) as usize].1);
    }
    for m in ["cycling_mae_d-1", "cycling_mae", "cycling_r2"] {
        assert!(rows.iter().any(|r| r.metric == m), "{m}");
    }
    assert_files(
        &d.join("reports/cyc"),
        &["report.md", "cycling_scatter.png", "cycling_profiles.svg"],
    );
}

/// Per-phase values of `metric` at `layer` / `head` (None: whole-model rows).
fn profile_at(rows: &[LongRow], metric: &str, layer: Option<u32>, head: Option<u32>) -> Vec<f64> {
    let mut v: Vec<(u32, f64)> = rows
        .iter()
        .filter(|r| r.metric == metric && r.layer == layer && r.head == head)
        .filter_map(|r| Some((r.phase?, r.value)))
        .collect();
    v.sort_by_key(|x| x.0);
    v.into_iter().map(|x| x.1).collect()
}

#[test]
fn gate_cycling_per_layer_and_per_head_roll_each_unit_alone() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    two_value_organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 14);
    let run = |name: &str, cycling: &str| {
        let exp = experiment(
            d,
            &format!("{name}.toml"),
            &head(
                "gate-cycling",
                &format!("\n[cycling]\ndeltas = [1, 2]\n{cycling}"),
            ),
        );
        let s = run_experiment(&exp, &opts(d)).unwrap();
        (
            s,
            rows(&d.join(format!("notebooks-data/{name}/cycling.arrow"))),
        )
    };
    // Each layer alone: 2 layers x 2 shifts x 4 phase groups; layer 1 alone is the
    // whole-model run restricted to layer 1.
    let (s, per_layer) = run("lay", "per = \"layer\"\n");
    assert_eq!(s.stats.cells_computed, 2 * 2 * 4);
    let (_, only1) = run("one", "layers = [1]\n");
    for dl in ["+1", "+2"] {
        let m = format!("cycling_observed_d{dl}");
        let a = profile_at(&per_layer, &m, Some(1), None);
        assert_eq!(a.len(), 4, "{m}");
        assert_eq!(a, profile_at(&only1, &m, None, None), "{m}");
    }
    for m in [
        "cycling_mae",
        "cycling_r2_both",
        "cycling_r2_fixed",
        "cycling_r2_moving",
    ] {
        for l in [0, 1] {
            assert!(
                per_layer.iter().any(|r| r.metric == m
                    && r.layer == Some(l)
                    && r.head.is_none()
                    && r.phase.is_none()),
                "{m} at layer {l}"
            );
        }
    }
    // Each KV head of layer 0 rolled alone: one unit per KV head, rows at that head.
    let (s, per_head) = run("hd", "per = \"head\"\nlayers = [0]\n");
    assert_eq!(s.stats.cells_computed, 2 * 2 * 4);
    let h0 = profile_at(&per_head, "cycling_observed_d+1", Some(0), Some(0));
    let h1 = profile_at(&per_head, "cycling_observed_d+1", Some(0), Some(1));
    assert_eq!((h0.len(), h1.len()), (4, 4));
    assert!(
        per_head
            .iter()
            .filter(|r| r.head.is_some())
            .all(|r| r.head_kind == Some(HeadKind::Kv))
    );
    let report = std::fs::read_to_string(d.join("reports/hd/report.md")).unwrap();
    assert!(report.contains("layer 0, KV head 1"), "{report}");
    // The two-factor fit and its factors are written for a whole-model run.
    let (_, all) = run("all", "");
    assert_eq!(
        profile_at(&all, "cycling_fixed_factor", None, None).len(),
        4
    );
    assert_eq!(
        profile_at(&all, "cycling_moving_factor", None, None).len(),
        4
    );
    let report = std::fs::read_to_string(d.join("reports/all/report.md")).unwrap();
    assert!(report.contains("Two-factor fit"), "{report}");
}

#[test]
fn phase_sweep_over_organisms() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let org = d.join("organisms");
    std::fs::create_dir_all(&org).unwrap();
    organism(&org, "a-w4s4", &tiny(1, 2, 1, 4, 4), 1);
    organism(&org, "b-w8s4", &tiny(1, 2, 1, 8, 4), 2);
    write_recipe(&org, "c-untrained", &tiny(1, 2, 1, 4, 4));
    let exp = experiment(
        d,
        "phase-sweep.toml",
        "[experiment]\nkind = \"phase-sweep\"\nbootstrap_reps = 40\n[model]\norganism = \"organisms/*\"\n[task]\nn_logical = 8\n",
    );
    let s = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(s.models, vec!["a-w4s4", "b-w8s4"]);
    assert!(
        s.notes.iter().any(|n| n.contains("c-untrained")),
        "{:?}",
        s.notes
    );
    for m in ["a-w4s4", "b-w8s4"] {
        let base = d.join("notebooks-data/phase-sweep").join(m);
        let t = Table::read_arrow(base.join("phase_accuracy.arrow")).unwrap();
        validate_columns(&t, PHASE_ACCURACY_COLUMNS).unwrap();
        let pa = read_phase_accuracy_rows(&t).unwrap();
        assert_eq!(pa.len(), 2 * 4);
        assert!(
            pa.iter()
                .all(|r| r.n == 8 && r.wilson_lo <= r.accuracy && r.accuracy <= r.wilson_hi)
        );
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(base.join("summary.json")).unwrap())
                .unwrap();
        for k in [
            "model",
            "compressed",
            "stride",
            "mean_accuracy",
            "best_phase",
            "worst_phase",
            "phase_gap_pp",
            "phase_gap_ci95",
        ] {
            assert!(summary.get(k).is_some(), "summary.json lacks {k}");
        }
        assert_eq!(summary["stride"], 4);
        assert!(
            d.join(format!("reports/phase-sweep/accuracy_{m}.png"))
                .exists()
        );
    }
    let rows = rows(&d.join("notebooks-data/phase-sweep/phase_sweep.arrow"));
    for m in [
        "accuracy_prefix",
        "accuracy_in_sequence",
        "phase_gap_pp_prefix",
    ] {
        assert!(rows.iter().any(|r| r.metric == m), "{m}");
    }
}

#[test]
fn figures_are_redrawn_from_tables_alone() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    two_value_organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 15);
    let exp = experiment(d, "ko.toml", &head("knockout", ""));
    let mut o = opts(d);
    o.figures = false;
    run_experiment(&exp, &o).unwrap();
    assert!(!d.join("reports/ko").exists());
    // No model needed any more.
    std::fs::remove_dir_all(d.join("tiny")).unwrap();
    let done = draw_all(&d.join("notebooks-data"), &d.join("reports"), None).unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].0, "ko");
    assert_files(
        &d.join("reports/ko"),
        &[
            "report.md",
            "report.html",
            "knockout_kv.png",
            "accuracy_by_phase.png",
        ],
    );
    let md = std::fs::read_to_string(d.join("reports/ko/report.md")).unwrap();
    assert!(
        md.contains("kind = \"knockout\""),
        "the report embeds the experiment TOML"
    );
    assert!(draw_all(&d.join("notebooks-data"), &d.join("reports"), Some("nope")).is_err());
}

#[test]
fn shipped_experiments_parse() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/experiments");
    let mut kinds = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "toml") {
            let exp = phaselens::runner::Experiment::load(&p).unwrap_or_else(|e| panic!("{e}"));
            kinds.push(exp.kind().name());
        }
    }
    for k in phaselens::runner::KindConfig::all() {
        let k = k.kind().name();
        assert!(kinds.contains(&k), "no shipped experiment of kind {k}");
    }
}

/// The runner on the DeepSeek-V4 architecture (residual `[batch, pos, hc_mult, d]`, two
/// strides, vector gates): the v4pro-mini recipe at random init.
#[test]
fn patch_heads_on_a_deepseek_v4_organism() {
    use burn::tensor::Device;
    use phaselens::hooks::{Action, HookPoint, Site};
    use phaselens::model::deepseek_v4::{self, DeepseekV4Model};
    use phaselens::model::load_model;
    use phaselens::model::weights::{RandomInit, Vb};
    use phaselens::runner::patching::{
        Cell, Edit, Fill, Positions, base_run, captures_for, run_cell_naive, run_chunk,
    };
    use phaselens::train::{ModelConfig, OrganismFile};

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("experiments/organisms/v4pro-mini.toml");
    let recipe = d.join("v4pro-mini.toml");
    std::fs::copy(&shipped, &recipe).unwrap();
    let f = OrganismFile::load(&recipe).unwrap();
    let ModelConfig::DeepseekV4 { json, resolved } = &f.model else {
        panic!("v4pro-mini is a DeepSeek-V4 organism");
    };
    let device = Device::flex();
    let m = DeepseekV4Model::new(resolved, &Vb::new(&RandomInit { seed: 5 }, &device)).unwrap();
    deepseek_v4::save(&m, json, &d.join("v4pro-mini")).unwrap();

    let exp = experiment(
        d,
        "v4.toml",
        "[experiment]\nkind = \"patch-heads\"\nbootstrap_reps = 20\n[model]\norganism = \"v4pro-mini\"\n[task]\nn_logical = 4\nphases = [0, 5]\n",
    );
    let s = run_experiment(&exp, &opts(d)).unwrap();
    // 2 phases x 2 directions x 4 layers x (4 query heads + 1 KV head)
    assert_eq!(s.stats.cells_computed, 2 * 2 * 4 * 5);
    // P = 8 fixes the phase of both the CSA (4) and the HCA (8) layers: no warning.
    assert!(
        !s.notes.iter().any(|n| n.contains("stride")),
        "{:?}",
        s.notes
    );
    let rows = rows(&d.join("notebooks-data/v4/heads.arrow"));
    assert_eq!(
        rows.iter().filter(|r| r.metric == "nld_denoise").count(),
        20 * 3
    );

    // Batched == one forward per cell on this architecture too.
    let model = load_model(&d.join("v4pro-mini"), &device).unwrap();
    let space = phaselens::tasks::TokenSpace::default_synthetic();
    let cfg = phaselens::tasks::KvEvalConfig {
        n_logical: 128,
        ..Default::default()
    };
    let set = phaselens::tasks::generate_eval_set(&space, &cfg).unwrap();
    let ex = phaselens::tasks::prompts::group_examples(&set, 3, 3);
    let (prompts, _) = phaselens::tasks::prompts::paired_prompts(&ex, &space, 0, 1, 2).unwrap();
    let corrupted: Vec<usize> = (3..6).collect();
    let cells = vec![
        Cell {
            edit: Edit::Replace {
                point: HookPoint::block(2, Site::AttnZ),
                heads: Some(vec![1]),
                positions: Positions::All,
                fill: Fill::Source,
            },
            prompts: corrupted.clone(),
        },
        Cell {
            edit: Edit::Replace {
                point: HookPoint::block(1, Site::ResidPre),
                heads: None,
                positions: Positions::Answer,
                fill: Fill::Source,
            },
            prompts: corrupted.clone(),
        },
        Cell {
            edit: Edit::Transform {
                points: vec![HookPoint::block(2, Site::KeyGate)],
                action: Box::new(Action::Roll { axis: 2, shift: 1 }),
                heads: None,
            },
            prompts: corrupted.clone(),
        },
        // Suffix forwards (answer positions, a final band) on every layer kind.
        Cell {
            edit: Edit::Replace {
                point: HookPoint::block(2, Site::AttnZ),
                heads: Some(vec![0]),
                positions: Positions::Answer,
                fill: Fill::Source,
            },
            prompts: corrupted.clone(),
        },
        Cell {
            edit: Edit::Replace {
                point: HookPoint::block(0, Site::AttnOut),
                heads: None,
                positions: Positions::Final(4),
                fill: Fill::Mean,
            },
            prompts: corrupted.clone(),
        },
        Cell {
            edit: Edit::Replace {
                point: HookPoint::block(3, Site::MlpOut),
                heads: None,
                positions: Positions::Answer,
                fill: Fill::Zero,
            },
            prompts: corrupted,
        },
    ];
    let base = base_run(model.as_ref(), &prompts, &captures_for(&cells).unwrap()).unwrap();
    assert!(base.state.is_some());
    for c in [1, 3, 4, 5] {
        assert!(
            phaselens::runner::patching::plan_suffix(&prompts, &cells, &[c]).is_some(),
            "cell {c} runs as a suffix forward"
        );
    }
    for c in 0..cells.len() {
        let got = run_chunk(model.as_ref(), &prompts, &base, &cells, &[c]).unwrap();
        let want = run_cell_naive(model.as_ref(), &prompts, &base, &cells[c]).unwrap();
        for (a, b) in got[0].iter().zip(&want) {
            assert!((a.ld - b.ld).abs() < 1e-4, "cell {c}: {} vs {}", a.ld, b.ld);
        }
    }
}
