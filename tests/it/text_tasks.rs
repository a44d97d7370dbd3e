//! The passkey and natural-text needle tasks (`phaselens::tasks::generate_text_needle_set`):
//! the value at the requested phase in tokens under both protocols, equal lengths,
//! varied filler, reproducible seeds, the needle sentence in the decoded prompt: with a
//! tiny word-level tokenizer written here and with both real tokenizers (SmolLM2 and
//! Gemma 3 from the model cache, skipped outside CI when absent); and the `[task]`
//! keys of an experiment file.

use std::collections::BTreeSet;
use std::path::Path;

use phaselens::runner::Experiment;
use phaselens::tasks::{
    FILLER_SENTENCES, Fact, Period, Protocol, TextNeedleConfig, TextNeedleSet, TextTask,
    TextTokens, TokenSpace, TokenSpaceConfig, builtin_facts, generate_text_needle_set,
};
use tokenizers::Tokenizer;

use super::common::pretrained::{GEMMA3, SMOLLM2, model_file};

/// Words and punctuation runs of `text`, as a `Whitespace` pre-tokenizer splits them.
fn pieces(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut cur = String::new();
    let mut cur_word = None;
    for ch in text.chars() {
        let word = ch.is_alphanumeric() || ch == '_';
        if ch.is_whitespace() || cur_word != Some(word) {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            cur_word = None;
        }
        if !ch.is_whitespace() {
            cur.push(ch);
            cur_word = Some(word);
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Every text the generator tokenizes.
fn all_texts() -> Vec<String> {
    let mut v: Vec<String> = FILLER_SENTENCES.iter().map(|s| s.to_string()).collect();
    v.extend(
        [
            phaselens::tasks::PASSKEY_INTRO,
            phaselens::tasks::PASSKEY_SENTENCE,
            phaselens::tasks::PASSKEY_QUESTION,
            phaselens::tasks::NEEDLE_INTRO,
        ]
        .map(String::from),
    );
    for f in builtin_facts() {
        v.push(f.sentence.replace("{value}", ""));
        v.push(f.question.clone());
        v.extend(f.values.iter().cloned());
    }
    v
}

/// A word-level tokenizer over every word the tasks use, digits split one per token
/// (ids 0..3 = `<pad>`, `<s>`, `<unk>`).
pub(crate) fn tiny_tokenizer() -> Tokenizer {
    let mut words: BTreeSet<String> = all_texts().iter().flat_map(|t| pieces(t)).collect();
    words.extend((0..10).map(|d| d.to_string()));
    let mut vocab = serde_json::Map::new();
    for (i, w) in ["<pad>", "<s>", "<unk>"].iter().enumerate() {
        vocab.insert(w.to_string(), serde_json::json!(i));
    }
    for w in words
        .into_iter()
        .filter(|w| !w.chars().all(|c| c.is_ascii_digit()) || w.len() == 1)
    {
        let n = vocab.len();
        vocab.entry(w).or_insert(serde_json::json!(n));
    }
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Whitespace"}, {"type": "Digits", "individual_digits": true}
        ]},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    json.to_string().parse().unwrap()
}

/// A real tokenizer from the model cache, with its pad and BOS (None: not cached).
fn real(rel: &str) -> Option<(Tokenizer, TextTokens)> {
    let path = model_file(rel)?;
    let (pad, bos) = if rel == GEMMA3 {
        ("<pad>", Some("<bos>".to_string()))
    } else {
        ("<|endoftext|>", None)
    };
    let cfg: TokenSpaceConfig = toml::from_str(&format!(
        "kind = \"hugging_face\"\ntokenizer = {:?}\npad = {pad:?}\n{}",
        path.display().to_string(),
        bos.map(|b| format!("bos = {b:?}\n")).unwrap_or_default()
    ))
    .unwrap();
    let space: TokenSpace = cfg.build().unwrap();
    let specials = TextTokens {
        pad: space.pad(),
        bos: space.bos(),
    };
    Some((space.tokenizer().unwrap().clone(), specials))
}

fn config(
    task: TextTask,
    protocol: Protocol,
    length: usize,
    n: usize,
    seed: u64,
) -> TextNeedleConfig {
    TextNeedleConfig {
        task,
        protocol,
        length,
        n_logical: n,
        seed,
        period: Period::new(8).unwrap(),
        ..TextNeedleConfig::default()
    }
}

/// The tokens of an example without its needle and pads: the filler and the fixed text.
fn without_needle_and_pads(set: &TextNeedleSet, i: usize, r: u32, pad: u32) -> Vec<u32> {
    let e = set.example(i, r);
    let (a, b) = e.needle_span;
    e.tokens[..a]
        .iter()
        .chain(&e.tokens[b..])
        .copied()
        .filter(|&t| t != pad)
        .collect()
}

/// The layout checks of one set: phase, length, value and answers, and what stays
/// fixed across the phases of a logical example under each protocol.
fn check_layout(set: &TextNeedleSet, sp: TextTokens) {
    let cfg = &set.config;
    let p = cfg.period.len();
    for i in 0..cfg.n_logical {
        let e0 = set.example(i, 0);
        for r in 0..p as u32 {
            let e = set.example(i, r);
            assert_eq!(e.tokens.len(), cfg.length, "length at phase {r}");
            assert_eq!(
                e.value_span.0 % p,
                r as usize,
                "value position {} at phase {r}",
                e.value_span.0
            );
            assert_eq!(e.phase.residue(), r);
            assert_eq!(e.logical_id, i as u64);
            // The value in the needle is the answer; teacher forcing puts it after each target.
            assert_eq!(&e.tokens[e.value_span.0..e.value_span.1], &e.answers[..]);
            for (k, &tp) in e.target_positions.iter().enumerate() {
                assert_eq!(e.tokens[tp + 1], e.answers[k]);
            }
            assert!(!e.wrong_first.is_empty() && !e.wrong_first.contains(&e.answers[0]));
            assert_eq!(e.tokens[0], sp.bos.unwrap_or(e.tokens[0]));
            let needle = |x: &phaselens::tasks::TextNeedleExample| {
                x.tokens[x.needle_span.0..x.needle_span.1].to_vec()
            };
            assert_eq!(needle(e), needle(e0));
            assert_eq!(
                without_needle_and_pads(set, i, r, sp.pad),
                without_needle_and_pads(set, i, 0, sp.pad),
                "logical {i}: only the needle (in-sequence) or the pads (prefix) move"
            );
            match cfg.protocol {
                Protocol::PrefixPadding => {
                    let lead = usize::from(sp.bos.is_some());
                    assert!(e.tokens[lead..lead + e.shift].iter().all(|&t| t == sp.pad));
                    assert_eq!(e.value_span.0, e0.value_span.0 + e.shift - e0.shift);
                    let tail = &e.tokens[cfg.length - (p - 1 - e.shift)..];
                    assert!(tail.iter().all(|&t| t == sp.pad));
                }
                Protocol::InSequencePadding => {
                    assert!(e.tokens.iter().skip(1).all(|&t| t != sp.pad), "no pads");
                    assert_eq!(e.target_positions, e0.target_positions, "the query stays");
                }
            }
        }
    }
}

/// Filler differs between logical examples; the same seed gives the same set, another
/// seed another.
fn check_variety_and_seeds(
    tok: &Tokenizer,
    sp: TextTokens,
    cfg: &TextNeedleConfig,
    set: &TextNeedleSet,
) {
    let fill = |i: usize| {
        let e = set.example(i, 0);
        e.tokens[e.filler_span.0..e.needle_span.0].to_vec()
    };
    let distinct: BTreeSet<Vec<u32>> = (0..cfg.n_logical).map(fill).collect();
    assert_eq!(
        distinct.len(),
        cfg.n_logical,
        "every logical example has its own filler"
    );
    assert_eq!(
        &generate_text_needle_set(tok, sp, cfg).unwrap(),
        set,
        "same seed, same set"
    );
    let other = TextNeedleConfig {
        seed: cfg.seed + 1,
        ..cfg.clone()
    };
    let o = generate_text_needle_set(tok, sp, &other).unwrap();
    assert_ne!(
        o.examples[0].tokens, set.examples[0].tokens,
        "another seed, other prompts"
    );
}

/// With `n_logical` a multiple of P, every phase group has the same mean value position.
fn check_matched_means(set: &TextNeedleSet) {
    let p = set.config.period.len() as u32;
    let mean = |r: u32| set.group(r).map(|e| e.value_span.0).sum::<usize>();
    let m0 = mean(0);
    for r in 1..p {
        assert_eq!(mean(r), m0, "sum of value positions at phase {r}");
    }
}

fn check_all(tok: &Tokenizer, sp: TextTokens, length: usize, n: usize) -> Vec<TextNeedleSet> {
    let mut sets = Vec::new();
    for task in [TextTask::Passkey, TextTask::Needle] {
        for proto in Protocol::ALL {
            let cfg = config(task, proto, length, n, 7);
            let set = generate_text_needle_set(tok, sp, &cfg).unwrap();
            assert_eq!(set.examples.len(), n * 8);
            check_layout(&set, sp);
            check_variety_and_seeds(tok, sp, &cfg, &set);
            check_matched_means(&set);
            sets.push(set);
        }
    }
    sets
}

#[test]
fn tiny_tokenizer_puts_the_value_at_every_phase_under_both_protocols() {
    let tok = tiny_tokenizer();
    let sp = TextTokens {
        pad: 0,
        bos: Some(1),
    };
    let sets = check_all(&tok, sp, 200, 16);
    // No word of the prompt is unknown to the tokenizer (the vocabulary covers them).
    for s in &sets {
        assert!(s.examples.iter().all(|e| !e.tokens.contains(&2)));
    }
    // The pass key's digits are one token each here.
    assert!(sets[0].examples.iter().all(|e| e.answers.len() == 5));
}

/// Decoded prompts contain the needle sentence and whole filler sentences, none twice.
fn check_decoded(tok: &Tokenizer, set: &TextNeedleSet) {
    for e in set.examples.iter().step_by(3) {
        let text = tok.decode(&e.tokens, true).unwrap();
        assert!(
            text.contains(&e.needle_text),
            "{:?} not in {text:?}",
            e.needle_text
        );
        let mut seen = 0;
        for s in FILLER_SENTENCES {
            let k = text.matches(s).count();
            assert!(k <= 1, "{s:?} repeated in one prompt");
            seen += k;
        }
        assert!(
            seen >= 10,
            "only {seen} whole filler sentences in a 512-token prompt"
        );
    }
}

#[test]
fn real_tokenizers_put_the_value_at_every_phase_and_decode_to_the_needle() {
    for rel in [SMOLLM2, GEMMA3] {
        let Some((tok, sp)) = real(rel) else { continue };
        let sets = check_all(&tok, sp, 512, 16);
        for set in &sets {
            check_decoded(&tok, set);
        }
        // Every digit of the pass key is its own token on both tokenizers.
        for e in &sets[0].examples {
            assert_eq!(e.answers.len(), 5, "{rel}: {:?}", e.value);
            assert_eq!(e.wrong_first.len(), 9, "{rel}: the nine other first digits");
        }
        // The needle task draws several facts and values.
        let values: BTreeSet<&str> = sets[2].examples.iter().map(|e| e.value.as_str()).collect();
        assert!(values.len() >= 8, "{rel}: {values:?}");
    }
}

#[test]
fn the_filler_pool_is_large_varied_and_never_answers_the_question() {
    let distinct: BTreeSet<&&str> = FILLER_SENTENCES.iter().collect();
    assert!(FILLER_SENTENCES.len() >= 100);
    assert_eq!(
        distinct.len(),
        FILLER_SENTENCES.len(),
        "no sentence twice in the pool"
    );
    let words: BTreeSet<String> = builtin_facts()
        .iter()
        .flat_map(|f| f.values.iter().map(|v| v.to_lowercase()))
        .collect();
    for s in FILLER_SENTENCES {
        assert!(
            !s.chars().any(|c| c.is_ascii_digit()),
            "{s:?} holds a digit"
        );
        assert!(!s.to_lowercase().contains("pass key"), "{s:?}");
        for w in pieces(s) {
            assert!(
                !words.contains(&w.to_lowercase()),
                "{s:?} holds the value word {w:?}"
            );
        }
    }
}

#[test]
fn impossible_text_configs_name_their_key() {
    let tok = tiny_tokenizer();
    let sp = TextTokens {
        pad: 0,
        bos: Some(1),
    };
    let base = config(TextTask::Needle, Protocol::PrefixPadding, 200, 8, 1);
    let bad_fact = Fact {
        sentence: "no slot here.".into(),
        question: "What?".into(),
        values: vec!["oak".into(), "barn".into()],
    };
    let one_value = Fact {
        sentence: "The old {value}.".into(),
        question: "Which?".into(),
        values: vec!["oak".into()],
    };
    let cases: Vec<(TextNeedleConfig, &str)> = vec![
        (
            TextNeedleConfig {
                length: 20,
                ..base.clone()
            },
            "`length`",
        ),
        (
            TextNeedleConfig {
                length: 0,
                ..base.clone()
            },
            "`length`",
        ),
        (
            TextNeedleConfig {
                depth: [0.9, 0.1],
                ..base.clone()
            },
            "`depth`",
        ),
        (
            TextNeedleConfig {
                depth: [f64::NAN, 0.5],
                ..base.clone()
            },
            "`depth`",
        ),
        (
            TextNeedleConfig {
                n_logical: 0,
                ..base.clone()
            },
            "`n_logical`",
        ),
        (
            TextNeedleConfig {
                facts: vec![],
                ..base.clone()
            },
            "`facts`",
        ),
        (
            TextNeedleConfig {
                facts: vec![bad_fact],
                ..base.clone()
            },
            "`facts[0].sentence`",
        ),
        (
            TextNeedleConfig {
                facts: vec![one_value],
                ..base.clone()
            },
            "`facts[0].values`",
        ),
        (
            TextNeedleConfig {
                task: TextTask::Passkey,
                digits: 0,
                ..base.clone()
            },
            "`digits`",
        ),
    ];
    for (cfg, want) in cases {
        let err = generate_text_needle_set(&tok, sp, &cfg)
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
}

fn parse(text: &str) -> Result<(), String> {
    Experiment::parse(Path::new("exp/t.toml"), text.to_string())
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[test]
fn experiment_files_take_task_kind_passkey_and_needle_in_phase_sweep_only() {
    let head =
        |kind: &str| format!("[experiment]\nkind = \"{kind}\"\n[model]\npath = \"m\"\n[task]\n");
    let ok = format!(
        "{}kind = \"passkey\"\n[task.text]\nlength = 256\ndigits = 4\n",
        head("phase-sweep")
    );
    parse(&ok).unwrap();
    let needle = format!(
        "{}kind = \"needle\"\n[task.text]\ndepth = [0.2, 0.8]\nfacts = [{{ sentence = \"The old {{value}}.\", question = \"Which?\", values = [\"oak\", \"barn\"] }}]\n",
        head("phase-sweep")
    );
    parse(&needle).unwrap();
    let cases = [
        (
            format!("{}kind = \"passkey\"\n", head("ablate-heads")),
            "[task] kind",
        ),
        (
            format!("{}kind = \"riddle\"\n", head("phase-sweep")),
            "riddle",
        ),
        (
            format!("{}[task.text]\nlength = 256\n", head("phase-sweep")),
            "[task] text",
        ),
        (
            format!(
                "{}kind = \"passkey\"\n[task.text]\nlenght = 256\n",
                head("phase-sweep")
            ),
            "lenght",
        ),
        (
            format!(
                "{}kind = \"passkey\"\nprompt = {{ n_bindings = 4 }}\n",
                head("phase-sweep")
            ),
            "[task] prompt",
        ),
        (
            format!(
                "{}kind = \"passkey\"\n[task.text]\nfacts = []\n",
                head("phase-sweep")
            ),
            "[task] text",
        ),
    ];
    for (text, want) in cases {
        let err = parse(&text).unwrap_err();
        assert!(err.contains(want), "{want}: {err}");
    }
}

/// The experiment file of the end-to-end test: SmolLM2, `kind`, 96 tokens, P = 4.
fn smollm2_text_experiment(model: &Path, kind: &str, extra: &str) -> String {
    format!(
        "[experiment]\nkind = \"phase-sweep\"\nbootstrap_reps = 40\nmax_rows = 4\n[model]\npath = {m:?}\nname = \"smollm2\"\nweights = \"f32\"\n[task]\nkind = \"{kind}\"\nvocab = {{ kind = \"hugging_face\", tokenizer = {m:?}, pad = \"<|endoftext|>\" }}\nperiod = 4\nn_logical = 4\nseed = 3\nallow_period_mismatch = true\n[task.text]\n{extra}\n",
        m = model.display().to_string()
    )
}

/// Correct prompts of phase group `r` scored here, independently of the runner: the
/// argmax of a plain forward at each value position.
fn rescored_correct(
    model: &dyn phaselens::model::LanguageModel,
    set: &TextNeedleSet,
    r: u32,
) -> u64 {
    use burn::tensor::{Int, Tensor, TensorData};
    let mut correct = 0;
    for e in set.group(r) {
        let ids: Vec<i64> = e.tokens.iter().map(|&t| i64::from(t)).collect();
        let n = ids.len();
        let t = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, n]), &super::common::dev());
        let logits = model
            .forward(t, &phaselens::hooks::HookSpec::new())
            .unwrap()
            .logits;
        let top = logits
            .argmax(2)
            .into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .unwrap();
        let ok = e
            .target_positions
            .iter()
            .zip(&e.answers)
            .all(|(&p, &a)| top[p] == i64::from(a));
        correct += u64::from(ok);
    }
    correct
}

#[test]
fn phase_sweep_runs_the_passkey_on_smollm2_scores_as_a_plain_forward_and_resumes() {
    use phaselens::output::{Table, read_phase_accuracy_rows};
    use phaselens::runner::run_experiment;
    let Some(model) = model_file(SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let text = smollm2_text_experiment(&model, "passkey", "length = 96\ndigits = 4\n");
    let exp = super::common::runner::experiment(d, "pk.toml", &text);
    let s = run_experiment(&exp, &super::common::runner::opts(d)).unwrap();
    assert_eq!(
        s.stats.cells_computed,
        2 * 4 * 4,
        "both protocols x 4 phases x 4 prompts"
    );
    let base = d.join("notebooks-data/pk/smollm2");
    let t = Table::read_arrow(base.join("phase_accuracy.arrow")).unwrap();
    let rows = read_phase_accuracy_rows(&t).unwrap();
    assert_eq!(rows.len(), 2 * 4);
    // The runner's counts equal an independent scoring of the same prompts.
    let m = phaselens::model::load_model_with(
        &model,
        &super::common::dev(),
        phaselens::model::Residency::F32,
    )
    .unwrap();
    let tok = real(SMOLLM2).unwrap();
    let cfg = TextNeedleConfig {
        digits: 4,
        length: 96,
        n_logical: 4,
        seed: 3,
        period: Period::new(4).unwrap(),
        ..TextNeedleConfig::default()
    };
    let set = generate_text_needle_set(&tok.0, tok.1, &cfg).unwrap();
    for r in rows.iter().filter(|r| r.protocol == "prefix") {
        assert_eq!(r.n, 4);
        assert_eq!(
            r.correct,
            rescored_correct(m.as_ref(), &set, r.phase),
            "phase {}",
            r.phase
        );
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(base.join("summary.json")).unwrap()).unwrap();
    let ld = summary["protocols"]["in_sequence_padding"]["logit_diff_by_phase"]
        .as_array()
        .unwrap();
    assert_eq!(ld.len(), 4);
    assert!(ld.iter().all(|v| v.as_f64().unwrap().is_finite()));
    // A second run resumes every prompt.
    let again = run_experiment(&exp, &super::common::runner::opts(d)).unwrap();
    assert_eq!(
        (again.stats.cells_computed, again.stats.cells_resumed),
        (0, 32)
    );
    // An impossible [task.text] value is named at its key.
    let bad = super::common::runner::experiment(
        d,
        "bad.toml",
        &smollm2_text_experiment(&model, "needle", "length = 30\n"),
    );
    let err = run_experiment(&bad, &super::common::runner::opts(d))
        .unwrap_err()
        .to_string();
    assert!(err.contains("[task.text] length"), "{err}");
}
