//! patch-heads on the text tasks (`[task] kind = "passkey" | "needle"`): the clean /
//! corrupted pairs differ only in the value's tokens; on a one-layer model, patching
//! the whole attention output (the KV-head cell over every query head) at the answer
//! positions restores the clean logit difference (NLD 1) and noising destroys it
//! (NLD 0), at every phase, under both protocols and under an `evict` overlay with
//! `decode`; the baselines equal plain forwards of the cut prompts; the table has
//! its rows per source phase; errors name their key. The word-level tokenizer of
//! text_tasks.rs, a random full-attention kvc model of its vocabulary.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use burn::tensor::{Int, Tensor, TensorData};
use phaselens::hooks::HookSpec;
use phaselens::model::compression::Overlay;
use phaselens::model::weights::{RandomInit, Vb};
use phaselens::model::{KvcConfig, KvcModel, LanguageModel, save_kvc};
use phaselens::output::{LongRow, Table, read_long_rows};
use phaselens::runner::run_experiment;
use phaselens::runner::text_pairs::text_paired_prompts;
use phaselens::tasks::{
    Period, Protocol, TextNeedleConfig, TextNeedleExample, TextNeedleSet, TextTask, TextTokens,
    corrupt_text_example, generate_text_needle_set,
};

use super::common::runner::{experiment, opts};
use super::common::{dev, vals};
use super::text_tasks::tiny_tokenizer;

const SPECIALS: TextTokens = TextTokens {
    pad: 0,
    bos: Some(1),
};
const P: usize = 4;
const SEED: u64 = 5;
const EVICT: &str = "kind=evict,chunk=4,keep=0.5,observe=8,sinks=1,decode=4";

fn set(task: TextTask, protocol: Protocol, length: usize) -> TextNeedleSet {
    let cfg = TextNeedleConfig {
        task,
        protocol,
        length,
        digits: 4,
        n_logical: P,
        seed: SEED,
        period: Period::new(P as u32).unwrap(),
        ..TextNeedleConfig::default()
    };
    generate_text_needle_set(&tiny_tokenizer(), SPECIALS, &cfg).unwrap()
}

/// The positions where a pair must differ: the needle's value and the query's
/// teacher-forced value tokens inside the cut prompt.
fn value_positions(e: &TextNeedleExample, len: usize) -> BTreeSet<usize> {
    let mut s: BTreeSet<usize> = (e.value_span.0..e.value_span.1).collect();
    s.extend(
        e.target_positions
            .iter()
            .map(|p| p + 1)
            .filter(|&p| p < len),
    );
    s
}

#[test]
fn pairs_differ_only_in_the_value_tokens_the_same_value_at_every_phase() {
    let tok = tiny_tokenizer();
    for task in [TextTask::Passkey, TextTask::Needle] {
        for protocol in [Protocol::PrefixPadding, Protocol::InSequencePadding] {
            let set = set(task, protocol, 128);
            for r in 0..P as u32 {
                let ex: Vec<&TextNeedleExample> = set.group(r).collect();
                let (pr, meta) = text_paired_prompts(&tok, &set, &ex).unwrap();
                let n = ex.len();
                let want_len = ex
                    .iter()
                    .map(|e| e.target_positions.last().unwrap() + 1)
                    .max()
                    .unwrap();
                assert_eq!((pr.n(), pr.len), (2 * n, want_len));
                for (i, e) in ex.iter().enumerate() {
                    let row = |k: usize| &pr.tokens[k * pr.len..(k + 1) * pr.len];
                    let (clean, bad) = (row(i), row(n + i));
                    assert_eq!(clean, &e.tokens[..pr.len], "{task:?} {protocol:?}");
                    let diff: BTreeSet<usize> =
                        (0..pr.len).filter(|&p| clean[p] != bad[p]).collect();
                    assert_eq!(
                        diff,
                        value_positions(e, pr.len),
                        "{task:?} {protocol:?} r {r}"
                    );
                    let (tc, tb) = (&pr.targets[i], &pr.targets[n + i]);
                    assert_eq!(tc.answers, e.answers);
                    assert_eq!(tc.positions, tb.positions);
                    assert_eq!((tc.alt, tb.alt), (Some(tb.answers[0]), Some(tc.answers[0])));
                    assert_ne!(tc.answers[0], tb.answers[0]);
                    // The corrupted needle holds the corrupted answer.
                    assert_eq!(&bad[e.value_span.0..e.value_span.1], &tb.answers[..]);
                    if task == TextTask::Passkey {
                        assert!(tc.answers.iter().zip(&tb.answers).all(|(a, b)| a != b));
                    }
                    assert_eq!((pr.source[i], pr.source[n + i]), (Some(n + i), Some(i)));
                    assert_eq!((pr.group[i], pr.group[n + i]), (0, 1));
                    assert_eq!((meta[i].phase, meta[n + i].corrupted), (r, true));
                    assert_eq!(meta[i].logical, e.logical_id);
                }
            }
            for i in 0..P {
                let v = |r: u32| corrupt_text_example(&tok, &set.config, set.example(i, r));
                let v0 = v(0).unwrap().value;
                assert!((1..P as u32).all(|r| v(r).unwrap().value == v0));
                assert_ne!(v0, set.example(i, 0).value);
            }
        }
    }
}

/// The tokenizer as `tok.json` and a random one-layer (or `layers`) full-attention kvc
/// model of its vocabulary as `m/` in `d`; the model too.
fn tiny_setup(d: &Path, layers: usize) -> (PathBuf, KvcModel) {
    let tok = tiny_tokenizer();
    let tok_path = d.join("tok.json");
    tok.save(&tok_path, false).unwrap();
    let mut c = KvcConfig::tiny().full_attention();
    c.vocab_size = tok.get_vocab_size(true);
    c.n_layers = layers;
    c.n_heads = 4;
    c.n_kv_heads = 1;
    let m = KvcModel::new(&c, &Vb::new(&RandomInit { seed: 11 }, &dev())).unwrap();
    save_kvc(&m, &d.join("m")).unwrap();
    (tok_path, m)
}

fn exp_text(
    d: &Path,
    kind: &str,
    protocol: Protocol,
    overlay: Option<&str>,
    extra: &str,
) -> String {
    let compression = overlay.map_or(String::new(), |o| {
        let kv: Vec<String> = o
            .split(',')
            .map(|x| {
                let (k, v) = x.split_once('=').unwrap();
                if k == "kind" {
                    format!("{k} = \"{v}\"")
                } else {
                    format!("{k} = {v}")
                }
            })
            .collect();
        format!("compression = {{ {} }}\n", kv.join(", "))
    });
    format!(
        "[experiment]\nkind = \"patch-heads\"\nbootstrap_reps = 20\nmax_rows = 16\n[model]\npath = {m:?}\nname = \"tiny\"\n{compression}[task]\nkind = \"{kind}\"\nvocab = {{ kind = \"hugging_face\", tokenizer = {t:?}, pad = \"<pad>\", bos = \"<s>\" }}\nperiod = {P}\nn_logical = {P}\nseed = {SEED}\nprotocol = \"{p}\"\nallow_period_mismatch = true\n[task.text]\nlength = 128\ndigits = 4\n{extra}[patch]\npositions = \"answer\"\n",
        m = d.join("m").display().to_string(),
        t = d.join("tok.json").display().to_string(),
        p = protocol.name(),
    )
}

fn rows_of(d: &Path, name: &str) -> Vec<LongRow> {
    let t = Table::read_arrow(d.join(format!("notebooks-data/{name}/heads.arrow"))).unwrap();
    read_long_rows(&t).unwrap()
}

/// The value of `metric` of the KV-head cell of layer 0 at `phase`.
fn kv_cell(rows: &[LongRow], metric: &str, phase: Option<u32>) -> f64 {
    rows.iter()
        .find(|r| {
            r.metric == metric
                && r.layer == Some(0)
                && r.head_kind == Some(phaselens::output::HeadKind::Kv)
                && r.phase == phase
        })
        .unwrap_or_else(|| panic!("no {metric} row of the KV head at {phase:?}"))
        .value
}

fn baseline(rows: &[LongRow], metric: &str, phase: u32) -> f64 {
    rows.iter()
        .find(|r| r.metric == metric && r.phase == Some(phase) && r.layer.is_none())
        .unwrap_or_else(|| panic!("no {metric} row at phase {phase}"))
        .value
}

/// `logit(a) - logit(b)` at `pos` of a plain forward of `tokens`.
fn ld(m: &dyn LanguageModel, tokens: &[u32], pos: usize, a: u32, b: u32) -> f64 {
    let ids: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
    let n = ids.len();
    let t = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, n]), &dev());
    let logits = vals(m.forward(t, &HookSpec::new()).unwrap().logits);
    let v = logits.len() / n;
    f64::from(logits[pos * v + a as usize] - logits[pos * v + b as usize])
}

/// The mean clean and corrupted logit differences (clean orientation) of phase group
/// `r`, from plain forwards of each prompt cut after the group's last read position.
fn independent_lds(m: &dyn LanguageModel, set: &TextNeedleSet, r: u32) -> (f64, f64) {
    let tok = tiny_tokenizer();
    let ex: Vec<&TextNeedleExample> = set.group(r).collect();
    let len = ex
        .iter()
        .map(|e| e.target_positions.last().unwrap() + 1)
        .max()
        .unwrap();
    let (mut c, mut k) = (0.0, 0.0);
    for e in &ex {
        let x = corrupt_text_example(&tok, &set.config, e).unwrap();
        let (a, b, p) = (e.answers[0], x.answers[0], e.target_positions[0]);
        c += ld(m, &e.tokens[..len], p, a, b);
        k += ld(m, &x.apply(e)[..len], p, a, b);
    }
    (c / ex.len() as f64, k / ex.len() as f64)
}

/// One run: the full patch restores (NLD 1) and noising destroys (NLD 0) at every
/// phase; the rows per phase; the baselines equal plain forwards of the cut prompts.
fn check_run(task: TextTask, protocol: Protocol, overlay: Option<&str>) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (_, m) = tiny_setup(d, 1);
    let text = exp_text(d, task.name(), protocol, overlay, "");
    let s = run_experiment(&experiment(d, "pt.toml", &text), &opts(d)).unwrap();
    let what = format!("{task:?} {protocol:?} {overlay:?}");
    // 4 phases x 2 directions x (4 query heads + 1 KV head)
    assert_eq!(s.stats.cells_computed, (P * 2 * 5) as u64, "{what}");
    let rows = rows_of(d, "pt");
    for metric in ["nld_denoise", "nld_noise"] {
        let n = |ph: Option<u32>| {
            rows.iter()
                .filter(|r| r.metric == metric && r.phase == ph)
                .count()
        };
        assert!(
            (0..P as u32).all(|r| n(Some(r)) == 5),
            "{what}: 5 cells per phase"
        );
        assert_eq!(n(None), 5, "{what}: pooled");
    }
    let m: Box<dyn LanguageModel> = match overlay {
        Some(o) => Box::new(m.with_overlay(&o.parse::<Overlay>().unwrap()).unwrap()),
        None => Box::new(m),
    };
    let set = set(task, protocol, 128);
    for r in 0..P as u32 {
        let den = kv_cell(&rows, "nld_denoise", Some(r));
        let noi = kv_cell(&rows, "nld_noise", Some(r));
        assert!(
            (den - 1.0).abs() < 1e-3,
            "{what} phase {r}: denoise NLD {den}"
        );
        assert!(noi.abs() < 1e-3, "{what} phase {r}: noise NLD {noi}");
        let (c, k) = independent_lds(m.as_ref(), &set, r);
        let (rc, rk) = (
            baseline(&rows, "logit_diff_clean", r),
            baseline(&rows, "logit_diff_corrupted", r),
        );
        assert!(
            (c - rc).abs() < 1e-4 && (k - rk).abs() < 1e-4,
            "{what} phase {r}: ({rc}, {rk}) vs forwards ({c}, {k})"
        );
    }
}

#[test]
fn passkey_full_patch_restores_the_clean_answer_under_both_protocols() {
    check_run(TextTask::Passkey, Protocol::PrefixPadding, None);
    check_run(TextTask::Passkey, Protocol::InSequencePadding, None);
}

#[test]
fn passkey_under_evict_with_decode_reads_the_cut_prompts() {
    check_run(TextTask::Passkey, Protocol::InSequencePadding, Some(EVICT));
}

#[test]
fn needle_full_patch_restores_the_clean_answer() {
    check_run(TextTask::Needle, Protocol::InSequencePadding, None);
}

#[test]
fn evict_changes_the_logits_the_test_above_reads() {
    // The evict test is not the plain forward in disguise: the overlay moves the
    // clean logit difference of some phase group.
    let dir = tempfile::tempdir().unwrap();
    let (_, m) = tiny_setup(dir.path(), 1);
    let set = set(TextTask::Passkey, Protocol::InSequencePadding, 128);
    let plain: Vec<f64> = (0..P as u32)
        .map(|r| independent_lds(&m, &set, r).0)
        .collect();
    let ev = m.with_overlay(&EVICT.parse::<Overlay>().unwrap()).unwrap();
    let evict: Vec<f64> = (0..P as u32)
        .map(|r| independent_lds(&ev, &set, r).0)
        .collect();
    let most = plain
        .iter()
        .zip(&evict)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(most > 1e-3, "plain {plain:?} evict {evict:?}");
}

#[test]
fn text_patching_errors_name_their_key() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tiny_setup(d, 1);
    // Fact values of different token counts: no corrupted value keeps the frame.
    let facts = "facts = [{ sentence = \"The old {value} hides the map.\", question = \"What hides the map? The old\", values = [\"oak\", \"red barn\"] }]\n";
    let text = exp_text(d, "needle", Protocol::InSequencePadding, None, facts);
    let err = run_experiment(&experiment(d, "f.toml", &text), &opts(d))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("[task.text] facts") && err.contains("first token"),
        "{err}"
    );
    // Text tasks run in phase-sweep and patch-heads only.
    let text = exp_text(d, "passkey", Protocol::PrefixPadding, None, "")
        .replace("kind = \"patch-heads\"", "kind = \"ablate-heads\"")
        .replace("[patch]\npositions = \"answer\"\n", "");
    let err = run_experiment(&experiment(d, "a.toml", &text), &opts(d))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("[task] kind") && err.contains("patch-heads"),
        "{err}"
    );
    // [task] prompt does not apply to a text task.
    let text = exp_text(d, "passkey", Protocol::PrefixPadding, None, "")
        .replace("period = ", "prompt = { n_bindings = 4 }\nperiod = ");
    let err = run_experiment(&experiment(d, "p.toml", &text), &opts(d))
        .unwrap_err()
        .to_string();
    assert!(err.contains("[task] prompt"), "{err}");
}
