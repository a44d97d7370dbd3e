//! End-to-end tests of retrieval-heads, filler-probe and indexer-diagnostics on tiny
//! random organisms (tables, figures, report, resume).

use crate::common;

use crate::common::runner::*;
use phaselens::hooks::{HookPoint, HookSpec, Site};
use phaselens::model::load_model;
use phaselens::output::{LONG_COLUMNS, LongRow, Table, read_long_rows, validate_columns};
use phaselens::runner::experiment::Experiment;
use phaselens::runner::run_experiment;
use phaselens::runner::setup::{TaskSetup, resolve_models};
use phaselens::tasks::prompts::{clean_prompts, group_examples};

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

fn at<'r>(rows: &'r [LongRow], metric: &str, l: u32, h: u32, phase: Option<u32>) -> &'r LongRow {
    rows.iter()
        .find(|r| r.metric == metric && r.layer == Some(l) && r.head == Some(h) && r.phase == phase)
        .unwrap_or_else(|| panic!("no {metric} row for L{l}.H{h} phase {phase:?}"))
}

/// The retrieval score of every head at phase `r`, recomputed here with full forwards
/// and kvc's window rule (entry i pools tokens i*S .. i*S + W - 1).
fn retrieval_by_hand(exp_path: &std::path::Path, r: u32, w: usize, s: usize) -> Vec<Vec<f64>> {
    let exp = Experiment::load(exp_path).unwrap();
    let (models, _) = resolve_models(&exp).unwrap();
    let dev = common::dev();
    let model = load_model(&models[0].dir, &dev).unwrap();
    let info = model.info();
    let task = TaskSetup::resolve(&exp, &models[0], &info).unwrap();
    let set = task.eval_set(task.protocol).unwrap();
    let ex = group_examples(&set, r, task.n_logical);
    let (prompts, _) = clean_prompts(&ex, |_| 0);
    let t = prompts.len;
    let spec = HookSpec::new()
        .capture("blocks.*.attn.hook_pattern")
        .unwrap();
    let all: Vec<usize> = (0..prompts.n()).collect();
    let out = model.forward(prompts.tokens_of(&all, &dev), &spec).unwrap();
    let mut score = vec![vec![0.0; info.n_heads]; info.n_layers()];
    for (l, row) in score.iter_mut().enumerate() {
        let act = out
            .cache
            .get(&HookPoint::block(l, Site::AttnPattern))
            .unwrap();
        let [_, nh, _, k] = <[usize; 4]>::try_from(act.shape().to_vec()).unwrap();
        let v = act.to_vec();
        let n_entries = if t >= w { (t - w) / s + 1 } else { 0 };
        for (hh, cell) in row.iter_mut().enumerate() {
            for (i, e) in ex.iter().enumerate() {
                let b = &e.bindings[e.scored_query().binding];
                let needle = b.key_pos + 1;
                let p = e.target_positions[0];
                let probs = &v[((i * nh + hh) * t + p) * k..][..k];
                let top = (0..k).fold(0, |best, j| if probs[j] > probs[best] { j } else { best });
                let hit = if top < n_entries {
                    top * s <= needle && needle < top * s + w
                } else {
                    top - n_entries == needle
                };
                *cell += f64::from(u8::from(hit)) / ex.len() as f64;
            }
        }
    }
    score
}

#[test]
fn retrieval_heads_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 8, 4), 21);
    let exp = experiment(
        d,
        "ret.toml",
        &head("retrieval-heads", "\n[retrieval]\nonly_correct = false\n"),
    );
    let s = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(s.stats.cells_computed, 4 * 8, "one unit per prompt");
    let rows = rows(&d.join("notebooks-data/ret/retrieval.arrow"));
    for l in 0..2 {
        for h in 0..4 {
            for p in (0..4).map(Some).chain([None]) {
                let sc = at(&rows, "retrieval_score", l, h, p).value;
                let m = at(&rows, "needle_attention", l, h, p).value;
                assert!(
                    (0.0..=1.0).contains(&sc) && (0.0..=1.0 + 1e-6).contains(&m),
                    "{sc} {m}"
                );
                assert!(sc == 0.0 || m > 0.0, "a hit puts mass on the needle");
            }
        }
    }
    // Every clean prompt is scored without only_correct.
    for p in 0..4 {
        let r = rows
            .iter()
            .find(|r| r.metric == "scored_prompts" && r.phase == Some(p))
            .unwrap();
        assert_eq!(r.value, 8.0);
    }
    // The scores agree with a recomputation from full forwards.
    for r in [0, 3] {
        let want = retrieval_by_hand(&exp, r, 8, 4);
        for (l, hs) in want.iter().enumerate() {
            for (h, w) in hs.iter().enumerate() {
                let got = at(&rows, "retrieval_score", l as u32, h as u32, Some(r)).value;
                assert!((got - w).abs() < 1e-9, "L{l}.H{h} phase {r}: {got} vs {w}");
            }
        }
    }
    assert!(
        rows.iter()
            .any(|r| r.metric == "retrieval_score" && r.value > 0.0)
    );
    assert_files(
        &d.join("reports/ret"),
        &[
            "report.md",
            "report.html",
            "retrieval_score_map.png",
            "needle_attention_map.svg",
            "retrieval_score_all_phases.png",
        ],
    );
    // Resume: a rerun loads every shard and writes the same table.
    let again = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(again.stats.cells_computed, 0);
    assert_eq!(again.stats.cells_resumed, 4 * 8);
    let rows2 =
        read_long_rows(&Table::read_arrow(d.join("notebooks-data/ret/retrieval.arrow")).unwrap())
            .unwrap();
    assert_eq!(rows.len(), rows2.len());
    for (a, b) in rows.iter().zip(&rows2) {
        assert!(
            a.metric == b.metric && (a.value == b.value || (a.value.is_nan() && b.value.is_nan()))
        );
    }
}

#[test]
fn filler_probe_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 22);
    let exp = experiment(
        d,
        "fill.toml",
        &head(
            "filler-probe",
            "\n[filler]\nlengths = { min = 3, max = 9 }\nfiller_token = \"pad\"\n",
        ),
    );
    let s = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(s.stats.cells_computed, 7 * 8, "8 instances x 7 lengths");
    let rows = rows(&d.join("notebooks-data/fill/filler.arrow"));
    let get = |m: &str, ph: Option<u32>| {
        rows.iter()
            .find(|r| r.metric == m && r.phase == ph && r.layer.is_none())
            .unwrap_or_else(|| panic!("{m} {ph:?}"))
    };
    for ph in (0..4).map(Some).chain([None]) {
        let (pc, pd, diff) = (
            get("prob_correct", ph).value,
            get("prob_distractor", ph).value,
            get("prob_diff", ph).value,
        );
        assert!((0.0..=1.0).contains(&pc) && (0.0..=1.0).contains(&pd));
        assert!((pc - pd - diff).abs() < 1e-6, "{pc} - {pd} != {diff}");
        let pref = get("distractor_preferred", ph).value;
        assert!((0.0..=1.0).contains(&pref));
    }
    // Per length: phase = L mod P, and the mean over a residue group's lengths is the
    // group's value (every length has the same number of instances).
    for ph in 0..4u32 {
        let per_l: Vec<f64> = (3..=9usize)
            .filter(|l| (*l % 4) as u32 == ph)
            .map(|l| {
                let r = get(&format!("prob_diff_L{l}"), Some(ph));
                assert!(r.ci_lo.is_some());
                r.value
            })
            .collect();
        let mean = per_l.iter().sum::<f64>() / per_l.len() as f64;
        assert!((mean - get("prob_diff", Some(ph)).value).abs() < 1e-6);
    }
    // The probe depends on L in a random model.
    let vals: Vec<f64> = (3..=9)
        .map(|l| {
            rows.iter()
                .find(|r| r.metric == format!("prob_diff_L{l}"))
                .unwrap()
                .value
        })
        .collect();
    assert!(vals.iter().any(|v| (v - vals[0]).abs() > 1e-6), "{vals:?}");
    assert_files(
        &d.join("reports/fill"),
        &[
            "report.md",
            "prob_diff_by_length.png",
            "prob_diff_by_residue.svg",
        ],
    );
    let again = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(
        (again.stats.cells_computed, again.stats.cells_resumed),
        (0, 56)
    );
    // The text probe needs a Hugging Face tokenizer: an error naming the key.
    let bad = experiment(
        d,
        "bad.toml",
        &head("filler-probe", "\n[filler]\nprobe = \"text\"\n"),
    );
    let err = format!("{:#}", run_experiment(&bad, &opts(d)).unwrap_err());
    assert!(
        err.contains("[filler] probe") && err.contains("hugging_face"),
        "{err}"
    );
}

/// An experiment on the tiny random DeepSeek-V4 fixture `flash` (sliding, sliding, CSA,
/// HCA, CSA, HCA; CSA rate 4 with index_topk 2, so the indexer drops entries).
fn v4_experiment(d: &std::path::Path, file: &str, kind: &str, extra: &str) -> std::path::PathBuf {
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4/flash");
    experiment(
        d,
        file,
        &format!(
            "[experiment]\nkind = \"{kind}\"\nbootstrap_reps = 40\n\n[model]\npath = \"{}\"\n\n[task]\nvocab = {{ kind = \"synthetic\" }}\nprompt = {{ n_bindings = 8, n_queries = 2 }}\nperiod = 8\nn_logical = 4\n{extra}",
            fixture.display()
        ),
    )
}

#[test]
fn indexer_diagnostics_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let exp = v4_experiment(d, "idx.toml", "indexer-diagnostics", "");
    let s = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(s.stats.cells_computed, 8 * 4);
    let rows = rows(&d.join("notebooks-data/idx/indexer.arrow"));
    let get = |m: &str, l: Option<u32>, ph: Option<u32>| {
        rows.iter()
            .find(|r| r.metric == m && r.layer == l && r.phase == ph)
            .unwrap_or_else(|| panic!("{m} {l:?} {ph:?}"))
            .value
    };
    for l in [2u32, 4] {
        for ph in (0..8).map(Some).chain([None]) {
            let acc = get("accuracy", None, ph);
            let (sel, read) = (
                get("selection_miss", Some(l), ph),
                get("read_miss", Some(l), ph),
            );
            assert!(sel >= 0.0 && read >= 0.0 && sel + read <= 1.0 - acc + 1e-9);
            let kept = get("needle_selected", Some(l), ph);
            assert!(kept.is_nan() || (0.0..=1.0).contains(&kept));
            let rank = get("needle_rank", Some(l), ph);
            assert!(rank.is_nan() || rank >= 0.0);
            let deciding = get("topk_deciding", Some(l), ph);
            assert!((0.0..=1.0).contains(&deciding));
            let near = get("topk_near_boundary", Some(l), ph);
            assert!(near.is_nan() || (0.0..=1.0).contains(&near));
            assert_eq!(near.is_nan(), deciding == 0.0, "layer {l} phase {ph:?}");
        }
    }
    // index_topk = 2: the top-k decides at most queries of these prompts.
    assert!(get("topk_deciding", Some(2), None) > 0.5);
    // Only the two CSA layers are diagnosed.
    assert!(
        !rows
            .iter()
            .any(|r| r.metric == "needle_selected" && r.layer == Some(3))
    );
    // With index_topk = 2 some needle entry is dropped, and forcing the choice changes
    // what the model computes.
    assert!(
        rows.iter()
            .any(|r| r.metric == "needle_selected" && r.value < 1.0)
    );
    let moved: f64 = rows
        .iter()
        .filter(|r| r.metric.starts_with("logit_diff_change_force") && r.phase.is_some())
        .map(|r| r.value.abs())
        .sum();
    assert!(moved > 0.0, "forcing the selection changed nothing");
    assert_files(
        &d.join("reports/idx"),
        &[
            "report.md",
            "indexer_misses_L2.png",
            "needle_rank_L4.svg",
            "accuracy_by_phase.png",
        ],
    );
    // A kvc model has no indexer: an error naming the model.
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 23);
    let bad = experiment(d, "bad.toml", &head("indexer-diagnostics", ""));
    let err = format!("{:#}", run_experiment(&bad, &opts(d)).unwrap_err());
    assert!(
        err.contains("[model]") && err.contains("DeepSeek-V4"),
        "{err}"
    );
}

/// A copy of organism `name` whose key and value gate biases are rolled by `shift`
/// offsets in the weights themselves (`rolled[i] = bias[(i - shift) mod W]`).
fn rolled_organism(d: &std::path::Path, name: &str, new: &str, shift: i64) {
    use burn::module::Param;
    use burn::tensor::{Tensor, TensorData};
    let dev = common::dev();
    let mut m = phaselens::model::load_kvc(&d.join(name), &dev).unwrap();
    for b in m.blocks.iter_mut() {
        let c = b.attn.compressor.as_mut().unwrap();
        for p in [&mut c.key_gate_bias, &mut c.value_gate_bias]
            .into_iter()
            .flatten()
        {
            let [w, k] = p.dims();
            let v = p
                .val()
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap();
            let mut out = vec![0.0; w * k];
            for i in 0..w {
                let src = (i as i64 - shift).rem_euclid(w as i64) as usize;
                out[i * k..(i + 1) * k].copy_from_slice(&v[src * k..(src + 1) * k]);
            }
            *p = Param::initialized(p.id, Tensor::from_data(TensorData::new(out, [w, k]), &dev));
        }
    }
    phaselens::model::save_kvc(&m, &d.join(new)).unwrap();
    let text = std::fs::read_to_string(d.join(format!("{name}.toml")))
        .unwrap()
        .replace(&format!("name = \"{name}\""), &format!("name = \"{new}\""));
    std::fs::write(d.join(format!("{new}.toml")), text).unwrap();
}

#[test]
fn gate_cycling_rolls_the_bias_alone() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    two_value_organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 31);
    rolled_organism(d, "tiny", "tinyroll", 1);
    let cyc = |file: &str, org: &str, roll: &str| {
        let text = head(
            "gate-cycling",
            &format!("\n[cycling]\ndeltas = [1]\nroll = \"{roll}\"\n"),
        )
        .replace("organism = \"tiny\"", &format!("organism = \"{org}\""));
        let exp = experiment(d, file, &text);
        run_experiment(&exp, &opts(d)).unwrap();
        rows(&d.join(format!(
            "notebooks-data/{}/cycling.arrow",
            file.trim_end_matches(".toml")
        )))
    };
    let per_phase = |rows: &[LongRow], m: &str| {
        let mut v: Vec<(u32, f64)> = rows
            .iter()
            .filter(|r| r.metric == m && r.phase.is_some())
            .map(|r| (r.phase.unwrap(), r.value))
            .collect();
        v.sort_by_key(|x| x.0);
        v
    };
    let bias = cyc("bias.toml", "tiny", "bias");
    let rolled = cyc("rolled.toml", "tinyroll", "bias");
    // Rolling the bias by +1 through the hook = a model whose bias is rolled in its weights.
    assert_eq!(
        per_phase(&bias, "cycling_observed_d+1"),
        per_phase(&rolled, "accuracy")
    );
    // roll = "logits" runs the same baseline (and its own cells).
    let logits = cyc("logits.toml", "tiny", "logits");
    assert_eq!(per_phase(&logits, "accuracy"), per_phase(&bias, "accuracy"));
    let report = std::fs::read_to_string(d.join("reports/bias/report.md")).unwrap();
    assert!(report.contains("roll = \"bias\""));
    // A model without a learned bias: an error naming [cycling] roll.
    let text = std::fs::read_to_string(d.join("tiny.toml"))
        .unwrap()
        .replace("gate_bias = true", "gate_bias = false")
        .replace("name = \"tiny\"", "name = \"nobias\"");
    let mut cfg = tiny(2, 4, 2, 4, 4);
    cfg.compression.as_mut().unwrap().gate_bias = false;
    phaselens::model::save_kvc(&random_model(&cfg, 5), &d.join("nobias")).unwrap();
    std::fs::write(d.join("nobias.toml"), text).unwrap();
    let exp = experiment(
        d,
        "nb.toml",
        &head("gate-cycling", "\n[cycling]\ndeltas = [1]\n").replace("\"tiny\"", "\"nobias\""),
    );
    let err = format!("{:#}", run_experiment(&exp, &opts(d)).unwrap_err());
    assert!(
        err.contains("[cycling] roll") && err.contains("no learned"),
        "{err}"
    );
}
