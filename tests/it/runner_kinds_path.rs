//! path-patching: the batched two-step routine against full forwards with the hooks'
//! own actions, and the kind end to end (tables, report, redraw, resume).

use std::sync::Arc;

use crate::common::max_rel;
use crate::common::runner::*;
use phaselens::model::LanguageModel;
use phaselens::output::{LONG_COLUMNS, LongRow, Table, read_long_rows, validate_columns};
use phaselens::runner::kinds::patch_heads::Direction;
use phaselens::runner::kinds::path_patching::{
    PathCell, PathInput, Receiver, Sender, path_group, path_metric, path_routine_cells,
};
use phaselens::runner::patching::{
    ChunkPath, Positions, Prompts, base_run, captures_for, plan_chunks, plan_suffix,
    run_cell_naive, run_chunk_with, run_stages,
};
use phaselens::runner::progress::Progress;
use phaselens::runner::report::draw_all;
use phaselens::runner::{ProgressMode, run_experiment};
use phaselens::tasks::TokenSpace;

/// Senders in layers 0 and 1; per later layer a q, a k and a v receiver; both
/// directions.
fn paths_of(model: &dyn LanguageModel) -> (Vec<Sender>, Vec<PathCell>) {
    let info = model.info();
    let senders = vec![Sender { layer: 0, head: 1 }, Sender { layer: 1, head: 0 }];
    let mut cells = Vec::new();
    for direction in [Direction::Denoise, Direction::Noise] {
        for (si, s) in senders.iter().enumerate() {
            for layer in s.layer + 1..info.n_layers() {
                let l = &info.layers[layer];
                for (input, head) in [
                    (PathInput::Q, l.n_heads - 1),
                    (PathInput::K, 0),
                    (PathInput::V, l.n_kv_heads - 1),
                ] {
                    cells.push(PathCell {
                        sender: si,
                        receiver: Receiver { layer, head, input },
                        direction,
                    });
                }
            }
        }
    }
    (senders, cells)
}

/// Path patching through the routine (`path_group`: batched stage and cell forwards,
/// suffix forwards where the sender's positions allow) against the naive oracle (two
/// plain forwards per cell with the hooks' own actions), at all, answer and final-band
/// positions; at given positions also against the routine's every-position forwards.
fn routine_equals_naive(model: &dyn LanguageModel, prompts: &Prompts, name: &str) {
    let (senders, cells) = paths_of(model);
    let n = prompts.n() / 2;
    // 2n rows: chunks of two cells, stage forwards of two senders.
    let max_rows = 2 * n;
    for positions in [Positions::All, Positions::Answer, Positions::Final(3)] {
        let what = format!("{name}, {positions:?}");
        let routine = path_routine_cells(&senders, &cells, &positions, n);
        let mut progress = Progress::new(ProgressMode::Hidden, "test", "cells", 0);
        let (_, out) = path_group(
            model,
            prompts,
            &senders,
            &cells,
            &positions,
            max_rows,
            &mut progress,
        )
        .unwrap();
        let base = base_run(model, prompts, &captures_for(&routine).unwrap()).unwrap();
        let got: Vec<f32> = out.iter().flatten().map(|o| o.ld).collect();
        let mut want = Vec::new();
        for c in &routine {
            want.extend(
                run_cell_naive(model, prompts, &base, c)
                    .unwrap()
                    .iter()
                    .map(|o| o.ld),
            );
        }
        assert_eq!(got.len(), want.len(), "{what}");
        let rel = max_rel(&got, &want);
        assert!(rel <= 1e-5, "{what}: routine vs naive, max rel {rel}");
        // The paths move the logit differences (the comparison is not vacuous).
        let base_ld = routine
            .iter()
            .flat_map(|c| c.prompts.iter().map(|&p| base.outcomes[p].ld));
        let moved = got
            .iter()
            .zip(base_ld)
            .filter(|(a, b)| (*a - b).abs() > 1e-3)
            .count();
        assert!(
            moved * 4 > got.len(),
            "{what}: {moved} of {} moved",
            got.len()
        );
        if positions == Positions::All {
            continue;
        }
        // At given positions every chunk runs as a suffix forward; every-position
        // forwards (stages and chunks) give the same outcomes.
        let chunks = plan_chunks(&routine, max_rows).unwrap();
        for ch in &chunks {
            assert!(plan_suffix(prompts, &routine, ch).is_some(), "{what}");
        }
        let mut full = base.clone();
        full.stages = Arc::new(
            run_stages(model, prompts, &base, &routine, max_rows, ChunkPath::Full).unwrap(),
        );
        let mut slow = Vec::new();
        let mut fast = Vec::new();
        for ch in &chunks {
            let o = run_chunk_with(model, prompts, &full, &routine, ch, ChunkPath::Full).unwrap();
            slow.extend(o.iter().flatten().map(|o| o.ld));
            fast.extend(ch.iter().flat_map(|&c| out[c].iter().map(|o| o.ld)));
        }
        let rel = max_rel(&fast, &slow);
        assert!(
            rel <= 1e-5,
            "{what}: suffix vs full forwards, max rel {rel}"
        );
    }
}

#[test]
fn path_patching_routine_equals_naive_on_kvc() {
    let model = random_model(&tiny(3, 4, 2, 4, 4), 9);
    let space = TokenSpace::default_synthetic();
    let prompts = crate::runner_patch::tiny_prompts(&space, 3, 4);
    routine_equals_naive(&model, &prompts, "kvc");
}

#[test]
fn path_patching_routine_equals_naive_on_deepseek_v4() {
    routine_equals_naive(
        &crate::edges::tiny_v4(13),
        &pair_prompts(16, 1),
        "deepseek-v4",
    );
}

fn rows(path: &std::path::Path) -> Vec<LongRow> {
    let t = Table::read_arrow(path).unwrap();
    validate_columns(&t, LONG_COLUMNS).unwrap();
    assert!(path.with_extension("parquet").exists());
    read_long_rows(&t).unwrap()
}

#[test]
fn path_patching_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    two_value_organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 31);
    let text = "[experiment]\nkind = \"path-patching\"\nbootstrap_reps = 40\n\n[model]\norganism = \"tiny\"\n\n[task]\nn_logical = 8\n\n[path]\nsender_layers = [0]\nreceiver_layers = [1]\n";
    let exp = experiment(d, "pp.toml", text);
    let s = run_experiment(&exp, &opts(d)).unwrap();
    // 4 senders x (4 q + 2 k + 2 v receivers) x 4 phases.
    assert_eq!(s.stats.cells_computed, 4 * 8 * 4);
    let table = d.join("notebooks-data/pp/paths.arrow");
    let rows = rows(&table);
    for (input, h) in [(PathInput::Q, 3), (PathInput::K, 1), (PathInput::V, 0)] {
        let m = path_metric(Direction::Denoise, input, 1, h);
        let rs: Vec<&LongRow> = rows.iter().filter(|r| r.metric == m).collect();
        assert_eq!(rs.len(), 4 * 5, "{m}: 4 senders x (4 phases + pooled)");
        assert!(rs.iter().all(|r| r.layer == Some(0)));
    }
    let rep = d.join("reports/pp");
    let md = std::fs::read_to_string(rep.join("report.md")).unwrap();
    assert!(md.contains("Strongest paths"), "{md}");
    std::fs::remove_dir_all(&rep).unwrap();
    draw_all(&d.join("notebooks-data"), &d.join("reports"), Some("pp")).unwrap();
    assert!(rep.join("report.md").exists());
    let again = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(again.stats.cells_computed, 0);
    assert_eq!(again.stats.cells_resumed, 4 * 8 * 4);
    // No receiver after the senders: an error naming the key.
    let bad = experiment(
        d,
        "bad.toml",
        "[experiment]\nkind = \"path-patching\"\n[model]\norganism = \"tiny\"\n[path]\nsender_layers = [1]\nreceiver_layers = [0, 1]\n",
    );
    let err = run_experiment(&bad, &opts(d)).unwrap_err().to_string();
    assert!(err.contains("receiver_layers"), "{err}");
}
