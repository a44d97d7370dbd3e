//! patch-heads end to end, the batched routine against the one-forward-per-cell
//! loop, exactness, resume, and the checks before compute.

use crate::common::runner::*;
use phaselens::hooks::{Action, HookPoint, Site};
use phaselens::output::{
    LONG_COLUMNS, META_EXPERIMENT_TOML, META_VERSION, Table, read_long_rows, validate_columns,
};
use phaselens::runner::patching::{
    Cell, ChunkPath, Edit, Fill, Positions, base_run, captures_for, plan_chunks, plan_suffix,
    run_cell_naive, run_chunk, run_chunk_with,
};
use phaselens::runner::run_experiment;
use phaselens::tasks::prompts::{group_examples, paired_prompts};
use phaselens::tasks::{
    KvEvalConfig, KvPromptConfig, Period, Protocol, TokenSpace, generate_eval_set,
};

const PATCH: &str = r#"
[experiment]
kind = "patch-heads"
bootstrap_reps = 50

[model]
organism = "tiny"

[task]
n_logical = 8
"#;

#[test]
fn patch_heads_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let exp = experiment(d, "patch.toml", PATCH);
    let s = run_experiment(&exp, &opts(d)).unwrap();
    // 4 phases x 2 directions x 2 layers x (4 query + 2 KV heads)
    assert_eq!(s.stats.cells_computed, 4 * 2 * 2 * 6);

    let path = d.join("notebooks-data/patch/heads.arrow");
    let t = Table::read_arrow(&path).unwrap();
    validate_columns(&t, LONG_COLUMNS).unwrap();
    assert_eq!(t.metadata()[META_VERSION], env!("CARGO_PKG_VERSION"));
    assert_eq!(t.metadata()[META_EXPERIMENT_TOML], PATCH);
    assert!(path.with_extension("parquet").exists());
    let rows = read_long_rows(&t).unwrap();
    let count = |m: &str| rows.iter().filter(|r| r.metric == m).count();
    // per cell: 4 phases + the pooled row
    assert_eq!(count("nld_denoise"), 12 * 5);
    assert_eq!(count("nld_noise"), 12 * 5);
    assert_eq!(count("specialization"), 12);
    for r in rows.iter().filter(|r| r.metric == "accuracy") {
        assert!((0.0..=1.0).contains(&r.value), "{r:?}");
        assert_eq!(r.n, 8);
        let (lo, hi) = (r.ci_lo.unwrap(), r.ci_hi.unwrap());
        assert!(lo <= r.value + 1e-12 && r.value <= hi + 1e-12, "{r:?}");
    }
    for r in rows
        .iter()
        .filter(|r| r.metric == "specialization" && r.value.is_finite())
    {
        assert!((0.0..=1.0).contains(&r.value));
    }
    assert!(rows.iter().any(|r| r.metric == "phase_gap_pp"));

    let rep = d.join("reports/patch");
    for f in [
        "report.md",
        "report.html",
        "accuracy_by_phase.png",
        "accuracy_by_phase.svg",
        "nld_denoise_phase0.png",
        "nld_denoise_phase3.svg",
        "nld_noise_all_phases.png",
        "nld_denoise_kv.png",
        "specialization_map.png",
        "specialization_index.svg",
    ] {
        assert!(rep.join(f).exists(), "missing {f}");
    }
    let md = std::fs::read_to_string(rep.join("report.md")).unwrap();
    assert!(
        md.contains("Phase gap") && md.contains("Mean accuracy"),
        "{md}"
    );
    assert!(md.contains("specialized heads") || md.contains("large enough to rank"));
}

#[test]
fn patching_every_head_of_a_one_layer_model_restores_clean() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // One layer, one KV head: the KV-head cell patches every query head's z.
    organism(d, "tiny", &tiny(1, 4, 1, 4, 4), 3);
    let exp = experiment(
        d,
        "exact.toml",
        &format!("{PATCH}\n[patch]\nhead_kinds = [\"kv\"]\n"),
    );
    run_experiment(&exp, &opts(d)).unwrap();
    let t = Table::read_arrow(d.join("notebooks-data/exact/heads.arrow")).unwrap();
    let rows = read_long_rows(&t).unwrap();
    let den: Vec<_> = rows.iter().filter(|r| r.metric == "nld_denoise").collect();
    let noi: Vec<_> = rows.iter().filter(|r| r.metric == "nld_noise").collect();
    assert_eq!(den.len(), 5);
    for r in den {
        assert!((r.value - 1.0).abs() < 1e-4, "denoising all heads: {r:?}");
    }
    for r in noi {
        assert!(r.value.abs() < 1e-4, "noising all heads: {r:?}");
    }
}

pub(crate) fn tiny_prompts(
    space: &TokenSpace,
    r: u32,
    n: usize,
) -> phaselens::runner::patching::Prompts {
    let cfg = KvEvalConfig {
        prompt: KvPromptConfig {
            n_bindings: 8,
            n_queries: 2,
            ..KvPromptConfig::default()
        },
        period: Period::new(4).unwrap(),
        protocol: Protocol::PrefixPadding,
        n_logical: 32,
        seed: 5,
    };
    let set = generate_eval_set(space, &cfg).unwrap();
    let ex = group_examples(&set, r, n);
    paired_prompts(&ex, space, 0, 1, 9).unwrap().0
}

#[test]
fn batched_routine_equals_one_forward_per_cell() {
    let model = random_model(&tiny(2, 4, 2, 4, 4), 7);
    let space = TokenSpace::default_synthetic();
    let prompts = tiny_prompts(&space, 3, 6);
    let n = 6;
    let corrupted: Vec<usize> = (n..2 * n).collect();
    let clean: Vec<usize> = (0..n).collect();
    let z = |l| HookPoint::block(l, Site::AttnZ);
    let rep = |point, heads: Option<Vec<usize>>, positions, fill, prompts: &Vec<usize>| Cell {
        edit: Edit::Replace {
            point,
            heads,
            positions,
            fill,
        },
        prompts: prompts.clone(),
    };
    let cells = vec![
        rep(
            z(0),
            Some(vec![1]),
            Positions::All,
            Fill::Source,
            &corrupted,
        ),
        rep(
            z(0),
            Some(vec![2, 3]),
            Positions::Answer,
            Fill::Source,
            &clean,
        ),
        rep(
            z(1),
            Some(vec![0]),
            Positions::Final(3),
            Fill::Source,
            &corrupted,
        ),
        rep(z(1), Some(vec![3]), Positions::All, Fill::Zero, &clean),
        rep(z(1), Some(vec![2]), Positions::All, Fill::Mean, &clean),
        rep(
            z(0),
            Some(vec![0]),
            Positions::All,
            Fill::Resample,
            &corrupted,
        ),
        rep(
            HookPoint::block(1, Site::AttnOut),
            None,
            Positions::Final(2),
            Fill::Mean,
            &clean,
        ),
        rep(
            HookPoint::block(1, Site::ResidPre),
            None,
            Positions::Answer,
            Fill::Source,
            &corrupted,
        ),
        Cell {
            edit: Edit::Transform {
                points: vec![
                    HookPoint::block(0, Site::KeyGate),
                    HookPoint::block(1, Site::ValueGate),
                ],
                action: Box::new(Action::Roll { axis: 2, shift: 1 }),
                heads: None,
            },
            prompts: clean.clone(),
        },
    ];
    let base = base_run(&model, &prompts, &captures_for(&cells).unwrap()).unwrap();
    // Small max_rows: several chunks per layer; large: everything of a layer in one.
    for max_rows in [12, 1000] {
        let chunks = plan_chunks(&cells, max_rows).unwrap();
        for ch in &chunks {
            let got = run_chunk(&model, &prompts, &base, &cells, ch).unwrap();
            for (&c, out) in ch.iter().zip(got) {
                let want = run_cell_naive(&model, &prompts, &base, &cells[c]).unwrap();
                assert_eq!(out.len(), want.len());
                for (a, b) in out.iter().zip(&want) {
                    assert!((a.ld - b.ld).abs() < 1e-4, "cell {c}: {} vs {}", a.ld, b.ld);
                    assert_eq!(a.correct, b.correct, "cell {c}");
                }
            }
        }
    }
    // The edits matter (a no-op routine would pass the comparison above trivially).
    let out = run_chunk(&model, &prompts, &base, &cells, &[0]).unwrap();
    let moved = out[0]
        .iter()
        .zip(&base.outcomes[n..])
        .any(|(a, b)| (a.ld - b.ld).abs() > 1e-3);
    assert!(moved, "patching head 1 of layer 0 changed nothing");
    // Patching the whole residual stream entering layer 0 gives the clean logits.
    let full = Cell {
        edit: Edit::Replace {
            point: HookPoint::block(0, Site::ResidPre),
            heads: None,
            positions: Positions::All,
            fill: Fill::Source,
        },
        prompts: corrupted.clone(),
    };
    let base = base_run(
        &model,
        &prompts,
        &captures_for(std::slice::from_ref(&full)).unwrap(),
    )
    .unwrap();
    let out = run_chunk(&model, &prompts, &base, &[full], &[0]).unwrap();
    for (i, o) in out[0].iter().enumerate() {
        // A corrupted row reads logit(corrupt) - logit(clean): the clean run's LD negated.
        assert!((o.ld + base.outcomes[i].ld).abs() < 1e-4);
    }
}

/// Layer 0's hook_z zeroed at every position of `prompts` (a cell that never runs as a
/// suffix forward).
fn zero_every_position(prompts: &[usize]) -> Cell {
    Cell {
        edit: Edit::Replace {
            point: HookPoint::block(0, Site::AttnZ),
            heads: None,
            positions: Positions::All,
            fill: Fill::Zero,
        },
        prompts: prompts.to_vec(),
    }
}

/// A replacement's positions, fill and the prompts it applies to.
type Variant<'a> = (Positions, Fill, &'a Vec<usize>);

/// Replacement cells: for every layer `l < layers`, every `(site, heads)` of `sites(l)`
/// and every variant.
fn replace_cells(
    layers: usize,
    sites: impl Fn(usize) -> Vec<(Site, Option<Vec<usize>>)>,
    variants: &[Variant],
) -> Vec<Cell> {
    let mut cells = Vec::new();
    for l in 0..layers {
        for (site, heads) in sites(l) {
            for (positions, fill, rows) in variants {
                cells.push(Cell {
                    edit: Edit::Replace {
                        point: HookPoint::block(l, site),
                        heads: heads.clone(),
                        positions: positions.clone(),
                        fill: *fill,
                    },
                    prompts: (*rows).clone(),
                });
            }
        }
    }
    cells
}

#[test]
fn suffix_path_equals_the_full_path() {
    let space = TokenSpace::default_synthetic();
    let prompts = tiny_prompts(&space, 1, 6);
    let n = 6;
    let corrupted: Vec<usize> = (n..2 * n).collect();
    let clean: Vec<usize> = (0..n).collect();
    let mut full_cfg = tiny(3, 4, 2, 4, 4);
    full_cfg.attention = phaselens::model::kvc::AttentionKind::Full;
    full_cfg.compression = None;
    for cfg in [tiny(3, 4, 2, 4, 4), tiny(3, 4, 2, 8, 4), full_cfg] {
        let model = random_model(&cfg, 3);
        let cells = replace_cells(
            3,
            |l| {
                vec![
                    (Site::AttnZ, Some(vec![l % 4])),
                    (Site::AttnZ, Some(vec![0, 1])),
                    (Site::AttnOut, None),
                    (Site::ResidPre, None),
                    (Site::MlpOut, None),
                    (Site::AttnV, Some(vec![1])),
                    (Site::AttnResult, Some(vec![2])),
                ]
            },
            &[
                (Positions::Answer, Fill::Source, &corrupted),
                (Positions::Answer, Fill::Source, &clean),
                (Positions::Final(3), Fill::Mean, &clean),
                (Positions::Answer, Fill::Zero, &corrupted),
                (Positions::Final(2), Fill::Resample, &corrupted),
            ],
        );
        let base = base_run(&model, &prompts, &captures_for(&cells).unwrap()).unwrap();
        assert!(
            base.state.is_some(),
            "kvc base runs keep their prefix state"
        );
        let mut moved = 0;
        for ch in plan_chunks(&cells, 48).unwrap() {
            let sfx = plan_suffix(&prompts, &cells, &ch).expect("answer / final-band edits");
            assert!(sfx.len <= 3 && sfx.len < prompts.len / 2, "{sfx:?}");
            let fast = run_chunk(&model, &prompts, &base, &cells, &ch).unwrap();
            let full =
                run_chunk_with(&model, &prompts, &base, &cells, &ch, ChunkPath::Full).unwrap();
            for ((&c, a), b) in ch.iter().zip(&fast).zip(&full) {
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    assert!(
                        (x.ld - y.ld).abs() < 1e-4,
                        "cell {c} row {i}: {} vs {}",
                        x.ld,
                        y.ld
                    );
                    assert_eq!(x.correct, y.correct, "cell {c} row {i}");
                    let p = cells[c].prompts[i];
                    if (x.ld - base.outcomes[p].ld).abs() > 1e-3 {
                        moved += 1;
                    }
                }
            }
        }
        assert!(moved > cells.len(), "the edits changed too little: {moved}");
    }
    // "All positions" and transforms keep the full path.
    let all = zero_every_position(&clean);
    assert!(plan_suffix(&prompts, &[all], &[0]).is_none());
    let roll = Cell {
        edit: Edit::Transform {
            points: vec![HookPoint::block(0, Site::KeyGate)],
            action: Box::new(Action::Roll { axis: 2, shift: 1 }),
            heads: None,
        },
        prompts: clean,
    };
    assert!(plan_suffix(&prompts, &[roll], &[0]).is_none());
}

#[test]
fn resume_skips_finished_cells() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let text = PATCH.replace("bootstrap_reps = 50", "bootstrap_reps = 50\nmax_rows = 16");
    let exp = experiment(d, "res.toml", &text);
    let mut o = opts(d);
    o.figures = false;
    let first = run_experiment(&exp, &o).unwrap();
    let total = first.stats.cells_computed;
    assert_eq!(total, 96);
    let table = d.join("notebooks-data/res/heads.arrow");
    let rows1 = read_long_rows(&Table::read_arrow(&table).unwrap()).unwrap();

    let again = run_experiment(&exp, &o).unwrap();
    assert_eq!(again.stats.cells_computed, 0);
    assert_eq!(again.stats.cells_resumed, total);
    let rows2 = read_long_rows(&Table::read_arrow(&table).unwrap()).unwrap();
    assert_eq!(format!("{rows1:?}"), format!("{rows2:?}"));

    // Lose one chunk (as if killed before it was written): only it is recomputed.
    // Shards live in one folder per settings hash.
    let folders: Vec<_> = std::fs::read_dir(d.join("notebooks-data/res/shards"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(folders.len(), 1, "{folders:?}");
    let victim = folders[0].join("p2-c0001.arrow");
    assert!(victim.exists());
    std::fs::remove_file(&victim).unwrap();
    let third = run_experiment(&exp, &o).unwrap();
    assert_eq!(
        third.stats.cells_computed, 2,
        "16 rows / 8 prompts = 2 cells per chunk"
    );
    assert_eq!(third.stats.cells_resumed, total - 2);
    let rows3 = read_long_rows(&Table::read_arrow(&table).unwrap()).unwrap();
    assert_eq!(format!("{rows1:?}"), format!("{rows3:?}"));

    // Other settings: the old shards are not reused.
    let exp2 = experiment(
        d,
        "res.toml",
        &format!("{text}\n[patch]\npositions = \"answer\"\n"),
    );
    let fourth = run_experiment(&exp2, &o).unwrap();
    assert_eq!(fourth.stats.cells_computed, total);
    // ... and are kept: going back to the first settings recomputes nothing.
    let exp = experiment(d, "res.toml", &text);
    let fifth = run_experiment(&exp, &o).unwrap();
    assert_eq!(fifth.stats.cells_computed, 0);
    assert_eq!(fifth.stats.cells_resumed, total);
}

#[test]
fn checks_name_the_key_before_compute() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let o = opts(d);
    let err = |text: &str| {
        let p = experiment(d, "bad.toml", text);
        run_experiment(&p, &o).unwrap_err().to_string()
    };
    let e = err(&format!("{PATCH}\n[patch]\nlayers = [0, 5]\n"));
    assert!(
        e.contains("bad.toml")
            && e.contains("line 13")
            && e.contains("layers")
            && e.contains("out of range"),
        "{e}"
    );
    let e = err(&format!("{PATCH}\n[patch]\nheads = [4]\n"));
    assert!(e.contains("heads") && e.contains("4"), "{e}");
    let e = err(&PATCH.replace("n_logical = 8", "n_logical = 8\nperiod = 3"));
    assert!(e.contains("period") && e.contains("stride"), "{e}");
    let p = experiment(
        d,
        "override.toml",
        &PATCH.replace(
            "n_logical = 8",
            "n_logical = 8\nperiod = 3\nallow_period_mismatch = true",
        ),
    );
    let s = run_experiment(&p, &o).unwrap();
    assert!(
        s.notes.iter().any(|n| n.contains("not a multiple")),
        "{:?}",
        s.notes
    );
    let e = err(&format!("{PATCH}\n[ablate]\nmethods = [\"zero\"]\n"));
    assert!(e.contains("[ablate]") && e.contains("line 12"), "{e}");
    let e = err(&PATCH.replace("bootstrap_reps = 50", "bootstrap_reps = 50\nbogus = 1"));
    assert!(e.contains("bogus") && e.contains("line 5"), "{e}");
    write_recipe(d, "raw", &tiny(2, 4, 2, 4, 4));
    let e = err(&PATCH.replace("organism = \"tiny\"", "organism = \"raw\""));
    assert!(
        e.contains("not trained yet") && e.contains("just train"),
        "{e}"
    );
}

/// `mem.toml` of the test below, patching at every position.
fn exp_all(d: &std::path::Path) -> std::path::PathBuf {
    let text = format!(
        "{}\n[patch]\npositions = \"all\"\n",
        PATCH.replace("bootstrap_reps = 50", "bootstrap_reps = 50\nmax_rows = 256")
    );
    experiment(d, "mem-all.toml", &text)
}

/// The memory check counts a suffix chunk as its rows x the suffix length (plus one
/// layer's state over every position), not `max_rows` full-length rows: a budget below
/// what the old rule asked for lets answer-position patching run with many rows per
/// chunk, and a budget below the base run's captures is refused naming the keys.
#[test]
fn memory_check_counts_suffix_chunks_by_their_positions() {
    use phaselens::model::memory::{forward_bytes, set_budget};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let model = phaselens::model::load_model(&d.join("tiny"), &Default::default()).unwrap();
    let (info, weights) = (model.info(), 4.0 * model.n_params().unwrap() as f64);
    let text = format!(
        "{}\n[patch]\npositions = \"answer\"\n",
        PATCH.replace("bootstrap_reps = 50", "bootstrap_reps = 50\nmax_rows = 256")
    );
    let exp = experiment(d, "mem.toml", &text);
    let o = opts(d);
    // A budget that holds the weights but not a base run of 8-token prompts: the upfront
    // check names the forward's size and the keys.
    let small = forward_bytes(&info, 16, 8);
    assert!(small > 2.0 * weights, "{small} vs {weights}");
    set_budget(Some(small));
    let e = run_experiment(&exp, &o).unwrap_err().to_string();
    assert!(
        e.contains("set_budget") && e.contains("n_logical") && e.contains("a forward over 16 x"),
        "{e}"
    );
    let len: usize = e
        .split(" x ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no prompt length in: {e}"));
    // The base run: 16 prompts (8 logical, clean and corrupted) at full length.
    let base = forward_bytes(&info, 16, len);
    // What the old rule asked for: max_rows full-length rows.
    let old = forward_bytes(&info, 256, len);
    // Just above the base forward alone: the captures of cells patched at every
    // position (every position of hook_z and hook_resid_pre) do not fit; those of
    // answer-position cells (a window of positions, Base::window) do, and their suffix
    // chunks too: that run completes within the same budget (its own experiment file,
    // so that the run below computes its cells again).
    set_budget(Some(base * 1.01));
    let e = run_experiment(&exp_all(d), &o).unwrap_err().to_string();
    assert!(
        e.contains("base run") && e.contains("n_logical (8)") && e.contains("mem-all.toml"),
        "{e}"
    );
    let windowed = experiment(d, "mem-window.toml", &text);
    let s = run_experiment(&windowed, &o).unwrap();
    assert_eq!(s.stats.cells_computed, 4 * 2 * 2 * 6);
    // Three base forwards: enough for the base run with its captures and for chunks of
    // 96 suffix rows (12 cells x 8 prompts per layer) of a few positions each, a fifth
    // of what the old rule asked for.
    let budget = forward_bytes(&info, 48, len);
    assert!(old > 5.0 * budget, "{old} vs {budget}");
    set_budget(Some(budget));
    let s = run_experiment(&exp, &o).unwrap();
    assert_eq!(s.stats.cells_computed, 4 * 2 * 2 * 6);
    // The same budget with cells patched at every position: their chunks run as full
    // forwards of 96 rows, twice the budget, and the error names max_rows.
    let e = run_experiment(&exp_all(d), &o).unwrap_err().to_string();
    assert!(
        e.contains("patching chunk") && e.contains("max_rows (256)") && e.contains("full forward"),
        "{e}"
    );
    set_budget(None);
}

/// Values of `act: [b, t, ...]` at positions `w` of every row.
fn window_of(act: &phaselens::hooks::Act, w: &std::ops::Range<usize>) -> Vec<f32> {
    let s = act.shape();
    let per: usize = s[2..].iter().product();
    let v = act.to_vec();
    (0..s[0])
        .flat_map(|b| v[(b * s[1] + w.start) * per..(b * s[1] + w.end) * per].to_vec())
        .collect()
}

/// A base run whose cells all run as suffix forwards keeps its per-token captures at
/// the suffixes' positions only (`Base::window`), and its chunks give exactly the
/// outcomes of a base run that captured every position: kvc with compression, kvc with
/// full attention and DeepSeek-V4. A chunk that needs every position is refused on it.
#[test]
fn windowed_base_run_gives_the_outcomes_of_a_whole_one() {
    use phaselens::model::LanguageModel;
    use phaselens::runner::patching::{base_run_for, budget, capture_window};
    let space = TokenSpace::default_synthetic();
    let kvc_prompts = tiny_prompts(&space, 1, 6);
    let kvc = random_model(&tiny(3, 4, 2, 4, 4), 3);
    let mut full_cfg = tiny(3, 4, 2, 4, 4);
    full_cfg.attention = phaselens::model::kvc::AttentionKind::Full;
    full_cfg.compression = None;
    let full = random_model(&full_cfg, 4);
    let v4 = crate::edges::tiny_v4(13);
    let v4_prompts = pair_prompts(40, 1);
    let models: [(
        &str,
        &dyn LanguageModel,
        &phaselens::runner::patching::Prompts,
    ); 3] = [
        ("kvc", &kvc, &kvc_prompts),
        ("kvc full attention", &full, &kvc_prompts),
        ("deepseek-v4", &v4, &v4_prompts),
    ];
    for (name, model, prompts) in models {
        let n = prompts.n() / 2;
        let clean: Vec<usize> = (0..n).collect();
        let corrupted: Vec<usize> = (n..2 * n).collect();
        let cells = replace_cells(
            3,
            |l| {
                vec![
                    (Site::AttnZ, Some(vec![l % 2])),
                    (Site::ResidPre, None),
                    (Site::MlpOut, None),
                ]
            },
            &[
                (Positions::Answer, Fill::Source, &corrupted),
                (Positions::Final(3), Fill::Mean, &clean),
                (Positions::Final(2), Fill::Zero, &corrupted),
            ],
        );
        let whole = base_run(model, prompts, &captures_for(&cells).unwrap()).unwrap();
        assert!(whole.window.is_none(), "{name}");
        let windowed = base_run_for(model, prompts, &cells, 48).unwrap();
        let w = windowed
            .window
            .clone()
            .unwrap_or_else(|| panic!("{name}: no window"));
        assert_eq!(Some(w.clone()), capture_window(prompts, &cells), "{name}");
        assert!(
            2 * w.len() < prompts.len,
            "{name}: window {w:?} of {}",
            prompts.len
        );
        assert_eq!(windowed.cache.len(), whole.cache.len(), "{name}");
        for (p, act) in windowed.cache.iter() {
            let all = whole.cache.get(p).unwrap();
            assert!(p.site.info().per_token, "{name}: {p}");
            let mut want = all.shape().to_vec();
            want[1] = w.len();
            assert_eq!(act.shape(), want.as_slice(), "{name}: {p}");
            assert_eq!(act.to_vec(), window_of(all, &w), "{name}: {p}");
        }
        let mut moved = 0;
        for ch in plan_chunks(&cells, 8).unwrap() {
            let a = run_chunk(model, prompts, &whole, &cells, &ch).unwrap();
            let b = run_chunk(model, prompts, &windowed, &cells, &ch).unwrap();
            for ((&c, a), b) in ch.iter().zip(&a).zip(&b) {
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    assert_eq!(
                        (x.correct, x.ld.to_bits()),
                        (y.correct, y.ld.to_bits()),
                        "{name}: cell {c} row {i}: {} vs {}",
                        x.ld,
                        y.ld
                    );
                    if (x.ld - windowed.outcomes[cells[c].prompts[i]].ld).abs() > 1e-3 {
                        moved += 1;
                    }
                }
            }
        }
        assert!(
            moved > cells.len(),
            "{name}: the edits changed too little: {moved}"
        );
        // The memory check counts the window, not every position.
        let info = model.info();
        let pts = captures_for(&cells).unwrap();
        let (rows, len) = (prompts.n(), prompts.len);
        let kept = budget::base_captures_bytes(&info, &pts, rows, len, Some(w.len()));
        let all = budget::base_captures_bytes(&info, &pts, rows, len, None);
        assert!(
            (kept * len as f64 - all * w.len() as f64).abs() < 1e-6 * all * w.len() as f64,
            "{name}: {kept} vs {all}"
        );
        // A cell that reads every position cannot run on the windowed base run.
        let every = zero_every_position(&clean);
        let err = run_chunk(model, prompts, &windowed, &[every], &[0])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("kept positions {}..{}", w.start, w.end)),
            "{name}: {err}"
        );
    }
}

/// A base run over more tokens than one block (`budget::BASE_BLOCK_TOKENS`) runs as
/// blocks of rows, several at once, stacked: its outcomes, captures and prefix state are
/// those of one forward over every prompt (within float rounding: a row's products are
/// shared with fewer rows), its chunks (suffix forwards over its state) give that
/// forward's chunks' outcomes, and it is bit-identical in pools of 1 and 3 threads.
/// kvc with compression and DeepSeek-V4 (whose state also holds pooled entries), in
/// uneven blocks of 3 + 1 rows.
#[test]
fn a_base_run_in_blocks_of_rows_is_one_forward_over_every_prompt() {
    use phaselens::hooks::HookSpec;
    use phaselens::model::LanguageModel;
    use phaselens::runner::patching::{Base, budget, readout};
    use std::sync::Arc;
    let len = 1100;
    let prompts = pair_prompts(len, len - 40);
    assert_eq!(budget::base_blocks(4, len), vec![0..3, 3..4]);
    let kvc = random_model(&tiny(3, 4, 2, 4, 4), 3);
    let v4 = crate::edges::tiny_v4(13);
    let models: [(&str, &dyn LanguageModel); 2] = [("kvc", &kvc), ("deepseek-v4", &v4)];
    let (clean, corrupted) = (vec![0, 1], vec![2, 3]);
    let cells = replace_cells(
        3,
        |l| vec![(Site::AttnZ, Some(vec![l % 2])), (Site::ResidPre, None)],
        &[
            (Positions::Answer, Fill::Source, &corrupted),
            (Positions::Final(3), Fill::Mean, &clean),
        ],
    );
    let captures = captures_for(&cells).unwrap();
    let bits =
        |a: &phaselens::hooks::Act| a.to_vec().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for (name, model) in models {
        let pool = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
        };
        let in_pool = |threads: usize| {
            pool(threads).install(|| base_run(model, &prompts, &captures).unwrap())
        };
        let blocked = in_pool(3);
        let one = in_pool(1);
        // Plain forwards of one prompt each, several at once, give the same outcomes.
        let eval = |threads: usize| {
            pool(threads)
                .install(|| phaselens::runner::patching::evaluate(model, &prompts, 1).unwrap())
        };
        let (e1, e3) = (eval(1), eval(3));
        for ((a, b), c) in e1.iter().zip(&e3).zip(&blocked.outcomes) {
            assert_eq!(
                a.ld.to_bits(),
                b.ld.to_bits(),
                "{name}: evaluate at 1 and 3 threads"
            );
            assert!((a.ld - c.ld).abs() < 1e-4, "{name}: {} vs {}", a.ld, c.ld);
        }
        assert_eq!(e1.len(), 4);
        let ld = |b: &Base| {
            b.outcomes
                .iter()
                .map(|o| o.ld.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            ld(&blocked),
            ld(&one),
            "{name}: outcomes at 1 and 3 threads"
        );
        for (p, a) in blocked.cache.iter() {
            assert_eq!(bits(a), bits(one.cache.get(p).unwrap()), "{name}: {p}");
        }
        // One forward over every prompt.
        let mut spec = HookSpec::new();
        for p in &captures {
            spec = spec.capture_point(*p);
        }
        let all: Vec<usize> = (0..4).collect();
        let (out, state) = model
            .forward_with_state(prompts.tokens_of(&all, &crate::common::dev()), &spec)
            .unwrap();
        let targets: Vec<_> = prompts.targets.iter().collect();
        let whole = Base {
            outcomes: readout(out.logits, &targets).unwrap(),
            cache: Arc::new(out.cache),
            state: state.map(Arc::new),
            stages: Default::default(),
            window: None,
        };
        for (a, b) in blocked.outcomes.iter().zip(&whole.outcomes) {
            assert!((a.ld - b.ld).abs() < 1e-4, "{name}: {} vs {}", a.ld, b.ld);
        }
        assert_eq!(blocked.cache.len(), whole.cache.len(), "{name}");
        for (p, a) in blocked.cache.iter() {
            let b = whole.cache.get(p).unwrap();
            assert_eq!(a.shape(), b.shape(), "{name}: {p}");
            let far = a
                .to_vec()
                .iter()
                .zip(b.to_vec())
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max);
            assert!(far < 1e-4, "{name}: {p} differs by {far}");
        }
        let mut moved = 0;
        for ch in plan_chunks(&cells, 8).unwrap() {
            let a = run_chunk(model, &prompts, &blocked, &cells, &ch).unwrap();
            let b = run_chunk(model, &prompts, &whole, &cells, &ch).unwrap();
            for ((&c, a), b) in ch.iter().zip(&a).zip(&b) {
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    assert!(
                        (x.ld - y.ld).abs() < 1e-4,
                        "{name}: cell {c} row {i}: {} vs {}",
                        x.ld,
                        y.ld
                    );
                    if (x.ld - blocked.outcomes[cells[c].prompts[i]].ld).abs() > 1e-3 {
                        moved += 1;
                    }
                }
            }
        }
        assert!(moved > 0, "{name}: no cell changed an outcome");
    }
}

/// Stacking the blocks of a base run refuses pieces that do not belong together,
/// naming what differs.
#[test]
fn blocks_that_do_not_stack_are_refused_by_name() {
    use phaselens::hooks::{Act, ActivationCache};
    use phaselens::model::PrefixState;
    let e = PrefixState::cat(vec![
        PrefixState::new("kvc", 2, 16),
        PrefixState::new("kvc", 1, 17),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("16 tokens") && e.contains("17 tokens"), "{e}");
    assert!(PrefixState::cat(Vec::new()).is_err());
    let stacked = PrefixState::cat(vec![
        PrefixState::new("kvc", 2, 16),
        PrefixState::new("kvc", 1, 16),
    ])
    .unwrap();
    assert_eq!((stacked.rows(), stacked.len()), (3, 16));
    let dev = crate::common::dev();
    let act = |rows: usize| Act::from_vec(vec![0.5; rows * 6], vec![rows, 2, 3], &dev).unwrap();
    let (z, r) = (
        HookPoint::block(0, Site::AttnZ),
        HookPoint::block(1, Site::ResidPre),
    );
    let mut a = ActivationCache::new();
    a.insert(z, act(2));
    a.insert(r, act(2));
    let mut b = ActivationCache::new();
    b.insert(z, act(1));
    let e = ActivationCache::cat_batch(vec![a.clone(), b.clone()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("2 and 1 points"), "{e}");
    b.insert(r, act(1));
    let c = ActivationCache::cat_batch(vec![a, b]).unwrap();
    assert_eq!(c.get(&r).unwrap().shape(), &[3, 2, 3]);
}
