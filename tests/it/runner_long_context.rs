//! End-to-end test of the long-context kind: its per-cell table agrees with an oracle
//! that regenerates every haystack prompt and runs one plain forward per prompt, at any
//! batch size; a second run resumes everything; figures redraw from the tables.

use crate::common;

use std::collections::BTreeMap;

use crate::common::dev;
use crate::common::runner::*;
use burn::tensor::{Int, Tensor, TensorData};
use phaselens::hooks::HookSpec;
use phaselens::model::kvc::KvcModel;
use phaselens::model::load_kvc;
use phaselens::output::{LONG_COLUMNS, Table, read_long_rows, validate_columns};
use phaselens::runner::report::draw_all;
use phaselens::runner::run_experiment;
use phaselens::tasks::{
    HaystackConfig, HaystackFiller, KvPromptConfig, Period, Protocol, TokenSpaceConfig,
};

/// (protocol label, length, depth, phase) -> (n, correct), by one forward per prompt.
fn oracle(
    model: &KvcModel,
    lengths: &[usize],
    depths: &[f64],
    n_logical: usize,
) -> BTreeMap<(String, u64, u64, u64), (u64, u64)> {
    // The token space of `two_value_organism`'s recipe.
    let space: TokenSpaceConfig =
        toml::from_str("kind = \"synthetic\"\nvalues = { start = 64, end = 66 }").unwrap();
    let space = space.build().unwrap();
    let prompt: KvPromptConfig = toml::from_str("n_bindings = 8\nn_queries = 1").unwrap();
    let mut out = BTreeMap::new();
    for (proto, label) in [
        (Protocol::PrefixPadding, "prefix"),
        (Protocol::InSequencePadding, "in-sequence"),
    ] {
        let hc = HaystackConfig {
            prompt: prompt.clone(),
            lengths: lengths.to_vec(),
            depths: depths.to_vec(),
            filler: HaystackFiller::Pad,
            period: Period::new(4).unwrap(),
            protocol: proto,
            n_logical,
            seed: 5,
        };
        for li in 0..lengths.len() {
            for di in 0..depths.len() {
                for h in hc.cell(&space, li, di).unwrap() {
                    let e = &h.example;
                    let ids: Vec<i64> = e.tokens.iter().map(|&t| t as i64).collect();
                    let n = ids.len();
                    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, n]), &dev());
                    let logits = model.forward(tokens, &HookSpec::new()).unwrap().logits;
                    let v = logits.dims()[2];
                    let all = common::vals(logits);
                    let at = e.target_positions[0];
                    let row = &all[at * v..(at + 1) * v];
                    let best = (0..v).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
                    let key = (
                        label.to_string(),
                        h.length as u64,
                        h.depth.to_bits(),
                        u64::from(e.phase.residue()),
                    );
                    let c = out.entry(key).or_insert((0, 0));
                    c.0 += 1;
                    c.1 += u64::from(best as u32 == e.answers[0]);
                }
            }
        }
    }
    out
}

#[test]
fn long_context_table_matches_one_forward_per_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = tiny(2, 2, 1, 4, 4);
    two_value_organism(d, "tiny", &cfg, 3);
    // tokens_per_forward = 150: one 96-token prompt per forward, and one 40-token
    // group of three; results must not depend on the batching.
    let exp = experiment(
        d,
        "lc.toml",
        "[experiment]\nkind = \"long-context\"\nbootstrap_reps = 40\n[model]\norganism = \"tiny\"\n\
         [task]\nn_logical = 3\nseed = 5\n[long_context]\nlengths = [40, 96]\ndepths = [0.0, 1.0]\n\
         tokens_per_forward = 150\n",
    );
    let s = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(s.models, vec!["tiny"]);
    let base = d.join("notebooks-data/lc");
    let t = Table::read_arrow(base.join("tiny/long_context.arrow")).unwrap();
    assert!(base.join("tiny/long_context.parquet").exists());
    let (proto, length, depth) = (
        t.utf8("protocol").unwrap(),
        t.uint64("length").unwrap(),
        t.float64("depth").unwrap(),
    );
    let (phase, n, correct) = (
        t.uint64("phase").unwrap(),
        t.uint64("n").unwrap(),
        t.uint64("correct").unwrap(),
    );
    let (acc, lo, hi) = (
        t.float64("accuracy").unwrap(),
        t.float64("wilson_lo").unwrap(),
        t.float64("wilson_hi").unwrap(),
    );
    let needle = t.float64("needle_depth").unwrap();
    let model = load_kvc(&d.join("tiny"), &dev()).unwrap();
    let want = oracle(&model, &[40, 96], &[0.0, 1.0], 3);
    // 2 protocols x 2 lengths x 2 depths x 4 phases.
    assert_eq!(t.num_rows(), 32);
    assert_eq!(want.len(), 32);
    let mut total = (0, 0);
    for i in 0..t.num_rows() {
        let key = (
            proto[i].clone().unwrap(),
            length[i].unwrap(),
            depth[i].unwrap().to_bits(),
            phase[i].unwrap(),
        );
        let (wn, wc) = want[&key];
        assert_eq!((n[i].unwrap(), correct[i].unwrap()), (wn, wc), "{key:?}");
        let a = acc[i].unwrap();
        assert!((a - wc as f64 / wn as f64).abs() < 1e-12);
        assert!(lo[i].unwrap() <= a && a <= hi[i].unwrap());
        // Depth 0: the needle is the first binding; depth 1: the last.
        let nd = needle[i].unwrap();
        assert!((0.0..=1.0).contains(&nd));
        if depth[i].unwrap() == 0.0 {
            assert!(nd < 0.5, "{key:?}: needle depth {nd}");
        } else {
            assert!(nd > 0.5, "{key:?}: needle depth {nd}");
        }
        total.0 += wn;
        total.1 += wc;
    }
    // The two-value head answers some but not all: accuracy is informative.
    assert!(total.1 > 0 && total.1 < total.0, "{total:?}");
    // Long rows: per protocol and length, accuracy by phase and the pooled headline.
    let long = Table::read_arrow(base.join("long_context.arrow")).unwrap();
    validate_columns(&long, LONG_COLUMNS).unwrap();
    let rows = read_long_rows(&long).unwrap();
    for (sfx, label) in [("_prefix", "prefix"), ("_in_sequence", "in-sequence")] {
        for len in [40u64, 96] {
            let pooled = rows
                .iter()
                .find(|r| r.metric == format!("accuracy{sfx}_len{len}") && r.phase.is_none())
                .unwrap();
            let (wn, wc) = want
                .iter()
                .filter(|(k, _)| k.0 == label && k.1 == len)
                .fold((0, 0), |(n, c), (_, (a, b))| (n + a, c + b));
            assert!((pooled.value - wc as f64 / wn as f64).abs() < 1e-9);
            assert!(
                rows.iter()
                    .any(|r| r.metric == format!("phase_gap_pp{sfx}_len{len}"))
            );
        }
    }
    // A second run computes nothing; the figures redraw from the tables alone.
    let again = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(again.stats.cells_computed, 0);
    assert!(again.stats.cells_resumed > 0 || again.stats.forwards == 0);
    let report = d.join("reports/lc");
    std::fs::remove_dir_all(&report).unwrap();
    draw_all(&d.join("notebooks-data"), &d.join("reports"), Some("lc")).unwrap();
    for f in [
        "long_context_phase_tiny_prefix.png",
        "long_context_niah_tiny_in_sequence.svg",
        "report.md",
    ] {
        assert!(report.join(f).exists(), "missing {f}");
    }
    let md = std::fs::read_to_string(report.join("report.md")).unwrap();
    assert!(md.contains("phase gap pp") && md.contains("| 96 |"), "{md}");
}

#[test]
fn long_context_settings_are_checked_before_compute() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    two_value_organism(d, "tiny", &tiny(1, 2, 1, 4, 4), 3);
    for (body, needle) in [
        ("lengths = []", "lengths"),
        ("depths = [1.5]", "depths"),
        ("tokens_per_forward = 0", "tokens_per_forward"),
        ("protocols = []", "protocols"),
        ("lengths = [10]", "lengths"),
        ("length = [64]", "length"),
    ] {
        let exp = experiment(
            d,
            "bad.toml",
            &format!(
                "[experiment]\nkind = \"long-context\"\n[model]\norganism = \"tiny\"\n[long_context]\n{body}\n"
            ),
        );
        let e = run_experiment(&exp, &opts(d)).unwrap_err().to_string();
        assert!(e.contains(needle) && e.contains("bad.toml"), "{body}: {e}");
        assert!(!d.join("notebooks-data/bad").join("tiny").exists());
    }
}
